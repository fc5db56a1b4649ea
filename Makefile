# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test install lint

install: $(VENV)/.installed

# torch==2.13.0 is pinned in pyproject.toml: that is the CPU wheel on this machine's disk.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

demo: install
	$(BIN)/tether train --config configs/countdown.yaml

test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check src tests benchmarks

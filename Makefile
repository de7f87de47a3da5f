# Commands (DESIGN.md contract): make setup | make train | make test
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)
# Never let pip resolve torch unpinned: that pulls a multi-GB CUDA build. 2.13.0 is the CPU wheel on disk.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup train test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q "$(TORCH_PIN)" -e ".[dev]"
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

train: setup
	$(BIN)/python launch.py $(ARGS)

test: setup
	$(BIN)/python -m pytest -q -ra --durations=20 tests $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf runs outputs .pytest_cache

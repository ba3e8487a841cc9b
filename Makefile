# One command sets everything up and runs the tests: `make test`.
# It is idempotent: the virtual environment is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# the CPU wheel first: a looser requirement would pull a multi-GB CUDA build
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

test: lint
	$(BIN)/pytest -q

bench: $(STAMP)
	$(BIN)/python bench/optim_step.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache

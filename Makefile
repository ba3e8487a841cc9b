# One command sets everything up and runs the tests: `make test`.
# It is idempotent: the virtual environment is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast lint bench clean browser

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
	$(BIN)/lint-imports --no-cache

# The dashboard's browser test drives Debian's chromium: installed when missing, where we may (root
# with apt); elsewhere that one test says why it skips.
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	  chromium >/dev/null; } || echo "chromium is not installed: the dashboard's browser test will skip"

test: lint browser
	$(BIN)/pytest -q --durations=12

# the unit tier, for iteration: no processes, no peers, no training runs (under a minute)
test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not slow and not integration"

bench: $(STAMP)
	$(BIN)/python bench/optim_step.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .import_linter_cache

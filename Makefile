# One command sets everything up and runs every test, as CI does: `make check`. `make test` leaves
# out the system tier (whole swarms for fixed minutes) and takes at most 12 minutes on two cores.
# It is idempotent: the virtual environment is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup check test test-system test-fast lint bench clean browser iptables base-image compose-up compose-down

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

# The NAT testbed's routers need iptables: installed when missing, where we may (root with apt);
# elsewhere tests/test_nat.py says why it skips.
iptables:
	@command -v iptables >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	  iptables >/dev/null; } || echo "iptables is not installed: the NAT testbed's test will skip"

# The tiers: the tests not marked integration side by side on every core, then the daemons one test
# at a time (real processes, whose rounds and time bounds assume the machine is theirs).
UNITS := $(BIN)/pytest -q -n auto -m "not integration"
DAEMONS := $(BIN)/pytest -q --durations=12 -m

check: lint browser iptables
	$(UNITS)
	$(DAEMONS) "integration"

test: lint browser iptables
	$(UNITS)
	$(DAEMONS) "integration and not system"

test-system: $(STAMP) browser iptables
	$(DAEMONS) "system"

# the unit tier, for iteration: no processes, no peers, no training runs (under a minute)
test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not slow and not integration"

bench: $(STAMP)
	$(BIN)/python bench/optim_step.py

# The compose network (docker-compose.yml): a bootstrap and two workers on this host, needing a running
# Docker engine and Compose (`docker compose`, or Debian's `docker-compose`). The image's base is the
# registry's python:3.11-slim where it can be pulled, else one made here once from Debian's packages
# (deploy/make_base_image.sh: root, debootstrap). compose-down removes containers, network and volumes.
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)
COMPOSE_PROJECT := cgad-node

base-image:
	@deploy/base_image.sh

# the three services share one image: built once (through the bootstrap), then started
compose-up:
	base=$$(deploy/base_image.sh) && CGAD_BASE_IMAGE=$$base $(COMPOSE) -p $(COMPOSE_PROJECT) build bootstrap
	$(COMPOSE) -p $(COMPOSE_PROJECT) up -d
	@echo "bootstrap: metrics http://127.0.0.1:9100/metrics, dashboard http://127.0.0.1:7781/"

compose-down:
	$(COMPOSE) -p $(COMPOSE_PROJECT) down --volumes --remove-orphans

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .import_linter_cache

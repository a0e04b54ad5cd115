# pycompactor: `make help` lists the targets.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help demo test lint typecheck pytest bench clean

help: ## show this help
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP) ## create .venv and install pycompactor with test extras

demo: $(STAMP) ## run the demo on a throwaway local PostgreSQL (no API key needed)
	@scripts/require-postgres
	$(BIN)/pycompactor demo

test: lint typecheck pytest ## ruff, mypy --strict and the whole test suite

lint: $(STAMP) ## ruff
	$(BIN)/ruff check pycompactor tests migrations bench

typecheck: $(STAMP) ## mypy --strict
	$(BIN)/mypy

pytest: $(STAMP) ## the test suite against a throwaway cluster
	@scripts/require-postgres
	$(BIN)/pytest $(PYTEST_ARGS)

bench: $(STAMP) ## benchmarks vs plain SQL on a durable throwaway cluster (~15 min; docs/benchmarks.md)
	@scripts/require-postgres
	$(BIN)/python -m bench.run $(BENCH_ARGS)

clean: ## remove the virtualenv and build output
	rm -rf $(VENV) build dist *.egg-info

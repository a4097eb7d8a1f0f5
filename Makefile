# The two commands for a fresh machine: `make demo` (the main job) and `make test`.
# Each creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/hotswap demo

lint: $(STAMP)
	$(BIN)/ruff check hotswap tests benchmarks examples
	$(BIN)/ruff format --check hotswap tests benchmarks examples

test: $(STAMP) lint
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV)

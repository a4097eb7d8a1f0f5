"""Which test environment this is: the main one (the pinned transformers) or .venv-newest (the
newest transformers on the registry, pyproject's [newest] extra). tests/newest_transformers/ runs
only in the second; `make test` runs both."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

# What tests/newest_transformers/ needs: the first transformers that writes what they check
# (e.g. the Gemma GGUF tokenizer as llama.cpp's); the Makefile's [newest] pin is at least this.
NEWEST_TRANSFORMERS = "5.25"


def is_newest() -> bool:
    try:
        return Version(version("transformers")) >= Version(NEWEST_TRANSFORMERS)
    except PackageNotFoundError:
        return False

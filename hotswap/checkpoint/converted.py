"""A GGUF file's tensors dequantized, cached: the GGUF reader's detail (`weights/readers.py`).

Dequantizing a quantized GGUF file costs more than the rest of a warm start (SmolLM2-135M
Q4_1: about 1 s with `gguf`, plus the q/k unpermute). The result depends only on the file,
the dtype and the reading code, so the first read stores it (when it took over
`WORTH_CACHING_S`) as one safetensors file of HF-named tensors (the project's own codec,
`safetensors_io.py`: no pickle) under the hotswap cache directory (`weights/`), and a later
read loads it back. The entry is keyed by the file's resolved path, size and modification
time, the dtype, every HF tensor's name and shape (the spec table's, so a layout change is a
new entry) and the source of the modules that do the reading. An entry that is missing,
stale or unreadable is a miss.

A cached copy is as large as the dequantized tensors (650 MB in float32 for SmolLM2-135M),
so one entry per file is kept: storing a new one drops the file's older ones. Delete
`weights/` to reclaim the space. Loaded tensors are views of one buffer read from the entry
(nothing aliases the file) and go through the same plan and placing as any other source.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numpy as np

from hotswap.cache_dir import cache_dir
from hotswap.checkpoint.payload import decode_safetensors
from hotswap.checkpoint.safetensors_io import write_safetensors
from hotswap.errors import PayloadError
from hotswap.model.config import ModelConfig
from hotswap.model.spec import hf_specs

FORMAT = 2  # bump when an entry's layout changes
# Files converted faster than this are not stored: reading them back would save little
# (and the seeded files tests write would only fill the cache).
WORTH_CACHING_S = 0.25
_HERE = Path(__file__).resolve().parent
# The code a cached read comes from: the GGUF reader, the HF names, the spec table.
_CONVERSION = (_HERE / "gguf_io.py", _HERE / "hf.py", _HERE.parent / "model" / "spec.py")


@functools.cache
def _conversion_hash() -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in _CONVERSION)).hexdigest()


def _entry(source: Path, cfg: ModelConfig, dtype: np.dtype) -> Path:
    st = source.stat()
    specs = sorted((name, s.hf_shape) for name, s in hf_specs(cfg).items())
    key = repr((FORMAT, st.st_size, st.st_mtime_ns, str(dtype), specs, _conversion_hash()))
    return _root() / f"{_file_tag(source)}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"


def _root() -> Path:
    return cache_dir() / "weights"


def _file_tag(source: Path) -> str:
    """The part of an entry's name that names its source file: one entry per file is kept."""
    return hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:16]


def load(source: Path, cfg: ModelConfig, dtype: np.dtype) -> dict[str, np.ndarray] | None:
    """The tensors read earlier from `source` for `cfg` and `dtype`, or None.

    The entry is read whole into one fresh buffer (a single read, no memory map) and the
    tensors are views of it: they alias nothing outside this process."""
    try:
        with open(_entry(source, cfg, dtype), "rb") as f:
            buf = np.empty(os.fstat(f.fileno()).st_size, np.uint8)
            if f.readinto(memoryview(buf)) != buf.size:
                return None
        tensors = decode_safetensors(buf)
    except (OSError, PayloadError):
        return None
    if not tensors or any(a.dtype != dtype for a in tensors.values()):
        return None
    return tensors


def store(source: Path, cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype: np.dtype) -> None:
    """Keep `tensors` (read from `source`) for later reads. Best effort: skipped on error."""
    target = _entry(source, cfg, dtype)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        write_safetensors(tmp, {name: np.asarray(a) for name, a in tensors.items()})
        tmp.replace(target)  # atomic: a concurrent reader sees no entry or a whole one
        # Entries of this file from before (another dtype, an edited file or reading code)
        # are dropped: each is as large as the tensors, and nothing would ever read most again.
        for old in _root().glob(f"{_file_tag(source)}-*.safetensors"):
            if old != target:
                old.unlink(missing_ok=True)
    except (OSError, ValueError, TypeError):
        return

"""A GGUF file's weights as params, cached: dequantized and in the params layout, once.

Turning a quantized GGUF file into params costs more than the rest of a warm start
(SmolLM2-135M Q4_1: about 1 s to dequantize with `gguf`, 0.5 s more to unpermute q/k,
transpose to `[in, out]` and copy). The result depends only on the file, the dtype and
the conversion code, so the first load stores it (when converting took over
`WORTH_CACHING_S`) as one safetensors file (the project's own codec,
`safetensors_io.py`: no pickle) under the hotswap cache directory (`weights/`), and a
later load reads it back. The entry is keyed by the file's resolved
path, size and modification time, the dtype, every parameter's name, shape and dtype
(the spec table's, so a layout change is a new entry) and the source of the modules that
do the conversion. An entry that is missing, stale or unreadable is a miss.

A cached copy is as large as the params (650 MB in float32 for SmolLM2-135M, its
untied head included), so one entry per file is kept: storing a new one drops the file's
older ones. Delete `weights/` to reclaim the space. Loaded params are views of one
buffer read from the entry (nothing aliases the file) and go through the same
validation as any other (`weights/ingest.py`).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import jax
import numpy as np

from hotswap.cache_dir import cache_dir
from hotswap.checkpoint import hf
from hotswap.checkpoint.payload import decode_safetensors
from hotswap.checkpoint.safetensors_io import write_safetensors
from hotswap.errors import PayloadError
from hotswap.model.config import ModelConfig
from hotswap.model.spec import Params, ParamSpec, param_specs, path_name

FORMAT = 1  # bump when an entry's layout changes
# Files converted faster than this are not stored: reading them back would save little
# (and the seeded files tests write would only fill the cache).
WORTH_CACHING_S = 0.25
_HERE = Path(__file__).resolve().parent
# The code a cached conversion comes from: the GGUF reader, the HF layout change, the spec table.
_CONVERSION = (_HERE / "gguf_io.py", _HERE / "hf.py", _HERE.parent / "model" / "spec.py")


@functools.cache
def _conversion_hash() -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in _CONVERSION)).hexdigest()


def _specs(cfg: ModelConfig) -> list[ParamSpec]:
    tree = param_specs(cfg)
    return [
        tree["embed"],
        *(s for layer in tree["layers"] for s in layer.values()),
        tree["final_norm"],
        tree["lm_head"],
    ]


def _entry(source: Path, cfg: ModelConfig, dtype: np.dtype) -> Path:
    st = source.stat()
    specs = [(s.name, s.shape) for s in _specs(cfg)]
    key = repr((FORMAT, st.st_size, st.st_mtime_ns, str(dtype), specs, _conversion_hash()))
    return _root() / f"{_file_tag(source)}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"


def _root() -> Path:
    return cache_dir() / "weights"


def _file_tag(source: Path) -> str:
    """The part of an entry's name that names its source file: one entry per file is kept."""
    return hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:16]


def load(source: Path, cfg: ModelConfig, dtype: np.dtype) -> Params | None:
    """The params converted earlier from `source` for `cfg` and `dtype`, or None.

    The entry is read whole into one fresh buffer (a single read, no memory map) and the
    params are views of it: they alias nothing outside this process."""
    try:
        with open(_entry(source, cfg, dtype), "rb") as f:
            buf = np.empty(os.fstat(f.fileno()).st_size, np.uint8)
            if f.readinto(memoryview(buf)) != buf.size:
                return None
        tensors = decode_safetensors(buf)
    except (OSError, PayloadError):
        return None
    params = hf.empty_tree(cfg)
    for spec in _specs(cfg):
        a = tensors.get(spec.name)
        if a is None or a.shape != spec.shape or a.dtype != dtype:
            return None
        hf.set_leaf(params, spec.path, a)
    return params


def store(source: Path, cfg: ModelConfig, params: Params) -> None:
    """Keep `params` (converted from `source`) for later loads. Best effort: skipped on error."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    dtype = np.dtype(flat[0][1].dtype)
    target = _entry(source, cfg, dtype)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        write_safetensors(tmp, {path_name(path): np.asarray(a) for path, a in flat})
        tmp.replace(target)  # atomic: a concurrent reader sees no entry or a whole one
        # Entries of this file from before (another dtype, an edited file or conversion code)
        # are dropped: each is as large as the params, and nothing would ever read most again.
        for old in _root().glob(f"{_file_tag(source)}-*.safetensors"):
            if old != target:
                old.unlink(missing_ok=True)
    except (OSError, ValueError, TypeError):
        return

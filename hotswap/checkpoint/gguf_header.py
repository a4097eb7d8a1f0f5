"""A GGUF file's parsed header, cached: its metadata and where each tensor's bytes lie.

`gguf`'s reader parses every metadata field item by item; SmolLM2's 49,152-token
vocabulary and its merges take longer to parse than its weights take to dequantize. A
file's header never changes while the file does not, so the first read stores it as
JSON under the hotswap cache directory (`gguf/`), keyed by the file's resolved path,
size and modification time, when parsing it took long enough to be worth it; later
reads memory-map the file and take each tensor at its recorded offset, with the dtype
and shape the reader gave it. A cache entry that is missing, stale or unreadable is
simply read again from the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from hotswap.cache_dir import cache_dir

FORMAT = 1  # bump when the entry's layout changes
# Headers parsed faster than this are not stored: reading them back would save nothing
# (and the seeded files tests write would only fill the cache).
WORTH_CACHING_S = 0.25


class Tensor(NamedTuple):
    """One tensor as `gguf.ReaderTensor` has it: ggml dims (innermost first), its raw data."""

    name: str
    tensor_type: int  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # a view of the memory-mapped file


def plain(value: Any) -> Any:
    """Metadata as plain Python values (numpy scalars -> int/float/bool), the same cold or cached."""
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value


def decimal32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _entry(path: Path) -> Path:
    st = path.stat()
    key = f"{FORMAT}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return cache_dir() / "gguf" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def load(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]] | None:
    """The cached header of `path`, or None (no entry, or one that does not fit the file)."""
    try:
        entry = json.loads(_entry(path).read_text())
    except (OSError, ValueError):
        return None
    mm = np.memmap(path, np.uint8, "r")
    tensors = {}
    try:
        for name, (kind, dims, dtype, shape, offset) in entry["tensors"].items():
            dt = np.dtype(dtype)
            nbytes = int(np.prod(shape)) * dt.itemsize
            if offset + nbytes > mm.size:
                return None
            data = mm[offset : offset + nbytes].view(dt).reshape(shape)
            tensors[name] = Tensor(name, kind, tuple(dims), data)
    except (KeyError, TypeError, ValueError):
        return None
    return entry["metadata"], tensors


def store(path: Path, metadata: dict[str, Any], tensors: dict[str, Tensor], offsets: dict[str, int]) -> None:
    """Write the header of `path` (best effort: a cache that cannot be written is skipped)."""
    entry = {
        "metadata": metadata,
        "tensors": {
            n: [int(t.tensor_type), list(t.shape), t.data.dtype.str, list(t.data.shape), offsets[n]]
            for n, t in tensors.items()
        },
    }
    target = _entry(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry))
        tmp.replace(target)  # atomic: a concurrent reader sees the old entry or the new one
    except (OSError, TypeError, ValueError):
        pass

"""Read and write `.safetensors` files as numpy arrays, bfloat16 included.

`safetensors.numpy` cannot *read* BF16 (numpy has no bfloat16), and most real
checkpoints are BF16, so reading parses the format directly: an 8-byte
little-endian header length, a JSON header `{name: {dtype, shape,
data_offsets}}`, then the raw little-endian bytes. Parsing it ourselves also
lets every corruption (bad header, truncated data, overlapping offsets) become
a `CheckpointError` that names the file instead of a library panic. Writing
goes through `safetensors.numpy`, which does handle ml_dtypes' bfloat16.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save, save_file

from hotswap.errors import CheckpointError

# safetensors dtype tag -> numpy dtype (all little-endian by the format's definition).
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
# A header bigger than this is not a real checkpoint (the reference impl caps it too).
_MAX_HEADER = 100 * 1024 * 1024


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    # json.loads would silently keep the last of two same-named tensors.
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def parse_safetensors(buf, source: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Split a safetensors buffer (bytes, memmap) into zero-copy arrays and the metadata.

    `source` names the file (or payload) in every error message.
    """
    size = len(buf)
    if size < 8:
        raise CheckpointError(f"{source}: not a safetensors file ({size} bytes, header missing)")
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    if n > _MAX_HEADER or 8 + n > size:
        raise CheckpointError(
            f"{source}: corrupt or truncated safetensors header (claims {n} header bytes, file has {size})"
        )
    try:
        header = json.loads(bytes(buf[8 : 8 + n]).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{source}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{source}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    data_start, data_len = 8 + n, size - 8 - n
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        try:
            tag, shape, (begin, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: corrupt header entry for tensor {name!r}: {info!r}") from e
        if tag not in _DTYPES:
            raise CheckpointError(f"{source}: tensor {name!r} has unsupported dtype {tag!r}")
        dt = _DTYPES[tag]
        nbytes = math.prod(shape) * dt.itemsize
        if not (0 <= begin <= end) or end - begin != nbytes or min(shape, default=0) < 0:
            raise CheckpointError(
                f"{source}: tensor {name!r} offsets {begin}..{end} do not match {tag}{shape} ({nbytes} bytes)"
            )
        if end > data_len:
            raise CheckpointError(
                f"{source}: truncated: tensor {name!r} ends at byte {end} "
                f"but only {data_len} data bytes exist"
            )
        if nbytes == 0:  # frombuffer rejects an offset at the very end of the buffer
            out[name] = np.zeros(shape, dt)
            continue
        flat = np.frombuffer(buf, dtype=dt, count=nbytes // dt.itemsize, offset=data_start + begin)
        out[name] = flat.reshape(shape)
    return out, metadata


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one file. The arrays view a read-only memmap: copy what you keep."""
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            raise CheckpointError(f"{path}: empty file, not a safetensors checkpoint")
        buf = np.memmap(path, dtype=np.uint8, mode="r")
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: file not found") from e
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e
    tensors, _ = parse_safetensors(buf, str(path))
    return tensors


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Write one file. `format: pt` metadata is what transformers requires to load it."""
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def safetensors_bytes(tensors: Mapping[str, np.ndarray]) -> bytes:
    """The same format in memory (for payloads and tests)."""
    return save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata={"format": "pt"})

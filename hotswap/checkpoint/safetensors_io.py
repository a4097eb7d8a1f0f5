"""Read and write `.safetensors` files as numpy arrays, bfloat16 included.

The format is parsed and written by the one safetensors codec (`payload.py`),
the same that decodes update payloads: `safetensors.numpy` cannot read BF16
(numpy has no bfloat16), and most real checkpoints are BF16. Reading memory-maps
the file and parses it strictly (the data section must be tiled exactly, as the
reference implementation requires), so every corruption (bad header, truncated
data, overlapping offsets) becomes a `CheckpointError` that names the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from hotswap.checkpoint.payload import decode_safetensors, safetensors_layout
from hotswap.errors import CheckpointError, PayloadError


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
    try:
        return decode_safetensors(buf)
    except PayloadError as e:
        raise CheckpointError(f"{path}: {e}") from e


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Write one file, tensor by tensor. `format: pt` metadata is what transformers requires to load it."""
    head, arrays = safetensors_layout(tensors, {"format": "pt"})
    with open(path, "wb") as f:
        f.write(head)
        for a in arrays:
            f.write(memoryview(a.reshape(-1).view(np.uint8)))

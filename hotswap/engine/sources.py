"""Turn any weight source into a params tree (not yet validated or placed).

Sources: an in-process params pytree (used as is), a mapping of HF tensor names
(as a trainer would save them), a local HF safetensors directory, an orbax
checkpoint directory, or safe payload bytes (safetensors). Paths must resolve
under the allowed weights root when one is set. Nothing is ever unpickled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hotswap.checkpoint import hf, orbax_io, payload
from hotswap.config import ModelConfig
from hotswap.engine.params import Params
from hotswap.errors import CheckpointError, ConfigError, WeightsMismatch


def is_params_tree(obj: Any) -> bool:
    return isinstance(obj, Mapping) and "layers" in obj and "embed" in obj


def _check_same_model(model_dir: Path, cfg: ModelConfig) -> None:
    theirs = ModelConfig.from_dir(model_dir)
    for field in (
        "arch",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "tie_word_embeddings",
    ):
        if getattr(theirs, field) != getattr(cfg, field):
            raise WeightsMismatch(
                f"{model_dir}/config.json: {field}={getattr(theirs, field)!r} but the engine serves "
                f"{getattr(cfg, field)!r}; a weight update must keep the architecture"
            )


def resolve_source(
    source: Any,
    cfg: ModelConfig,
    *,
    current: Params | None,
    partial: bool = False,
    weights_root: str | os.PathLike | None = None,
    abstract: Params | None = None,
) -> Params:
    """Any supported source -> params tree in the engine's layout and dtype."""
    base = None
    if partial:
        if current is None:
            raise WeightsMismatch(
                "a partial update needs the current weights loaded (not after sleep level 2)"
            )
        base = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), current)
    if isinstance(source, (bytes, bytearray, memoryview)):
        tensors = payload.decode_payload(bytes(source), "application/octet-stream")
        return hf.params_from_hf(cfg, tensors, partial_base=base)
    if isinstance(source, (str, os.PathLike)):
        path = orbax_io.resolve_weights_path(source, weights_root)
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a directory (expected an HF or orbax checkpoint directory)")
        if (path / "config.json").exists() or any(path.glob("*.safetensors")):
            if (path / "config.json").exists():
                _check_same_model(path, cfg)
            tensors = hf.read_hf_tensors(path)
            return hf.params_from_hf(cfg, tensors, partial_base=base)
        return orbax_io.restore_params(path, abstract)
    if is_params_tree(source):
        return source
    if isinstance(source, Mapping):
        if not all(isinstance(k, str) for k in source):
            raise WeightsMismatch("a tensor mapping must be keyed by HF tensor names (str)")
        return hf.params_from_hf(cfg, source, partial_base=base)
    raise ConfigError(
        f"unsupported weight source {type(source).__name__}: pass a params pytree, a dict of HF-named "
        "tensors, a checkpoint directory path, or safetensors bytes"
    )

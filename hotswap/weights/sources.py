"""Turn any weight source into params: a host tree (`resolve_source`) or staged on the
engine's devices (`stage_source`, the update path).

Sources: an in-process params pytree (used as is), a mapping of HF tensor names
(as a trainer would save them), a local HF safetensors directory, a GGUF file,
an orbax checkpoint directory, safe payload bytes (safetensors), a `TransferRef` to a
tree another JAX process published (`hotswap/weights/transfer.py`: pulled device to device), or a
Flax NNX state or module (`weights/nnx.py`: leaf to leaf, the arrays as they are). Paths must resolve
under the allowed weights root when one is set. Nothing is ever unpickled.

Update payloads (REST bodies, `update_weights(bytes)`, chunks) are decoded in one
place, `wire_tensors`, wherever they came in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hotswap.checkpoint import gguf_io, hf, orbax_io, payload
from hotswap.errors import CheckpointError, ConfigError, WeightsMismatch
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params
from hotswap.weights import hf_device, transfer
from hotswap.weights.ingest import StagedParams, place_params, stage_params


def _is_flax(obj: Any) -> bool:
    """An `nnx.State` or `nnx.Module`, told apart without importing flax (an optional extra)."""
    return any(c.__module__.startswith("flax.nnx") for c in type(obj).__mro__)


def _from_flax(source: Any, cfg: ModelConfig) -> Any:
    if not _is_flax(source):
        return source
    from hotswap.weights import nnx as nnx_params

    return nnx_params.params_from_state(source, cfg)


def is_params_tree(obj: Any) -> bool:
    return isinstance(obj, Mapping) and "layers" in obj and "embed" in obj


def _check_same_model(where: str, theirs: ModelConfig, cfg: ModelConfig) -> None:
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
                f"{where}: {field}={getattr(theirs, field)!r} but the engine serves "
                f"{getattr(cfg, field)!r}; a weight update must keep the architecture"
            )


def _checkpoint_dir(source: str | os.PathLike, weights_root) -> Path:
    path = orbax_io.resolve_weights_path(source, weights_root)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (expected an HF or orbax checkpoint directory)")
    return path


def wire_tensors(
    chunk: bytes | bytearray | memoryview | list | Mapping[str, Any],
    content_type: str = "application/octet-stream",
) -> Mapping[str, Any]:
    """The HF-named tensors of an update as it arrives: body bytes (safetensors or JSON, by
    `content_type`) or a parsed JSON `tensors` list are decoded here, the one place an update
    payload is decoded; a mapping of tensors is used as it is."""
    if isinstance(chunk, (bytearray, memoryview)):
        chunk = bytes(chunk)  # the decoded arrays view it: a caller's buffer may change later
    if isinstance(chunk, (bytes, list)):
        return payload.decode_payload(chunk, content_type)
    if not isinstance(chunk, Mapping) or not all(isinstance(k, str) for k in chunk):
        raise WeightsMismatch("a tensor mapping must be keyed by HF tensor names (str)")
    return chunk


def _hf_tensors(source: Any, cfg: ModelConfig, weights_root) -> Mapping[str, Any] | None:
    """The HF-named tensors a source holds, unconverted (views of the file or payload);
    None for a params tree, a transfer reference or an orbax directory."""
    if isinstance(source, transfer.TransferRef):
        return None
    if isinstance(source, (bytes, bytearray, memoryview)):
        return wire_tensors(source)
    if isinstance(source, (str, os.PathLike)) and gguf_io.is_gguf(source):
        path = orbax_io.resolve_weights_path(source, weights_root)
        _, theirs, tensors = gguf_io.read_gguf(path, dtype=cfg.dtype)
        _check_same_model(str(path), theirs, cfg)
        return tensors
    if isinstance(source, (str, os.PathLike)):
        path = _checkpoint_dir(source, weights_root)
        if not ((path / "config.json").exists() or any(path.glob("*.safetensors"))):
            return None
        if (path / "config.json").exists():
            _check_same_model(f"{path}/config.json", ModelConfig.from_dir(path), cfg)
        return hf.read_hf_tensors(path)
    if is_params_tree(source):
        return None
    if isinstance(source, Mapping):
        return wire_tensors(source)
    raise ConfigError(
        f"unsupported weight source {type(source).__name__}: pass a params pytree, a dict of HF-named "
        "tensors, a checkpoint directory or .gguf file path, safetensors bytes, or a hotswap.weights.transfer.TransferRef"
    )


def _partial_base(current: Params | None, partial: bool) -> Params | None:
    """The params a partial update fills in: the current ones, as they are (no copy)."""
    if not partial:
        return None
    if current is None:
        raise WeightsMismatch("a partial update needs the current weights loaded (not after sleep level 2)")
    return current


def resolve_source(
    source: Any,
    cfg: ModelConfig,
    *,
    current: Params | None,
    partial: bool = False,
    weights_root: str | os.PathLike | None = None,
    abstract: Params | None = None,
) -> Params:
    """Any supported source -> params tree in the engine's layout and dtype, on the host for
    HF-named sources (what a multihost driver broadcasts). Not yet validated or placed."""
    source = _from_flax(source, cfg)
    base = _partial_base(current, partial)
    tensors = _hf_tensors(source, cfg, weights_root)
    if tensors is not None:
        if base is not None:
            base = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), base)
        return hf.params_from_hf(cfg, tensors, partial_base=base)
    if is_params_tree(source):
        return source
    if isinstance(source, transfer.TransferRef):
        if abstract is None:
            raise ConfigError("a transfer pull needs the engine's abstract params (its shardings)")
        return transfer.pull(source, abstract)
    return orbax_io.restore_params(_checkpoint_dir(source, weights_root), abstract)


def stage_source(
    source: Any,
    cfg: ModelConfig,
    *,
    current: Params | None,
    abstract: Params,
    partial: bool = False,
    weights_root: str | os.PathLike | None = None,
    check_finite: bool = True,
) -> StagedParams:
    """Any supported source -> params validated and placed on `abstract` (the engine's path).

    HF-named sources are converted on the device (`hf_device.py`): each tensor
    goes over in the file's layout, is transposed and cast there, and a NaN is
    reported under its HF name. A partial update keeps the current leaves as
    they are (no host round trip) and scans only the tensors it brings. Other
    sources go through `resolve_source` and `ingest.stage_params`. Either way each
    source is validated once.
    """
    source = _from_flax(source, cfg)
    base = _partial_base(current, partial)
    tensors = _hf_tensors(source, cfg, weights_root)
    if tensors is None:
        params = resolve_source(source, cfg, current=current, weights_root=weights_root, abstract=abstract)
        return stage_params(params, abstract, check_finite=check_finite)
    params = hf_device.hf_to_device(cfg, tensors, abstract, base=base, check_finite=check_finite)
    # Checked by name, shape and dtype before the conversion, which built the tree from the spec
    # table on `abstract`'s shardings; kept leaves of a partial update are the current, placed ones.
    return StagedParams(place_params(params, abstract), abstract)

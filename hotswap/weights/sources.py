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

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hotswap.checkpoint import gguf_io, hf, orbax_io, payload
from hotswap.errors import CheckpointError, ConfigError, WeightsMismatch
from hotswap.model import lora, validate
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params
from hotswap.weights import hf_device, transfer
from hotswap.weights import lora as lora_source
from hotswap.weights.ingest import StagedParams, place_params, stage_params


def _is_flax(obj: Any) -> bool:
    """An `nnx.State` or `nnx.Module`, told apart without importing flax (an optional extra)."""
    return any(c.__module__.startswith("flax.nnx") for c in type(obj).__mro__)


def is_params_tree(obj: Any) -> bool:
    return isinstance(obj, Mapping) and "layers" in obj and "embed" in obj


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


@dataclasses.dataclass(frozen=True)
class Read:
    """What a source holds, read but not converted: HF-named tensors (views of the file or
    payload; checked when they are converted), or a params tree, `validated` when its
    reader already ran the validator on it (a transfer manifest, orbax metadata, NNX names)."""

    tensors: Mapping[str, Any] | None = None
    tree: Params | None = None
    validated: bool = False


def read(source: Any, cfg: ModelConfig, *, weights_root=None, abstract: Params | None = None) -> Read:
    """One reader per form. A source that states its config (config.json, GGUF metadata)
    must be the engine's model; everything else is the validator's, once, later (or, for a
    transfer or an orbax checkpoint, before any byte moves)."""
    if _is_flax(source):
        from hotswap.weights import nnx as nnx_params  # the [tunix] extra: flax

        tree = nnx_params.params_from_state(source, cfg, abstract)
        return Read(tree=tree, validated=abstract is not None)
    if isinstance(source, transfer.TransferRef):
        if abstract is None:
            raise ConfigError("a transfer pull needs the engine's abstract params (its shardings)")
        return Read(tree=transfer.pull(source, abstract), validated=True)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return Read(tensors=wire_tensors(source))
    if isinstance(source, (str, os.PathLike)) and gguf_io.is_gguf(source):
        path = orbax_io.resolve_weights_path(source, weights_root)
        _, theirs, tensors = gguf_io.read_gguf(path, dtype=cfg.dtype)
        validate.same_model(str(path), theirs, cfg)
        return Read(tensors=tensors)
    if isinstance(source, (str, os.PathLike)):
        path = _checkpoint_dir(source, weights_root)
        if (path / "config.json").exists():
            validate.same_model(f"{path}/config.json", ModelConfig.from_dir(path), cfg)
        elif not any(path.glob("*.safetensors")):
            return Read(tree=orbax_io.restore_params(path, abstract), validated=abstract is not None)
        return Read(tensors=hf.read_hf_tensors(path))
    if is_params_tree(source):
        return Read(tree=source)
    if isinstance(source, Mapping):
        return Read(tensors=wire_tensors(source))
    raise ConfigError(
        f"unsupported weight source {type(source).__name__}: pass a params pytree, a dict of HF-named "
        "tensors, a checkpoint directory or .gguf file path, safetensors bytes, or a hotswap.weights.transfer.TransferRef"
    )


def partial_base(current: Params | None, partial: bool) -> Params | None:
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
    HF-named sources (what a multihost driver broadcasts). Not yet checked for NaN/Inf or
    placed: that is the update's (`stage_source`)."""
    base = partial_base(current, partial)
    got = read(source, cfg, weights_root=weights_root, abstract=abstract)
    if got.tensors is None:
        return got.tree
    if base is not None:
        base = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), base)
    return hf.params_from_hf(cfg, got.tensors, partial_base=base)


def stage_adapter(
    adapter: lora_source.AdapterSource,
    cfg: ModelConfig,
    *,
    current: Params | None,
    abstract: Params,
    check_finite: bool = True,
    lora_alpha: float | None = None,
) -> StagedParams:
    """A LoRA adapter already read, merged into `current`, the base weights, on their devices:
    the staged params serve W + (alpha / r)·A·B and keep `current` as their base."""
    if current is None:
        raise WeightsMismatch("a LoRA adapter needs base weights loaded (not after sleep level 2)")
    factors = lora_source.stage(adapter, cfg, abstract, lora_alpha=lora_alpha, check_finite=check_finite)
    return StagedParams(lora.merge(current, factors), abstract, base=current)


def stage_source(
    source: Any,
    cfg: ModelConfig,
    *,
    current: Params | None,
    abstract: Params,
    partial: bool = False,
    weights_root: str | os.PathLike | None = None,
    check_finite: bool = True,
    lora_alpha: float | None = None,
) -> StagedParams:
    """Any supported source -> params validated and placed on `abstract`: the engine's one
    path, for an update and for its first load (an update into an empty state).

    `read` -> validate (once, by the source's own names) -> place with one finiteness pass.
    HF-named sources are converted on the device (`hf_device.py`): each tensor goes over in
    the file's layout, is transposed and cast there, and a NaN is reported under its HF
    name. A partial update keeps the current leaves as they are (no host round trip) and
    scans only the tensors it brings. Params trees are placed by `ingest.stage_params`.

    A LoRA adapter (`weights/lora.py`: PEFT, an NNX `LoRAParam` state, a params-layout tree)
    is merged into `current` (`stage_adapter`).
    """
    adapter = lora_source.read(source, cfg, weights_root=weights_root)
    if adapter is not None:
        return stage_adapter(
            adapter, cfg, current=current, abstract=abstract, check_finite=check_finite, lora_alpha=lora_alpha
        )
    base = partial_base(current, partial)
    got = read(source, cfg, weights_root=weights_root, abstract=abstract)
    if got.tensors is None:
        return stage_params(got.tree, abstract, check_finite=check_finite, validated=got.validated)
    params = hf_device.hf_to_device(cfg, got.tensors, abstract, base=base, check_finite=check_finite)
    # Checked by name, shape and dtype before the conversion, which built the tree from the spec
    # table on `abstract`'s shardings; kept leaves of a partial update are the current, placed ones.
    return StagedParams(place_params(params, abstract), abstract)

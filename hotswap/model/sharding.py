"""Tensor-parallel sharding: the mesh, the logical axes of every array, and the one rules table.

Arrays are described by *logical* axis names ("heads", "mlp", "vocab", ...): a
param's are its row of the spec table (`spec.py`), the KV cache's are `KV_AXES`.
`RULES` maps those names to mesh axes and is the only place in hotswap that
names a mesh axis. The layout is Megatron-style: q/k/v ([D, H, hd]) are split
by head and gate/up by output column (mlp), o ([Hq, hd, D]) by its input heads and
down by input row, so each layer needs one
all-reduce after attention and one after the MLP, and the KV cache is split by
kv head, so attention itself never leaves the device that holds its heads.

With more devices than kv heads (tp a multiple of num_kv_heads), each kv head is replicated
over `kv_replicas` = tp / num_kv_heads devices, as vLLM and tpu-inference do: every device
holds one kv head's pages (the cache has tp cached heads, `Backend.kv_replicas`) and its q
heads are that head's. wk/wv (and their biases) are then replicated, `KV_REPLICATED` in place
of `RULES`: their [D, Hkv, hd] cannot be split over more devices than heads on a 1-D mesh, and
they are small (Hkv * hd columns); every device computes the step's few K/V rows for all
heads and keeps its own.

Params stay a plain pytree; shardings are a params-shaped tree of
`NamedSharding` that `Engine(shardings=..., kv_sharding=...)` places them on.
The jitted step is an ordinary `jax.jit`: GSPMD propagates these input
shardings through the forward pass. `tests/engine/test_sharding.py` reads the
compiled HLO to check what it chooses: per step, 2 all-reduces of [B, C, D]
per layer plus one for the embedding, no collective on any KV-sized array
(the interleaved K/V reshapes split a sharded major dim, so they stay local),
and the sampler all-gathers only [B, V] logit rows (for top-k/sort) and
[B, tp] argmax partials.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hotswap.errors import ConfigError
from hotswap.kernels.backend import Backend
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params
from hotswap.model.spec import is_spec, param_specs

TP = "tp"  # the tensor-parallel mesh axis

# Logical axis -> mesh axis (None: replicated). The only table that names mesh axes.
RULES: dict[str, str | None] = {
    # Embedding rows and lm_head columns. Vocab-sharded rows cost one [B, C, D] all-reduce
    # per step (GSPMD does a masked local lookup, never an all-gather of the table) and
    # save (tp-1)/tp of the V*D table on every device. Logits come out vocab-sharded.
    "vocab": TP,
    "embed": None,  # the residual stream D is replicated between layers
    "heads": TP,  # q heads (and o's input heads)
    "kv_heads": TP,  # k/v heads, and the KV cache's interleaved 2*kv_heads axis
    "mlp": TP,  # F
    "head_dim": None,  # within a head: attention never splits it
    # Sparse layers (model/moe.py): the router's [D, E] scores are replicated (every device
    # routes every token itself); the experts' stacked weights [E, D, F] are split by expert
    # over the same devices as the heads (expert parallelism), each expert whole on one device.
    "expert_scores": None,
    "expert": TP,
    "expert_mlp": None,
    "kv_pages": None,
    "page_slots": None,
}

# [num_pages, page_size, 2*kv_heads, head_dim]: K of head h at 2h, V at 2h+1, so a
# contiguous block of the axis holds whole (K, V) pairs when kv_heads % tp == 0.
KV_AXES = ("kv_pages", "page_slots", "kv_heads", "head_dim")
# The Pallas layout [num_pages, page_size, 2*kv_heads*head_dim] (Backend.page_shape): the lane
# axis is ordered by kv head, so it splits like kv_heads, each device its heads' whole pairs.
KV_FOLDED_AXES = ("kv_pages", "page_slots", "kv_heads")


def logical_to_spec(axes: Sequence[str | None], rules: dict[str, str | None] = RULES) -> PartitionSpec:
    """Logical axis names -> PartitionSpec through `rules` (default `RULES`)."""
    return PartitionSpec(*(rules[a] if a is not None else None for a in axes))


def make_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D ("tp",) mesh over `devices` (default: the first `tensor_parallel_size` of `jax.devices()`,
    which spans every process in a multi-host run)."""
    all_devices = list(devices) if devices is not None else jax.devices()
    if tensor_parallel_size < 1 or tensor_parallel_size > len(all_devices):
        raise ConfigError(
            f"tensor_parallel_size={tensor_parallel_size} needs that many devices; {len(all_devices)} available"
        )
    chosen = all_devices[:tensor_parallel_size]
    # Auto axes: GSPMD propagates shardings through the (unannotated) model code.
    # jax.make_mesh orders devices along the physical topology (ICI rings on TPU).
    return jax.make_mesh((tensor_parallel_size,), (TP,), (AxisType.Auto,), devices=chosen)


# The rules when kv heads are replicated (module doc): k/v projections on every device.
KV_REPLICATED: dict[str, str | None] = {**RULES, "kv_heads": None}


def tp_size(mesh: Mesh) -> int:
    missing = {a for a in RULES.values() if a is not None} - set(mesh.axis_names)
    if missing:
        raise ConfigError(f"the mesh has axes {mesh.axis_names}; hotswap shards over {sorted(missing)}")
    return int(np.prod([mesh.shape[a] for a in set(RULES.values()) if a is not None]))


def kv_replicas(cfg: ModelConfig, tp: int) -> int:
    """Devices holding each kv head's pages at tensor parallelism `tp` (module doc): 1 when tp
    divides num_kv_heads, tp / num_kv_heads when it is a multiple of it."""
    if cfg.num_heads % tp or (cfg.num_kv_heads % tp and tp % cfg.num_kv_heads):
        raise ConfigError(
            f"tensor_parallel_size={tp} must divide num_attention_heads={cfg.num_heads}, and divide "
            f"num_key_value_heads={cfg.num_kv_heads} or be a multiple of it (each kv head then "
            "replicated over tp / num_key_value_heads devices); pick such a tensor_parallel_size"
        )
    return max(tp // cfg.num_kv_heads, 1)


def check_divisible(cfg: ModelConfig, mesh: Mesh) -> None:
    tp = tp_size(mesh)
    kv_replicas(cfg, tp)
    sizes = [("vocab_size", cfg.vocab_size)]
    if len(cfg.moe_layers) < cfg.num_layers:  # some layer is dense
        sizes.append(("intermediate_size", cfg.intermediate_size))
    if cfg.num_experts:  # experts split over the devices (expert parallelism)
        sizes.append(("num_experts", cfg.num_experts))
    for name, size in sizes:
        if size % tp:
            raise ConfigError(
                f"tensor_parallel_size={tp} must divide {name}={size}"
                + (
                    " (the experts' stacked weights model.layers.*.mlp.experts are split by expert)"
                    if name == "num_experts"
                    else ""
                )
            )


def _named(mesh: Mesh, axes: Sequence[str | None], rules: dict[str, str | None] = RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, rules))


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> Params:
    """A params-shaped tree of NamedSharding: each leaf's logical axes (the spec table) through `RULES`
    (`KV_REPLICATED` when kv heads are replicated)."""
    check_divisible(cfg, mesh)
    rules = RULES if kv_replicas(cfg, tp_size(mesh)) == 1 else KV_REPLICATED
    return jax.tree.map(lambda s: _named(mesh, s.axes, rules), param_specs(cfg), is_leaf=is_spec)


def kv_sharding(cfg: ModelConfig, mesh: Mesh, folded: bool = False) -> NamedSharding:
    """Sharding of each per-layer KV page buffer: split over the interleaved 2*kv_heads axis
    (folded: the lane axis of the Pallas layout, `Backend.folded_pages`); with replicated kv
    heads that axis holds tp cached heads, one per device."""
    check_divisible(cfg, mesh)
    return _named(mesh, KV_FOLDED_AXES if folded else KV_AXES)


def engine_shardings(
    cfg: ModelConfig, tensor_parallel_size: int = 1, mesh: Mesh | None = None
) -> tuple[Params | None, NamedSharding | None]:
    """(param shardings, KV sharding) for `Engine`; (None, None) means one device, no mesh."""
    if mesh is None and tensor_parallel_size == 1:
        return None, None
    if mesh is not None and tensor_parallel_size not in (1, tp_size(mesh)):
        raise ConfigError(
            f"tensor_parallel_size={tensor_parallel_size} but the mesh's tp axis has {tp_size(mesh)} devices"
        )
    mesh = mesh if mesh is not None else make_mesh(tensor_parallel_size)
    return param_shardings(cfg, mesh), kv_sharding(cfg, mesh)


def engine_backend(
    cfg: ModelConfig,
    attention: str,
    kv: NamedSharding | None = None,
    device: jax.Device | None = None,
    *,
    deterministic: bool = False,
) -> tuple[Backend, NamedSharding | None]:
    """The engine's Backend (`Backend.choose`, from the devices its cache is on) and the KV
    sharding in that backend's page layout. `kv` None: one device, `device` (default: the
    first of `jax.devices()`; a topology's chip when compiling ahead of time)."""
    mesh = None if kv is None else kv.mesh
    devices = list(kv.device_set) if kv is not None else None if device is None else [device]
    backend = Backend.choose(
        attention,
        head_dim=cfg.head_dim,
        dtype=cfg.dtype,
        kv_dtype=cfg.kv_dtype,
        devices=devices,
        mesh=mesh,
        head_axis=RULES["kv_heads"],
        deterministic=deterministic,
        kv_replicas=1 if mesh is None else kv_replicas(cfg, tp_size(mesh)),
    )
    if mesh is not None:  # split by kv head, in the backend's page layout
        kv = kv_sharding(cfg, mesh, folded=backend.folded_pages)
    return backend, kv

"""The low-rank path: a LoRA adapter's factors applied to the weights they adapt.

An adapter is `Factors`: params name ("layers.3.wq") -> (A `[*in, r]`, B `[r, *out]`) in the
params layout (`ParamSpec.lora_shapes`), f32, with the adapter's scale (alpha / r) folded into B,
so that the adapted weight is W + (A·B).reshape(W.shape).

Merged (`merge`): the RL case, one adapter changed every step. The engine keeps the base weights
and serves a merged copy of the adapted leaves, built on the device from the base at each
update: an update reads the base and writes the adapted leaves once, and decode runs at the
base model's speed (no per-row low-rank work). Other leaves are the base's own arrays. On one
CPU device the merge is one C++ call for every adapted leaf (`kernels/cpu_lora.py`); sharded or
on an accelerator, one jit of XLA's dot and add.

By name (`Buffers`, `add`): the serving case, several adapters in one batch (the S-LoRA /
Punica shape). Each adaptable row has fixed buffers A `[*in, L*R]` and B `[L*R, *out]`, L =
max_loras slots of R = max_lora_rank columns; an adapter of rank r <= R fills the first r
columns of its slot, the rest stay zero. A step computes, per adapted matmul,
y += ((x @ A) * mask) @ B, where mask `[B, 1, L*R]` keeps each row's own slot's columns (none
for a base row): every adapter of the batch in the same two small matmuls, no batch per
adapter and no per-row gather of factors. The compiled shapes are fixed by L and R, so
loading an adapter (`write_slot`, in place) never recompiles a step.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from hotswap.kernels import cpu_lora
from hotswap.model.params import Params

Factors = dict[str, tuple[Any, Any]]  # params name -> (A [*in, r], B [r, *out]) f32, B scaled


def delta(a: jax.Array, b: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """A·B as the adapted weight's f32 delta: [in, r] x [r, out] reshaped to `shape`."""
    r = a.shape[-1]
    return (a.reshape(-1, r) @ b.reshape(r, -1)).reshape(shape)


def _merge_leaves(weights: dict[str, jax.Array], factors: Factors) -> dict[str, jax.Array]:
    """W + A·B in f32, cast back to W's dtype, for each adapted leaf (XLA's dot and add)."""
    return {
        n: (w.astype(jnp.float32) + delta(*factors[n], w.shape)).astype(w.dtype) for n, w in weights.items()
    }


def _kernel_leaves(weights: dict[str, jax.Array], factors: Factors) -> dict[str, jax.Array]:
    """`_merge_leaves` as one C++ call for every leaf (`kernels/cpu_lora.py`)."""
    names = list(weights)
    merged = cpu_lora.merge([(weights[n], *factors[n]) for n in names])
    return dict(zip(names, merged, strict=True))


@functools.cache
def _merger(shardings: tuple, kernel: bool):
    """One jit per set of adapted leaves' shardings and route, writing each merged leaf on its
    weight's sharding (jit caches a program per adapter shape: the next update of the same
    ranks reuses it)."""
    names = [n for n, _ in shardings]
    fn = _kernel_leaves if kernel else _merge_leaves
    if all(isinstance(s, (NamedSharding, SingleDeviceSharding)) for _, s in shardings):
        return jax.jit(fn, out_shardings={n: s for n, s in shardings}), names
    return jax.jit(fn), names


def uses_kernel(weights: dict[str, jax.Array], factors: Factors) -> bool:
    """The merge's one route decision: the C++ kernel when every leaf and factor is on one CPU
    device, W f32 or bf16 (`cpu_lora.usable`); else XLA's jit (sharded, TPU, GPU)."""
    return cpu_lora.usable([(w, *factors[n]) for n, w in weights.items()])


def merge(base: Params, factors: Factors) -> Params:
    """`base` with each adapted leaf replaced by W + A·B (fresh arrays on the leaf's sharding);
    every other leaf is the base's own array. `base` is untouched: the merged leaves are new
    buffers, never W's (the kept base serves the next sync)."""
    weights = {n: _get(base, n) for n in factors}
    shardings = tuple(sorted((n, w.sharding) for n, w in weights.items()))
    fn, _ = _merger(shardings, uses_kernel(weights, factors))
    new = fn(weights, factors)
    out = jax.tree.map(lambda x: x, base)  # a new tree of the same leaves
    for n, x in new.items():
        _set(out, n, x)
    return jax.block_until_ready(out)


def _keys(name: str) -> list[str | int]:
    return [int(k) if k.isdigit() else k for k in name.split(".")]


def _get(tree: Params, name: str):
    for k in _keys(name):
        tree = tree[k]
    return tree


def _set(tree: Params, name: str, value) -> None:
    *head, last = _keys(name)
    for k in head:
        tree = tree[k]
    tree[last] = value


def factor_shardings(sharding, n_in: int):
    """A `[*in, r]` and B `[r, *out]` on the devices of the weight they adapt, split as its
    in and out dims are (the rank dim whole)."""
    if not isinstance(sharding, NamedSharding):
        return sharding, sharding
    spec = tuple(sharding.spec) + (None,) * 8
    ndim = len(sharding.spec)
    a = PartitionSpec(*spec[:n_in], None)
    b = PartitionSpec(None, *spec[n_in : max(ndim, n_in + 1)])
    return NamedSharding(sharding.mesh, a), NamedSharding(sharding.mesh, b)


# ---- by name: stacked buffers, read per row ------------------------------------------------

Buffers = list  # per layer: {row key ("wq"): (A [*in, L*R], B [L*R, *out])}


def empty_buffers(specs: list, abstract_layers: list, max_loras: int, max_rank: int, dtype) -> Buffers:
    """Zero buffers for every adaptable row of every layer, on the adapted weights' devices
    (A split as the weight's in dims, B as its out dims)."""
    out = []
    for layer_specs, layer_abstract in zip(specs, abstract_layers, strict=True):
        bufs = {}
        for key, spec in layer_specs.items():
            if not spec.adaptable:
                continue
            a_shape, b_shape = spec.lora_shapes(max_loras * max_rank)
            a_sh, b_sh = factor_shardings(layer_abstract[key].sharding, len(a_shape) - 1)
            bufs[key] = (jnp.zeros(a_shape, dtype, device=a_sh), jnp.zeros(b_shape, dtype, device=b_sh))
        out.append(bufs)
    return out


def col_slots(max_loras: int, max_rank: int) -> np.ndarray:
    """int32 [L*R]: the slot each buffer column belongs to (the mask's key, `row_mask`)."""
    return (np.arange(max_loras * max_rank) // max_rank).astype(np.int32)


def row_mask(adapters: jax.Array, col_slot: jax.Array, dtype) -> jax.Array:
    """adapters [B] (slot per row, -1: base) -> [B, 1, L*R]: 1 on the row's slot's columns."""
    return (col_slot[None, :] == adapters[:, None]).astype(dtype)[:, None, :]


def with_layer(lp: dict, bufs: dict, mask: jax.Array) -> dict:
    """A layer's params with its buffers and the step's row mask, for `add`."""
    return {**lp, "lora": {**bufs, "mask": mask}}


def add(lp: dict, x: jax.Array, keys: tuple[str, ...], outs):
    """The low-rank path of the matmuls `outs` = x @ lp[key]: each out + ((x @ A) * mask) @ B.
    x [B, C, *in]; a layer without buffers (LoRA off) returns `outs` as they are."""
    lo = lp.get("lora")
    if lo is None:
        return tuple(outs)
    res = []
    for key, y in zip(keys, outs, strict=True):
        if key not in lo:
            res.append(y)
            continue
        a, b = lo[key]
        with jax.named_scope("lora"):
            xa = jnp.tensordot(x.astype(a.dtype), a, axes=a.ndim - 1) * lo["mask"]  # [B, C, L*R]
            res.append(y + jnp.tensordot(xa, b, axes=1).astype(y.dtype))  # [B, C, *out]
    return tuple(res)


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("max_rank",))
def write_slot(bufs: Buffers, slot: jax.Array, factors: list, *, max_rank: int) -> Buffers:
    """Write one adapter into slot `slot` of every row's buffers, in place (donated): factors
    per layer {key: (A [*in, r], B [r, *out]) or None (not adapted: the slot is zeroed)}. One
    program per adapter rank and target set; the step programs never see a new shape."""
    out = []
    for layer, new in zip(bufs, factors, strict=True):
        layer_out = {}
        for key, (a_buf, b_buf) in layer.items():
            pair = new.get(key)
            if pair is None:
                a = jnp.zeros((*a_buf.shape[:-1], max_rank), a_buf.dtype)
                b = jnp.zeros((max_rank, *b_buf.shape[1:]), b_buf.dtype)
            else:
                a, b = pair
                pad = max_rank - a.shape[-1]
                a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]).astype(a_buf.dtype)
                b = jnp.pad(b, [(0, pad)] + [(0, 0)] * (b.ndim - 1)).astype(b_buf.dtype)
            start = slot * max_rank
            a_buf = jax.lax.dynamic_update_slice_in_dim(a_buf, a, start, axis=a_buf.ndim - 1)
            b_buf = jax.lax.dynamic_update_slice_in_dim(b_buf, b, start, axis=0)
            layer_out[key] = (a_buf, b_buf)
        out.append(layer_out)
    return out

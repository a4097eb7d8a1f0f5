"""The low-rank path: a LoRA adapter's factors applied to the weights they adapt.

An adapter is `Factors`: params name ("layers.3.wq") -> (A `[*in, r]`, B `[r, *out]`) in the
params layout (`ParamSpec.lora_shapes`), f32, with the adapter's scale (alpha / r) folded into B,
so that the adapted weight is W + (A·B).reshape(W.shape).

Merged (`merge`): the RL case, one adapter changed every step. The engine keeps the base weights
and serves a merged copy of the adapted leaves, built on the device from the base at each
update: an update reads the base and writes the adapted leaves once, and decode runs at the
base model's speed (no per-row low-rank work). Other leaves are the base's own arrays.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, SingleDeviceSharding

from hotswap.model.params import Params

Factors = dict[str, tuple[Any, Any]]  # params name -> (A [*in, r], B [r, *out]) f32, B scaled


def delta(a: jax.Array, b: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """A·B as the adapted weight's f32 delta: [in, r] x [r, out] reshaped to `shape`."""
    r = a.shape[-1]
    return (a.reshape(-1, r) @ b.reshape(r, -1)).reshape(shape)


def _merge_leaves(weights: dict[str, jax.Array], factors: Factors) -> dict[str, jax.Array]:
    """W + A·B in f32, cast back to W's dtype, for each adapted leaf."""
    return {
        n: (w.astype(jnp.float32) + delta(*factors[n], w.shape)).astype(w.dtype) for n, w in weights.items()
    }


@functools.cache
def _merger(shardings: tuple):
    """One jit per set of adapted leaves' shardings, writing each merged leaf on its weight's
    sharding (jit caches a program per adapter shape: the next update of the same ranks
    reuses it)."""
    names = [n for n, _ in shardings]
    if all(isinstance(s, (NamedSharding, SingleDeviceSharding)) for _, s in shardings):
        return jax.jit(_merge_leaves, out_shardings={n: s for n, s in shardings}), names
    return jax.jit(_merge_leaves), names


def merge(base: Params, factors: Factors) -> Params:
    """`base` with each adapted leaf replaced by W + A·B (fresh arrays on the leaf's sharding);
    every other leaf is the base's own array. `base` is untouched."""
    weights = {n: _get(base, n) for n in factors}
    fn, _ = _merger(tuple(sorted((n, w.sharding) for n, w in weights.items())))
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

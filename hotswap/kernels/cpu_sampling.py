"""Each logits row's argmax and logsumexp on XLA:CPU: a C++ FFI call (`cpu/row_stats.cc`).

Every sampled token needs both: the greedy token is the argmax, and a token's log-prob is
its logit minus the logsumexp. XLA:CPU computes the jnp forms (`reference.argmax`,
`jax.nn.logsumexp`) as several passes over the [R, V] logits, partly as scalar code; the kernel reads each row twice from cache, 16 lanes at a time, on XLA's
intra-op threads. Same results: the first index of the max, V - 1 and NaN for a row with
NaN, -inf for an all -inf row.

Deterministic mode's row kernels live in the same library: `row_softmax` (the sampler filters'
softmax) and `row_mean_square` (the RMS norms' mean of squares), each row in one order whatever
the row count, where XLA's reductions order a row's sum by it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hotswap.kernels import cpu_build


def argmax_logsumexp(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits f32 [R, V] -> (argmax int32 [R], logsumexp f32 [R])."""
    if logits.ndim != 2 or logits.dtype != jnp.float32:
        raise ValueError(f"need f32 logits [R, V], got {logits.dtype} {logits.shape}")
    target = cpu_build.register("row_stats", "HotswapRowStats")
    r = logits.shape[0]
    return jax.ffi.ffi_call(
        target, (jax.ShapeDtypeStruct((r,), jnp.int32), jax.ShapeDtypeStruct((r,), jnp.float32))
    )(logits)


def row_softmax(logits: jax.Array) -> jax.Array:
    """softmax over the last axis of f32 [R, V], one fixed order per row (see the module doc)."""
    if logits.ndim != 2 or logits.dtype != jnp.float32:
        raise ValueError(f"need f32 logits [R, V], got {logits.dtype} {logits.shape}")
    target = cpu_build.register("row_stats", "HotswapRowSoftmax")
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(logits.shape, jnp.float32))(logits)


def row_mean_square(x: jax.Array) -> jax.Array:
    """mean(x * x) over the last axis, f32 [..., D] -> [..., 1], one fixed order per row whatever
    the row count (deterministic mode's RMS norms; XLA's reduction orders it by the row count)."""
    if x.dtype != jnp.float32:
        raise ValueError(f"need f32, got {x.dtype}")
    target = cpu_build.register("row_stats", "HotswapRowMeanSquare")
    rows = x.reshape(-1, x.shape[-1])
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows.shape[0],), jnp.float32))(rows)
    return out.reshape(*x.shape[:-1], 1)

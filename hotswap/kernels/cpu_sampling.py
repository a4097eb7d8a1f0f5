"""Each logits row's argmax and logsumexp on XLA:CPU: a C++ FFI call (`cpu/row_stats.cc`).

Every sampled token needs both: the greedy token is the argmax, and a token's log-prob is
its logit minus the logsumexp. XLA:CPU computes the jnp forms (`reference.argmax`,
`jax.nn.logsumexp`) as several passes over the [R, V] logits, partly as scalar code; the kernel reads each row twice from cache, 16 lanes at a time, on XLA's
intra-op threads. Same results: the first index of the max, V - 1 and NaN for a row with
NaN, -inf for an all -inf row.

`row_softmax` (deterministic mode's sampler filters) is each row's softmax in one order per row,
whatever the row count: XLA's sums a row in an order set by the row count.
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

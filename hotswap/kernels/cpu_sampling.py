"""The sampler's per-row kernels on XLA:CPU, C++ FFI calls: each logits row's argmax and
logsumexp (`cpu/row_stats.cc`), the keep threshold of its top-k / top-p / min-p filters
(`cpu/keep_threshold.cc`), and its categorical draw (`cpu/categorical.cc`).

Every sampled token needs the row stats: the greedy token is the argmax, and a token's log-prob
is its logit minus the logsumexp. XLA:CPU computes the jnp forms (`reference.argmax`,
`jax.nn.logsumexp`) as several passes over the [R, V] logits, partly as scalar code; the kernel
reads each row twice from cache, 16 lanes at a time, on XLA's intra-op threads. Same results:
the first index of the max, V - 1 and NaN for a row with NaN, -inf for an all -inf row.

A filtering row's threshold is a radix select (a few passes over the row); the jnp twin's
bisection takes 32 masked sums over [R, V], which XLA:CPU runs as slow scalar reductions. Every
kernel here works on each row on its own, in one order, so a row's result never depends on the
rows beside it; deterministic mode's `row_mean_square` (the RMS norms' mean of squares) lives in
the same library for that reason, where XLA's reduction orders a row's sum by the row count.
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


def row_mean_square(x: jax.Array) -> jax.Array:
    """mean(x * x) over the last axis, f32 [..., D] -> [..., 1], one fixed order per row whatever
    the row count (deterministic mode's RMS norms; XLA's reduction orders it by the row count)."""
    if x.dtype != jnp.float32:
        raise ValueError(f"need f32, got {x.dtype}")
    target = cpu_build.register("row_stats", "HotswapRowMeanSquare")
    rows = x.reshape(-1, x.shape[-1])
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows.shape[0],), jnp.float32))(rows)
    return out.reshape(*x.shape[:-1], 1)


def keep_thresholds(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """scaled f32 [R, V] (logits / temperature), top_k i32 [R], top_p f32 [R], min_p f32 [R] ->
    f32 [R]: a row keeps the entries >= its threshold (-inf: every entry). The twin of
    `reference.keep_thresholds`, as a radix select per row (no sort)."""
    if scaled.ndim != 2 or scaled.dtype != jnp.float32:
        raise ValueError(f"need f32 logits [R, V], got {scaled.dtype} {scaled.shape}")
    target = cpu_build.register("keep_threshold", "HotswapKeepThreshold")
    r = scaled.shape[0]
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((r,), jnp.float32))(
        scaled, top_k.astype(jnp.int32), top_p.astype(jnp.float32), min_p.astype(jnp.float32)
    )


def categorical(scaled: jax.Array, u: jax.Array) -> jax.Array:
    """scaled f32 [R, V] (logits / temperature, filtered entries -inf), u f32 [R] in [0, 1) ->
    int32 [R]: each row's draw by the inverse CDF, the first entry whose running probability
    passes u. The twin of `reference.categorical`: an exp per entry and one uniform per row,
    where a Gumbel-max draw pays a random number and two logs per entry."""
    if scaled.ndim != 2 or scaled.dtype != jnp.float32:
        raise ValueError(f"need f32 logits [R, V], got {scaled.dtype} {scaled.shape}")
    target = cpu_build.register("categorical", "HotswapCategorical")
    r = scaled.shape[0]
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((r,), jnp.int32))(scaled, u.astype(jnp.float32))

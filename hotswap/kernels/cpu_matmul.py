"""Matmuls for decode steps of one or two rows on XLA:CPU (`cpu/small_matmul.cc`).

XLA:CPU runs a matrix-vector product single-threaded, so a batch-1 decode step read its
weights at one core's bandwidth. The C++ kernel splits the weight rows over XLA's
intra-op threads: on bench-100m's 12 layers, 8.9 ms -> 7.4 ms per step (33 -> 40 GB/s).
From four rows on XLA's own dot was as fast or faster, so only 1-2 rows use it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hotswap.kernels import cpu_build

MAX_ROWS = 2


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N]: the C++ kernel for f32 with at most MAX_ROWS rows, else XLA's dot."""
    rows = x.size // x.shape[-1]
    if rows > MAX_ROWS or x.dtype != jnp.float32 or w.dtype != jnp.float32:
        return x @ w
    target = cpu_build.register("small_matmul", "HotswapSmallMatmul")
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows, w.shape[1]), jnp.float32))
    return out(x.reshape(rows, -1), w).reshape(*x.shape[:-1], w.shape[1])

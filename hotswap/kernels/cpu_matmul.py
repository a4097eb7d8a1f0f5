"""Matmuls for decode steps of one or two rows on XLA:CPU (`cpu/small_matmul.cc`).

XLA:CPU runs a matrix-vector product single-threaded, so a batch-1 decode step read its
weights at one core's bandwidth. The C++ kernel splits the weight rows over XLA's
intra-op threads: bench-100m's batch-1 forward step went from 12.0 to 9.3 ms.
Taking a layer's q/k/v (or gate/up) weights in one call, to share one parallel region,
measured no faster (9.6 ms), so each weight is its own call. From four rows on XLA's own
dot was as fast or faster, so only 1-2 rows use it.
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
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows, w.shape[1]), jnp.float32))(
        x.reshape(rows, -1), w
    )
    return y.reshape(*x.shape[:-1], w.shape[1])

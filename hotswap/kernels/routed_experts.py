"""The routed experts of a MoE layer for few token-expert pairs (a decode step), the jnp way:
each pair's expert matrices sliced out of the stacked weights. `Backend.routed_experts` picks
this or the C++ kernel (`cpu_experts.py`), which reads the same rows in place.

Both take x [T, D] (the normed residual), experts [T, k] int32 (each token's experts, in
[0, E)), weights [T, k] f32 (their routing weights, 0 for a pair to skip) and the stacked
gate, up [E, D, F] and down [E, F, D], and return [T, D] f32: each token's routing weighted
sum of its experts' SwiGLU MLPs, the k terms summed in f32. Each expert's output is in x's
dtype before it is weighted (as HF's experts return it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sliced(x, experts, weights, gate, up, down, *, mms) -> jax.Array:
    """The twin of `cpu_experts.routed_experts`. `mms` is the matmul routine (`Backend.matmuls`:
    on CPU the C++ small-row kernel, gate and up in one call; in deterministic mode its
    fixed-order kernel). XLA copies each slice before its dot: twice the routed bytes."""
    t, k = experts.shape
    pairs = experts.reshape(-1)  # [N = T*k], token t's at t*k ... t*k+k-1

    def expert(stack: jax.Array, e) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(stack, e, keepdims=False)

    rows = []
    for n in range(pairs.shape[0]):  # N <= E pairs: a decode step's
        e, row = pairs[n], x[n // k : n // k + 1]
        g, u = mms(row, (expert(gate, e), expert(up, e)))
        rows.append(mms(jax.nn.silu(g) * u, (expert(down, e),))[0])
    ys = jnp.concatenate(rows).reshape(t, k, -1).astype(jnp.float32)  # [T, k, D]
    return jnp.sum(ys * weights[..., None], axis=1)

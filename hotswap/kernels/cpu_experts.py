"""The routed experts of a MoE layer for few token-expert pairs on XLA:CPU (`cpu/routed_experts.cc`).

A decode step routes each token to k of the layer's E stacked experts. The jnp way
(`routed_experts.sliced`) slices each pair's matrices out of the stacks, and XLA:CPU copies
each slice into a fresh buffer before a one-row dot: every routed expert's bytes moved twice.
The kernel reads each routed expert's gate, up and down rows in place from the stacked
arguments, once for all the pairs routed to it, on XLA's intra-op threads, and returns each
token's weighted sum: a decode step reads the routed experts' bytes once and no other expert's
(docs/en/moe.md).

f32 and bf16 weights (as they are: a bf16 weight is widened in registers), f32 products and sums;
with bf16 activations the kernel rounds gate, up, their SwiGLU and each expert's output to bf16
where the jnp twin's arrays are bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hotswap.kernels import cpu_build

KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # of x and of the stacked weights


def routed_experts(x, experts, weights, gate, up, down) -> jax.Array:
    """x [T, D], experts [T, k] int32 in [0, E), weights [T, k] f32, gate/up [E, D, F], down
    [E, F, D] -> [T, D] f32 (`routed_experts.py`'s contract, one custom call). The weights
    f32 or bf16 (one dtype), x f32 or bf16."""
    if x.dtype not in KERNEL_DTYPES or gate.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the routed-experts kernel takes f32 or bf16, got x {x.dtype}, weights {gate.dtype}")
    if not gate.dtype == up.dtype == down.dtype:
        raise TypeError(f"gate, up and down of one dtype, got {gate.dtype}, {up.dtype}, {down.dtype}")
    target = cpu_build.register("routed_experts", "HotswapRoutedExperts")
    out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    return jax.ffi.ffi_call(target, out)(
        x.astype(jnp.float32),
        experts.astype(jnp.int32),
        weights.astype(jnp.float32),
        gate,
        up,
        down,
        round=bool(x.dtype == jnp.bfloat16),
    )

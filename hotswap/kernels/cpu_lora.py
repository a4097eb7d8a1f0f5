"""A LoRA adapter merged into the weights it adapts, on XLA:CPU: one C++ FFI call for every
adapted leaf (`cpu/lora_merge.cc`), the merged RL sync's route on one CPU device
(`model/lora.merge` decides).

A merged sync computes W + scale·A·B for each adapted weight: 2·r FLOP per weight element
(rank 64: 128), so the FMAs bound it, not the bytes of W. XLA:CPU ran it as a dot into a
temporary, then an add and a convert over it, leaf after leaf; the kernel sums each output
tile in AVX2 registers and writes it once, every leaf's tiles shared out over XLA's intra-op
threads in one parallel region (`docs/en/lora.md` gives the measured rates).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.kernels import cpu_build

WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

Triple = tuple[jax.Array, jax.Array, jax.Array]  # W [*in, *out], A [*in, r] f32, B [r, *out] f32


def usable(triples: Sequence[Triple]) -> bool:
    """True when the kernel can merge these (W, A, B): all on one CPU device, W f32 or bf16,
    A and B f32, and the kernels build here."""
    if not triples:
        return False
    devices = set()
    for w, a, b in triples:
        if w.dtype not in WEIGHT_DTYPES or a.dtype != jnp.float32 or b.dtype != jnp.float32:
            return False
        for x in (w, a, b):
            devices |= set(x.sharding.device_set)
    return len(devices) == 1 and next(iter(devices)).platform == "cpu" and cpu_build.available()


def _matrices(w: jax.Array, a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(W [M, N], A [M, r], B [r, N]): reshapes of row-major arrays, bitcasts on CPU."""
    r = a.shape[-1]
    m = math.prod(a.shape[:-1])
    n = w.size // m
    return w.reshape(m, n), a.reshape(m, r), b.reshape(r, n)


def merge(triples: Sequence[Triple], scale: float = 1.0) -> list[jax.Array]:
    """Each W + scale·(A·B reshaped to W's shape), in W's dtype (the sum in f32, one rounding
    to bf16): one kernel call for every triple. Call inside jit."""
    target = cpu_build.register("lora_merge", "HotswapLoraMerge")
    flat = [x for t in triples for x in _matrices(*t)]
    outs = jax.ffi.ffi_call(
        target, [jax.ShapeDtypeStruct(flat[3 * i].shape, w.dtype) for i, (w, _, _) in enumerate(triples)]
    )(*flat, scale=np.float32(scale))
    return [y.reshape(w.shape) for y, (w, _, _) in zip(outs, triples, strict=True)]


def merge_jnp(triples: Sequence[Triple], scale: float = 1.0) -> list[jax.Array]:
    """The jnp twin of `merge` (XLA's dot, add and convert)."""
    out = []
    for w, a, b in triples:
        w2, a2, b2 = _matrices(w, a, b)
        y = w2.astype(jnp.float32) + np.float32(scale) * (a2 @ b2)
        out.append(y.astype(w.dtype).reshape(w.shape))
    return out

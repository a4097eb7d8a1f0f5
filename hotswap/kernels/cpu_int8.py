"""Matmuls of f32 activations by int8 weights on XLA:CPU (`cpu/int8_matmul.cc`).

An int8 weight is `data` int8 [K, N] (the dense weight's `[in, out]` layout) and `scales` f32
[G, N]: W[k, n] = data[k, n] * scales[k // (K // G), n] (G == 1: one scale per output column).
The kernel reads `data` in place and widens it to f32 in registers, so a decode step reads a
quarter of an f32 weight's bytes and half of a bf16 one's. Weights that share x (a layer's
q/k/v, or gate/up) go in one call and one parallel region.

`exact=False` lets the kernel quantize x to int8 per row and group and multiply on AVX512_VNNI
(vpdpbusd zmm) where it has it and x has at least 16 rows: ~3x the multiply rate of the f32 path
(one Zen 4 core, a [768, 1024] weight in cache: 290-300 GFLOP/s against 92 at 64 rows), at x's
8-bit rounding (0.8% on bench-100m's gate/up: benchmarks/int8_matmul.py). AVX2 CPUs with AVX-VNNI
and no AVX-512 (Alder Lake, Sierra Forest) take the same on 8 lanes (vpdpbusd ymm): a bench-100m
layer's tiles ran ~2.1x avx2's f32 path with the EVEX instruction standing in on Zen 4 (136-138
against 65-67 GFLOP/s, 64 and 512 rows). The default never changes x.

`cpu_build.available()` does not register this kernel's target: `matmuls` registers it when first
traced, which a program loaded without tracing (programs/step_cache.py) would not do.
"""

from __future__ import annotations

import ctypes
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.kernels import cpu_build, cpu_isa
from hotswap.kernels.cpu_target import host

# The kernel's paths (cpu/int8_matmul.cc's kOffered, and scalar), best first; the first two
# quantize x (only with exact=False).
PATHS = ("avx512_vnni", "avx_vnni", "avx512", "avx2", "scalar")
QUANTIZING = ("avx512_vnni", "avx_vnni")


def runnable() -> list[str]:
    """The kernel's paths this CPU can run, best first."""
    return [path for path in cpu_isa.runnable() if path in PATHS]


@functools.cache
def _choose():
    """cpu/int8_matmul.cc's exported `Choose` (ctypes)."""
    fn = cpu_build.library("int8_matmul").HotswapInt8Path
    fn.restype = ctypes.c_int32
    fn.argtypes = [ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]
    return fn


def path_for(
    rows: int, exact: bool = True, isa: str = "auto", flags=None, packable: bool = True
) -> str | None:
    """The path a call of `rows` rows runs on a CPU with the cpuinfo `flags` (default: this one's),
    from the kernel's own table (`Choose` in cpu/int8_matmul.cc); None where the call would fail.
    `packable`: every weight has one group length, a multiple of 4 rows."""
    bits = cpu_isa.features(host().isa if flags is None else flags)
    chosen = _choose()(int(cpu_isa.attribute(isa)), bits, rows, int(bool(exact)), int(bool(packable)))
    return next((name for name, value in cpu_isa.PATHS.items() if value == chosen and name != "auto"), None)


def matmuls(x: jax.Array, weights, isa: str = "auto", exact: bool = True) -> list[jax.Array]:
    """x [..., K] @ W for each (data int8 [K, N], scales f32 [G, N]) of `weights`: f32 [..., N]
    each, in one C++ call. `isa` names a path of `cpu_isa.PATHS` ("auto": the best this CPU has;
    a path this CPU cannot run fails the call). `exact=False` allows the VNNI path, which
    quantizes x. Raises ValueError/TypeError for operands of the wrong shape or dtype."""
    attr = cpu_isa.attribute(isa)
    weights = [(data, scales) for data, scales in weights]
    if not weights:
        raise ValueError("int8 matmuls need at least one (data, scales) weight")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"int8 matmuls take floating activations, got {x.dtype}")
    k = x.shape[-1]
    for i, (data, scales) in enumerate(weights):
        if data.dtype != jnp.int8 or scales.dtype != jnp.float32:
            raise TypeError(f"weight {i}: need int8 data and f32 scales, got {data.dtype} and {scales.dtype}")
        if data.ndim != 2 or scales.ndim != 2 or data.shape[0] != k or scales.shape[1] != data.shape[1]:
            raise ValueError(
                f"weight {i}: need data [K={k}, N] and scales [G, N], got {data.shape} and {scales.shape}"
            )
        if scales.shape[0] < 1 or k % scales.shape[0]:
            raise ValueError(f"weight {i}: {scales.shape[0]} scale groups do not divide K={k}")
    lead = x.shape[:-1]
    rows = math.prod(lead)
    target = cpu_build.register("int8_matmul", "HotswapInt8Matmuls")
    outs = [jax.ShapeDtypeStruct((rows, data.shape[1]), jnp.float32) for data, _ in weights]
    operands = [part for pair in weights for part in pair]
    ys = jax.ffi.ffi_call(target, outs)(
        x.astype(jnp.float32).reshape(rows, k), *operands, isa=attr, exact=np.int32(bool(exact))
    )
    return [y.reshape(*lead, data.shape[1]) for y, (data, _) in zip(ys, weights, strict=True)]


def matmul(
    x: jax.Array, data: jax.Array, scales: jax.Array, isa: str = "auto", exact: bool = True
) -> jax.Array:
    """x [..., K] @ one int8 weight: `matmuls` with one (data, scales)."""
    return matmuls(x, [(data, scales)], isa, exact)[0]

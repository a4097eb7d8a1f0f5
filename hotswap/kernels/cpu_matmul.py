"""Matmuls for decode steps of up to 32 rows on XLA:CPU (`cpu/small_matmul.cc`).

XLA:CPU handles the few rows of a decode step poorly: a matrix-vector product runs on one
core (so batch 1 read its weights at one core's bandwidth), and its dot for 3-32 rows ran at
30-70 GFLOP/s over bench-100m's layer weights streamed from DRAM. Such a step is bound by
reading the weights up to ~20 rows and by the FMAs above. The C++ kernel splits the weight
rows over XLA's intra-op threads for 1-2 rows (bench-100m's batch-1 step: 12.0 -> 9.3 ms),
and for 3-32 rows reads the weights in place, prefetched a block ahead, into register tiles:
AVX-512 tiles of up to 9 rows (on Zen 4 a tile of 5-9 rows runs at the FMA peak, one of 3-4 at
half of it), 1.2-2x XLA's dot over a chain of bench-100m's matmuls at 8-32 rows; AVX2 + FMA
tiles of up to 6 rows, 1.1-2.1x XLA's f32 dot and 1.2-2.9x its bf16 dot at 4-32 rows. A
layer's q/k/v (or gate/up) weights go in one call (`matmuls`). More rows (prefill) stay on
XLA's dot, as do CPUs with neither from 3 rows on (`max_rows()`).

bf16 weights take the same path, widened to f32 in registers (x is multiplied in f32): a decode
step reads every weight once, so half the bytes is up to half the time, where XLA:CPU's bf16 dot
ran a bench-100m decode step at a sixth of its f32 speed.

On a CPU with AVX512_BF16 (`bf16_dots()`), a bf16 x times bf16 weights (a bf16 model's
activations) multiplies in bf16 with f32 sums, twice the multiply rate of an f32 FMA: up to
BF16_MAX_ROWS rows in `cpu/bf16_matmul.cc` (`vdpbf16ps` tiles), more on XLA's own bf16 dot with
f32 accumulation (jax 0.10.2's XLA:CPU runs it at twice its widened f32 dot on Zen 4;
docs/en/benchmarks.md). An f32 x is not bf16-exact and keeps the widening paths, as does every
CPU without AVX512_BF16.
"""

from __future__ import annotations

import ctypes
import functools
import math

import jax
import jax.numpy as jnp

from hotswap.kernels import cpu_build, cpu_isa


@functools.cache
def max_rows() -> int:
    """The most rows the kernel takes on this CPU: 32 with AVX-512 or AVX2 + FMA, else 2 (GEMV)."""
    fn = cpu_build.library("small_matmul").HotswapSmallMatmulMaxRows
    fn.restype = ctypes.c_int64
    return int(fn())


KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # of x and of the weights (one per call)
# The rows of a bf16 x bf16 call that go to `cpu/bf16_matmul.cc`: from one row (its 1-row path
# streams bf16 weights at the f32 GEMV's bytes per second; bench-100m's 12-layer 1-row chain in
# one run: 5.36 ms against the widening GEMV's 5.61, and 6.85 before that GEMV's AVX-512 bf16
# sweep; whole batch-1 steps 66-69 tok/s against 64-67), up to BF16_MAX_ROWS; more go to XLA's
# bf16 dot (as fast as the kernel there).
BF16_MIN_ROWS, BF16_MAX_ROWS = 1, 64


@functools.cache
def bf16_dots() -> bool:
    """True on a CPU with AVX512_BF16: bf16 x bf16 matmuls multiply in bf16 (module doc)."""
    return "avx512_bf16" in cpu_isa.runnable()


def _both_bf16(x: jax.Array, ws) -> bool:
    return x.dtype == jnp.bfloat16 and all(w.dtype == jnp.bfloat16 for w in ws) and bf16_dots()


def matmuls(x: jax.Array, ws, contract: int = 1, out_dtype=None) -> list[jax.Array]:
    """Each w contracted over x's last `contract` dims and w's first (x [..., K...], w
    [K..., N...] -> [..., N...]; `x @ w` for a 2-D w), in `out_dtype` (default: what XLA's dot
    gives, x's and w's promoted dtype): one C++ call for all the weights when they are all f32
    or all bf16 and x has at most max_rows() rows, else XLA's dot for each. The kernel takes
    2-D operands; x and the weights are reshaped to [rows, K] and [K, N], which for row-major
    arrays on CPU are bitcasts, not copies. Weights that share x (a layer's q/k/v, or
    gate/up) in one call share one parallel region: +2-4% decode at batch 1 and +5% at
    batch 16 against a call per weight (same-process A/B). More rows take `prompt_dot`."""
    rows = math.prod(x.shape[: x.ndim - contract])
    ws = list(ws)
    out = out_dtype or jnp.result_type(x, *ws)
    kernel = (
        x.dtype in KERNEL_DTYPES and ws[0].dtype in KERNEL_DTYPES and all(w.dtype == ws[0].dtype for w in ws)
    )
    if _both_bf16(x, ws) and BF16_MIN_ROWS <= rows <= BF16_MAX_ROWS:
        return [y.astype(out) for y in bf16_matmuls(x, ws, contract)]
    if not kernel or rows > max_rows():
        return [prompt_dot(x, w, contract, out_dtype) for w in ws]
    # The kernel multiplies and sums in f32: a bf16 x widens exactly, and its f32 result is
    # rounded once, to `out`, as XLA's dot with f32 accumulation rounds it.
    return [y.astype(out) for y in _call("HotswapSmallMatmul", x.astype(jnp.float32), ws, contract)]


def prompt_dot(x: jax.Array, w: jax.Array, contract: int = 1, out_dtype=None) -> jax.Array:
    """XLA's dot for the rows the kernel does not take (prompt-sized, or a decode batch above
    max_rows()). A bf16 weight and its x are widened to f32 first (exactly) and the f32 result
    rounded once to the dtype asked for. XLA:CPU computes a bf16 x bf16 -> bf16 dot in f32
    already, but one into an f32 result (`out_dtype`: the LM head's logits) ran 1.3-1.5x slower
    than the widened dot ([512, 768] x [768, 4096]: 33.7-37.9 ms against 25.1-27.4). The
    products are the same (a product of two bf16 is exact in f32); only the order of the f32
    sums may differ. With `bf16_dots()` a bf16 x stays bf16: XLA's bf16 dot with f32 sums
    ([512, 768] x [768, 2048]: 2x the widened dot on Zen 4), rounded once to the dtype asked for."""
    if _both_bf16(x, [w]):
        y = jnp.tensordot(x, w, axes=contract, preferred_element_type=jnp.float32)
        return y.astype(out_dtype or x.dtype)
    if w.dtype != jnp.bfloat16 or x.dtype not in KERNEL_DTYPES:
        return jnp.tensordot(x, w, axes=contract, preferred_element_type=out_dtype)
    out = out_dtype or jnp.result_type(x, w)
    wide = jnp.tensordot(x.astype(jnp.float32), w.astype(jnp.float32), axes=contract)
    return wide.astype(out)


def fixed_matmuls(x: jax.Array, ws, contract: int = 1, out_dtype=None) -> list[jax.Array]:
    """`matmuls`' interface, every f32 call on the kernel's fixed-order path whatever the row
    count (see the module doc). Other dtypes raise: deterministic mode is f32 on the CPU backend
    (`Backend.choose` refuses the rest before any step is traced)."""
    ws = list(ws)
    if x.dtype != jnp.float32 or any(w.dtype != jnp.float32 for w in ws):
        raise TypeError(f"the fixed-order matmul takes f32 operands, got {x.dtype} x {[w.dtype for w in ws]}")
    ys = _call("HotswapFixedMatmul", x, ws, contract)
    return ys if out_dtype is None else [y.astype(out_dtype) for y in ys]


def bf16_matmuls(x: jax.Array, ws, contract: int = 1, path: str = "auto") -> list[jax.Array]:
    """x [..., K...] (bf16) @ each w [K..., N...] (bf16) in `cpu/bf16_matmul.cc`, f32 results,
    all the weights in one call; `path` one of `cpu_isa.runnable()` ("auto": the best)."""
    ws = list(ws)
    lead = x.shape[: x.ndim - contract]
    rows, k = math.prod(lead), math.prod(x.shape[x.ndim - contract :])
    target = cpu_build.register("bf16_matmul", "HotswapBf16Matmul")
    flat = [w.reshape(k, math.prod(w.shape[contract:])) for w in ws]  # [K, N]
    out = [jax.ShapeDtypeStruct((rows, w.shape[1]), jnp.float32) for w in flat]
    ys = jax.ffi.ffi_call(target, out)(x.reshape(rows, k), *flat, isa=cpu_isa.attribute(path))
    return [y.reshape(*lead, *w.shape[contract:]) for y, w in zip(ys, ws, strict=True)]


def _call(symbol: str, x: jax.Array, ws: list[jax.Array], contract: int) -> list[jax.Array]:
    """One call of the kernel's `symbol` on x [..., K...] and the weights [K..., N...]."""
    lead = x.shape[: x.ndim - contract]
    rows, k = math.prod(lead), math.prod(x.shape[x.ndim - contract :])
    target = cpu_build.register("small_matmul", symbol)
    flat = [w.reshape(k, math.prod(w.shape[contract:])) for w in ws]  # [K, N]
    ys = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct((rows, w.shape[1]), jnp.float32) for w in flat])(
        x.reshape(rows, k), *flat
    )
    return [y.reshape(*lead, *w.shape[contract:]) for y, w in zip(ys, ws, strict=True)]


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N]: `matmuls` with one weight."""
    return matmuls(x, [w])[0]

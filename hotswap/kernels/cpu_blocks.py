"""Matmuls and embedding rows straight from a GGUF's weight blocks on XLA:CPU (`cpu/block_matmul.cc`).

A weight is the uint8 array of llama.cpp's blocks as the file stores them: [N, K / elems * bytes]
for the [out, in] matrix, one output row per array row (`FORMATS` gives each format's block).
`matmuls` multiplies x [M, K] by several such weights in one call (a layer's q/k/v or gate/up share
x and one parallel region); `rows` decodes the rows of an embedding table a lookup takes. The
blocks are decoded in registers as they are read; no dequantized copy of a weight is made.

`exact=True` (the default) multiplies in f32 by each weight's f32 value as
`gguf.quants.dequantize` gives it, so a result is x @ dequantize(W).T up to the order of f32
sums. `exact=False` is llama.cpp's arithmetic: x quantized per 32 values to int8 and int8 dots
(AVX512_VNNI's vpdpbusd, or AVX2's vpmaddubsw), off by x's rounding (~0.4% of a value's scale).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.kernels import cpu_build, cpu_isa

# Format name -> (the FFI code of block_formats.h's Fmt, weights per block, bytes per block).
FORMATS: dict[str, tuple[int, int, int]] = {
    "q8_0": (0, 32, 34),
    "q4_0": (1, 32, 18),
    "q4_1": (2, 32, 20),
    "q4_k": (3, 256, 144),
    "q6_k": (4, 256, 210),
}
# The paths the kernel has (cpu/isa.h names): avx512_vnni differs from avx512 only when not exact.
PATHS = ("avx512_vnni", "avx512", "avx2", "scalar")


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one K-weight row in `fmt`; ValueError for an unknown format or a K that is not a
    whole number of its blocks."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown GGUF block format {fmt!r}; served as blocks: {', '.join(FORMATS)}")
    _, elems, nbytes = FORMATS[fmt]
    if k % elems:
        raise ValueError(f"{fmt} rows are whole blocks of {elems} weights; K = {k} is not")
    return k // elems * nbytes


def _check(blocks, fmt: str, k: int, what: str) -> None:
    if blocks.dtype != jnp.uint8 or blocks.ndim != 2:
        raise ValueError(
            f"{what}: expected uint8 blocks [N, bytes], got {blocks.dtype} {tuple(blocks.shape)}"
        )
    want = row_bytes(fmt, k)
    if blocks.shape[1] != want:
        raise ValueError(f"{what}: {fmt} rows of K = {k} weights are {want} bytes, got {blocks.shape[1]}")


def matmuls(x: jax.Array, weights, isa: str = "auto", exact: bool = True) -> list[jax.Array]:
    """x f32 [M, K] times each (blocks uint8 [N_i, bytes_i], fmt_i) -> [f32 [M, N_i], ...]: y_i =
    x @ dequantize(blocks_i).T, in one FFI call. `isa`: a path of `PATHS` or "auto" (the best
    this CPU runs); a path this CPU cannot run fails the call naming it."""
    weights = list(weights)
    if isa != "auto" and isa not in PATHS:
        raise ValueError(f"the block kernel has no path {isa!r}; it has: {', '.join(PATHS)}, auto")
    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"x must be f32 [M, K], got {x.dtype} {tuple(x.shape)}")
    if not weights:
        return []
    m, k = x.shape
    for i, (blocks, fmt) in enumerate(weights):
        _check(blocks, fmt, k, f"weight {i}")
    target = cpu_build.register("block_matmul", "HotswapBlockMatmul")
    outs = [jax.ShapeDtypeStruct((m, blocks.shape[0]), jnp.float32) for blocks, _ in weights]
    fmts = np.array([FORMATS[fmt][0] for _, fmt in weights], dtype=np.int32)
    return list(
        jax.ffi.ffi_call(target, outs)(
            x, *[blocks for blocks, _ in weights], fmts=fmts, isa=cpu_isa.attribute(isa), exact=bool(exact)
        )
    )


def matmul(x: jax.Array, blocks: jax.Array, fmt: str, isa: str = "auto", exact: bool = True) -> jax.Array:
    """`matmuls` with one weight."""
    return matmuls(x, [(blocks, fmt)], isa, exact)[0]


def rows(blocks: jax.Array, fmt: str, ids: jax.Array) -> jax.Array:
    """The rows `ids` (int32 [T]) of a block table [V, bytes] decoded to f32 [T, K] (llama.cpp's
    get_rows: a GGUF's token_embd stays in its blocks). An id outside [0, V) fails the call."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown GGUF block format {fmt!r}; served as blocks: {', '.join(FORMATS)}")
    code, elems, nbytes = FORMATS[fmt]
    if blocks.ndim != 2 or blocks.shape[1] % nbytes:
        raise ValueError(f"{fmt} rows are whole {nbytes}-byte blocks; got blocks {tuple(blocks.shape)}")
    k = blocks.shape[1] // nbytes * elems
    _check(blocks, fmt, k, "embedding table")
    target = cpu_build.register("block_matmul", "HotswapBlockRows")
    out = jax.ShapeDtypeStruct((ids.shape[0], k), jnp.float32)
    return jax.ffi.ffi_call(target, out)(blocks, ids.astype(jnp.int32), fmt=np.int32(code))

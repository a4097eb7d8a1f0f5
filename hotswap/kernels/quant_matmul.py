"""Matmuls whose weights may be QTensors (`qtensor.py`): the one place that decides how a
quantized weight is multiplied.

`with_quantized(dense)` wraps a backend's dense matmul routine (`Backend.matmuls`'s
`(x, [w, ...], contract, out_dtype)`): dense weights go to it in one call as before; quantized
ones, grouped by kind, go to

| weights               | CPU (one C++ call per kind)          | elsewhere (XLA)                          |
|-----------------------|--------------------------------------|------------------------------------------|
| int8                  | `cpu_int8.matmuls`: f32 x, widened    | int8 x int8 dot of per-row quantized x    |
|                       | in registers                         | (TPU, the MXU's int8 rate), else widened  |
| fp8                   | (refused on CPU: `quant_scheme`)     | x @ data (fp8 operand), then scales       |
| GGUF blocks           | `cpu_blocks.matmuls`: decoded in     | decoded (`qtensor.decode_blocks`), dot    |
|                       | registers                            |                                           |

Results are f32 sums rounded once to `out_dtype` (default: x's dtype, the model's compute dtype).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from hotswap.kernels import cpu_blocks, cpu_int8
from hotswap.kernels.qtensor import QTensor, decode_blocks, is_qtensor


def with_quantized(dense, platform: str, cpu_kernels: bool = False):
    """`dense` extended to QTensor weights (module doc). `cpu_kernels`: the C++ kernels run the
    quantized products (the CPU backend); else the XLA forms, int8 through an int8 dot on TPU."""

    def matmuls(x: jax.Array, ws, contract: int = 1, out_dtype=None) -> list:
        ws = list(ws)
        quantized = [i for i, w in enumerate(ws) if is_qtensor(w)]
        if not quantized:
            return dense(x, ws, contract, out_dtype)
        out: list = [None] * len(ws)
        plain = [i for i in range(len(ws)) if i not in quantized]
        if plain:
            for i, y in zip(plain, dense(x, [ws[i] for i in plain], contract, out_dtype), strict=True):
                out[i] = y
        lead = x.shape[: x.ndim - contract]
        x2 = x.reshape(math.prod(lead), -1)
        dtype = out_dtype or x.dtype
        for kind in ("int8", "fp8", "blocks"):
            group = [i for i in quantized if _kind(ws[i]) == kind]
            if not group:
                continue
            for i in group:
                if ws[i].n_in != contract:
                    raise ValueError(
                        f"a {ws[i].fmt} weight of shape {ws[i].shape} contracted over {contract} dims"
                    )
            ys = _products(kind, x2, [ws[i] for i in group], platform, cpu_kernels)
            for i, y in zip(group, ys, strict=True):
                out[i] = y.reshape(*lead, *ws[i].shape[contract:]).astype(dtype)
        return out

    return matmuls


def _kind(w: QTensor) -> str:
    return "blocks" if w.format.blocks else w.fmt


def _products(kind: str, x2: jax.Array, ws: list[QTensor], platform: str, cpu_kernels: bool) -> list:
    """x2 [M, K] times each weight -> f32 [M, N] each."""
    if cpu_kernels and kind == "int8":
        xf = x2.astype(jnp.float32)
        pairs = [(w.data.reshape(w.k, w.n), w.scales.reshape(-1, w.n)) for w in ws]
        # Where the FMAs, not the weight bytes, bound the product (16 rows and more: the kernel's
        # kVnniRows), x is quantized per row and group to int8 and multiplied on vpdpbusd if the
        # CPU has it, at x's 8-bit rounding (benchmarks/int8_matmul.py: 0.8%); fewer rows, or a
        # CPU without VNNI, take the exact path.
        return cpu_int8.matmuls(xf, pairs, exact=False)
    if cpu_kernels and kind == "blocks":
        return cpu_blocks.matmuls(x2.astype(jnp.float32), [(w.data, w.fmt) for w in ws])
    if kind == "blocks":
        return [
            jnp.dot(
                x2, decode_blocks(w.data, w.fmt, w.k).T.astype(x2.dtype), preferred_element_type=jnp.float32
            )
            for w in ws
        ]
    if kind == "int8" and platform == "tpu":
        return [_int8_dot(x2, w) for w in ws]
    return [_scaled_dot(x2, w) for w in ws]


def _grouped(x2: jax.Array, w: QTensor) -> tuple[jax.Array, jax.Array, int]:
    """x2 [M, K] as [M, G, K/G], the weight's data as [G, K/G, N], and G."""
    g = w.scales.shape[0]
    return x2.reshape(x2.shape[0], g, w.k // g), w.data.reshape(g, w.k // g, w.n), g


def _scaled_dot(x2: jax.Array, w: QTensor) -> jax.Array:
    """Weight-only: the data widened to x's dtype inside the dot (XLA fuses the convert into the
    operand read), each group's f32 sum scaled, groups summed."""
    xg, data, g = _grouped(x2, w)
    parts = jnp.einsum("mgk,gkn->mgn", xg, data.astype(x2.dtype), preferred_element_type=jnp.float32)
    return jnp.einsum("mgn,gn->mn", parts, w.scales.reshape(g, w.n))


def _int8_dot(x2: jax.Array, w: QTensor) -> jax.Array:
    """int8 x int8 -> int32 on the MXU: each row of x quantized per group (symmetric, its
    max-abs over 127) on the fly, as AQT / qwix's dynamic-range mode and JetStream's int8
    serve; the product rescaled by both scales."""
    xg, data, g = _grouped(x2.astype(jnp.float32), w)
    amax = jnp.max(jnp.abs(xg), axis=-1, keepdims=True)
    xs = jnp.where(amax > 0, amax / 127.0, 1.0)
    xq = jnp.clip(jnp.round(xg / xs), -127, 127).astype(jnp.int8)
    acc = jnp.einsum("mgk,gkn->mgn", xq, data, preferred_element_type=jnp.int32)
    return jnp.einsum("mgn,mg,gn->mn", acc.astype(jnp.float32), xs[..., 0], w.scales.reshape(g, w.n))

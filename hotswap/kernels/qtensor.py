"""QTensor: a matmul weight served quantized, and what every format's bytes mean.

A QTensor stands in the params tree where a dense weight would (`model/params.py`), with the
dense weight's params-layout `shape` (`[in..., out...]`, used as `x @ W`) as static metadata:

| format              | `data`                                       | `scales`                  |
|---------------------|----------------------------------------------|---------------------------|
| `int8`              | int8, `shape` itself                         | f32 `[G, out...]`         |
| `fp8`               | float8_e4m3fn, `shape` itself                | f32 `[1, out...]`         |
| `q8_0` ... `q6_k`   | uint8 `[N, K / block * block_bytes]`         | None                      |

int8 and fp8 keep the dense layout, so a tensor-parallel sharding splits them as it splits the
dense weight (scales follow the output axes). W[k, n] = data[k, n] * scales[k // (K / G), n]:
G = 1 is one scale per output column, G > 1 a scale per group of K / G inputs. GGUF block
formats keep llama.cpp's bytes as the file stores them: one row per output (the `[out, in]`
matrix), blocks along the input, scales inside the blocks. That is the layout a matrix-vector
product streams (one output's blocks are contiguous), llama.cpp's own, and it makes a
`token_embd` in blocks both the embedding (rows, `take_rows`) and a tied LM head.

`dequantize` is the reference for every format (jnp, any backend), checked against the `gguf`
package's dequantizers in tests; the CPU kernels (`cpu_int8`, `cpu_blocks`) decode the same
bytes in registers and are checked against it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Format:
    name: str
    block: int  # elements per block along the input (1: element-wise formats)
    block_bytes: int  # bytes per block
    ggml_type: int | None = None  # gguf.GGMLQuantizationType value of a GGUF block format

    @property
    def blocks(self) -> bool:
        """Stored as llama.cpp blocks (`[N, bytes]`), not in the dense layout."""
        return self.ggml_type is not None


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("int8", 1, 1),
        Format("fp8", 1, 1),
        Format("q8_0", 32, 34, 8),
        Format("q4_0", 32, 18, 2),
        Format("q4_1", 32, 20, 3),
        Format("q4_k", 256, 144, 12),
        Format("q6_k", 256, 210, 14),
    )
}
BLOCK_FORMATS = tuple(n for n, f in FORMATS.items() if f.blocks)
BY_GGML_TYPE = {f.ggml_type: f.name for f in FORMATS.values() if f.blocks}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
    """A quantized weight (module doc). `n_in`: how many leading dims of `shape` are inputs."""

    data: jax.Array
    scales: jax.Array | None
    fmt: str = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    n_in: int = dataclasses.field(default=1, metadata=dict(static=True))

    @property
    def format(self) -> Format:
        return FORMATS[self.fmt]

    @property
    def k(self) -> int:
        return math.prod(self.shape[: self.n_in])

    @property
    def n(self) -> int:
        return math.prod(self.shape[self.n_in :])

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    @property
    def ndim(self) -> int:
        return len(self.shape)


def is_qtensor(x) -> bool:
    return isinstance(x, QTensor)


def block_bytes(fmt: str, k: int) -> int:
    """Bytes of one output row of `k` inputs in block format `fmt`."""
    f = FORMATS[fmt]
    return k // f.block * f.block_bytes


# ---- the reference decoders: [N, bytes] uint8 -> [N, K] f32 ---------------------------------


def _f16(b: jax.Array) -> jax.Array:
    """Two little-endian bytes (last axis) -> their f16 value as f32."""
    bits = b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _nibbles(qs: jax.Array) -> jax.Array:
    """[..., 16] packed bytes -> [..., 32]: the low nibbles are elements 0-15, the high 16-31."""
    return jnp.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(jnp.float32)


def _q8_0(b):
    return _f16(b[..., 0:2])[..., None] * b[..., 2:34].view(jnp.int8).astype(jnp.float32)


def _q4_0(b):
    return _f16(b[..., 0:2])[..., None] * (_nibbles(b[..., 2:18]) - 8.0)


def _q4_1(b):
    return _f16(b[..., 0:2])[..., None] * _nibbles(b[..., 4:20]) + _f16(b[..., 2:4])[..., None]


def _k_scales(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K's 12 packed bytes -> 8 six-bit scales and 8 six-bit mins (llama.cpp's
    get_scale_min_k4): sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7, 4-7 split between
    bytes 8-11's nibbles and the top 2 bits of bytes 0-3 / 4-7."""
    s = s.astype(jnp.int32)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    sc = jnp.concatenate([lo_sc, hi_sc], -1).astype(jnp.float32)
    m = jnp.concatenate([lo_m, hi_m], -1).astype(jnp.float32)
    return sc, m


def _q4_k(b):
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scales(b[..., 4:16])  # [..., 8]
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)  # 4 chunks of 64 elements
    q = jnp.stack([qs & 0xF, qs >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32).astype(jnp.float32)
    y = (d[..., None] * sc)[..., None] * q - (dmin[..., None] * m)[..., None]
    return y.reshape(*b.shape[:-1], 256)


def _q6_k(b):
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 64).astype(jnp.int32)
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 32).astype(jnp.int32)
    sc = b[..., 192:208].view(jnp.int8).astype(jnp.float32).reshape(*b.shape[:-1], 2, 8)
    d = _f16(b[..., 208:210])
    q1 = (ql[..., :32] & 0xF) | (((qh >> 0) & 3) << 4)
    q2 = (ql[..., 32:] & 0xF) | (((qh >> 2) & 3) << 4)
    q3 = (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4)
    q4 = (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)
    q = jnp.stack([q1, q2, q3, q4], axis=-2).astype(jnp.float32) - 32.0  # [..., 2, 4, 32]
    # Each 16 elements share a scale: half h, quarter j, element l uses sc[h, 2j + l // 16].
    scale = sc.reshape(*sc.shape[:-1], 4, 2)[..., None].repeat(16, -1).reshape(*sc.shape[:-1], 4, 32)
    return (d[..., None, None, None] * scale * q).reshape(*b.shape[:-1], 256)


# Byte offsets of each block format's f16 scale fields. Every other field is an integer (the
# quants, Q4_K's 6-bit scales, Q6_K's int8 scales), so a block decodes to finite values exactly
# when these are finite.
F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q6_k": (208,)}


def blocks_finite(data, fmt: str, k: int) -> bool:
    """Whether [N, bytes] blocks (numpy, on the host) decode to finite values: their f16 scale
    fields' exponents are not all ones (no NaN/Inf). Reads 2-4 bytes per block."""
    import numpy as np

    f = FORMATS[fmt]
    blocks = np.asarray(data).reshape(-1, f.block_bytes)
    for at in F16_FIELDS[fmt]:
        bits = blocks[:, at].astype(np.uint16) | (blocks[:, at + 1].astype(np.uint16) << 8)
        if ((bits & 0x7C00) == 0x7C00).any():
            return False
    return True


_DECODERS = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q4_k": _q4_k, "q6_k": _q6_k}


def decode_blocks(data: jax.Array, fmt: str, k: int) -> jax.Array:
    """[N, bytes] uint8 blocks of format `fmt` -> the [N, k] f32 matrix they hold."""
    f = FORMATS[fmt]
    blocks = data.reshape(data.shape[0], k // f.block, f.block_bytes)
    return _DECODERS[fmt](blocks).reshape(data.shape[0], k)


def dequantize(q: QTensor, dtype=jnp.float32) -> jax.Array:
    """The dense weight `q` stands for, in the params layout `q.shape` (the reference)."""
    if q.format.blocks:
        return decode_blocks(q.data, q.fmt, q.k).T.reshape(q.shape).astype(dtype)
    groups = q.scales.shape[0]
    w = q.data.astype(jnp.float32).reshape(groups, q.k // groups, q.n) * q.scales.reshape(groups, 1, q.n)
    return w.reshape(q.shape).astype(dtype)


def take_rows(w, ids: jax.Array, dtype) -> jax.Array:
    """`w[ids]` for an embedding, in `dtype`: a dense array indexed, or a block-format QTensor's
    rows decoded (llama.cpp's get_rows; the table is held as the `[D, V]` head it ties to, so
    a token's row is one output row of blocks)."""
    if not is_qtensor(w):
        return w[ids]
    if not w.format.blocks:
        raise TypeError(f"an embedding is served dense or in GGUF blocks, not {w.fmt}")
    rows = decode_blocks(w.data[ids.reshape(-1)], w.fmt, w.k)
    return rows.reshape(*ids.shape, w.k).astype(dtype)

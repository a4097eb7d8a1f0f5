"""Every block type the `gguf` package dequantizes loads through hotswap's GGUF reader.

Types `gguf` can also quantize are written from a seeded checkpoint and must load within
the format's rounding of it. The others (K-quants, IQ*, NVFP4) `gguf` only reads: their
blocks are seeded random bytes with valid scales (the f16 / fp8 / e8m0 scale fields set to
small finite values), and what loads must be exactly what `gguf.quants.dequantize` makes of
those bytes, in HF's layout. A type `gguf` knows but cannot dequantize, and one it does
not know at all, are typed errors naming the tensor.
"""

from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf_files import gguf_name, permute, write_gguf

from hotswap.checkpoint import gguf_io, hf
from hotswap.checkpoint.create import create_checkpoint
from hotswap.errors import CheckpointError

Q = gguf.GGMLQuantizationType
QK_K = 256


def _block(qtype: Q) -> np.ndarray:
    return np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8)


def _can(fn, qtype: Q) -> bool:
    try:
        fn(qtype)
    except NotImplementedError:
        return False
    return True


DEQUANTIZABLE = {q for q in Q if _can(lambda q: gguf.quants.dequantize(_block(q), q), q)}
QUANTIZABLE = {q for q in DEQUANTIZABLE if _can(lambda q: gguf.quants.quantize(np.zeros((1, QK_K)), q), q)}

# Bound on |dequantized - source| per block, from the block's max |x| and range (scales in f16).
_BOUNDS = {
    Q.Q8_0: lambda amax, rng: amax * (1 / 254 + 1 / 2048),
    # d = -amax/8 (/16) puts the far end at -8 (-16); the other end is clipped: up to one step off.
    Q.Q4_0: lambda amax, rng: amax * (1 / 8 + 1 / 1024),
    Q.Q5_0: lambda amax, rng: amax * (1 / 16 + 1 / 1024),
    # min + d * [0, 15] (31): half a step of the range.
    Q.Q4_1: lambda amax, rng: rng / 30 + amax / 512,
    Q.Q5_1: lambda amax, rng: rng / 62 + amax / 512,
    # ternary {-d, 0, d} with d = amax: half of d.
    Q.TQ1_0: lambda amax, rng: amax * (1 / 2 + 1 / 1024),
    Q.TQ2_0: lambda amax, rng: amax * (1 / 2 + 1 / 1024),
    # e2m1 values d * {0, 1, 2, 3, 4, 6, 8, 12} with 8d <= amax < 16d: the widest gap (8d..12d,
    # or 12d..amax when clipped) is off by at most amax / 4.
    Q.MXFP4: lambda amax, rng: amax / 4,
}

# Dequantize-only types: byte offsets of the f16 scales in a block (gguf/quants.py's layouts).
_F16_SCALES = {
    Q.Q2_K: (QK_K // 16 + QK_K // 4, QK_K // 16 + QK_K // 4 + 2),  # scales, qs, d, dmin
    Q.Q3_K: (QK_K // 8 + QK_K // 4 + 12,),  # hmask, qs, scales, d
    Q.Q4_K: (0, 2),  # d, dmin, scales, qs
    Q.Q5_K: (0, 2),
    Q.Q6_K: (QK_K // 2 + QK_K // 4 + QK_K // 16,),  # ql, qh, scales, d
    Q.IQ2_XXS: (0,),
    Q.IQ2_XS: (0,),
    Q.IQ2_S: (0,),
    Q.IQ3_XXS: (0,),
    Q.IQ3_S: (0,),
    Q.IQ1_S: (0,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
}


def _random_blocks(qtype: Q, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Seeded random blocks for an `[out, in]` tensor, every scale a small finite value."""
    data = rng.integers(0, 256, gguf.quant_shape_to_byte_shape(shape, qtype), dtype=np.uint8)
    blocks = data.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    n = len(blocks)
    if qtype in _F16_SCALES:
        for at in _F16_SCALES[qtype]:
            d = rng.uniform(1e-4, 1e-3, n).astype(np.float16)
            blocks[:, at : at + 2] = d.view(np.uint8).reshape(n, 2)
    elif qtype == Q.IQ1_M:  # the f16 scale is spread over the top nibbles of the last 4 uint16
        bits = rng.uniform(1e-4, 1e-3, n).astype(np.float16).view(np.uint16)
        scales = blocks[:, -8:].copy().view(np.uint16)
        for k in range(4):
            scales[:, k] = (scales[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        blocks[:, -8:] = scales.view(np.uint8)
    elif qtype == Q.NVFP4:  # 4 ue4m3 sub-block scales first: 2^-7 .. 2^-4
        blocks[:, :4] = rng.integers(0x00, 0x18, (n, 4), dtype=np.uint8)
    else:
        raise AssertionError(f"no scale layout for {qtype.name}")
    return data


_RANDOM = set(_F16_SCALES) | {Q.IQ1_M, Q.NVFP4}


def test_every_type_gguf_dequantizes_is_covered():
    assert set(_BOUNDS) | _RANDOM | {Q.F32, Q.F16, Q.BF16} == DEQUANTIZABLE
    assert QUANTIZABLE == set(_BOUNDS) | {Q.F32, Q.F16, Q.BF16}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A seeded Llama checkpoint whose rows are whole 256-wide super-blocks (K-quants, IQ*)."""
    return create_checkpoint(
        tmp_path_factory.mktemp("wide") / "m",
        overrides={
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
    )


def _loaded(path):
    cfg, params, _ = gguf_io.load_gguf(path, dtype="float32")
    return cfg, hf.hf_from_params(cfg, params)


@pytest.mark.parametrize("qtype", sorted(_BOUNDS, key=int), ids=lambda q: q.name)
def test_quantizable_types_load_within_their_rounding(wide, qtype, tmp_path):
    cfg, got = _loaded(write_gguf(wide, tmp_path / "m.gguf", qtype))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for name, orig in hf.read_hf_tensors(wide).items():
        orig = np.asarray(orig, np.float32)
        if orig.ndim == 1:
            np.testing.assert_array_equal(got[name], orig)
            continue
        blocks = orig.reshape(-1, block)
        amax = np.abs(blocks).max(axis=1, keepdims=True)
        rng = blocks.max(axis=1, keepdims=True) - blocks.min(axis=1, keepdims=True)
        err = np.abs(got[name].reshape(-1, block) - blocks)
        assert (err <= _BOUNDS[qtype](amax, rng) * 1.001 + 1e-8).all(), (name, float(err.max()))
        assert not np.array_equal(got[name], orig)  # it really was quantized


@pytest.mark.parametrize("qtype", sorted(_RANDOM, key=int), ids=lambda q: q.name)
def test_read_only_types_load_as_gguf_dequantizes_them(wide, qtype, tmp_path):
    rng = np.random.default_rng(int(qtype))
    stored: dict[str, np.ndarray] = {}

    def encode(name: str, a: np.ndarray):
        if a.ndim == 1:
            return a, Q.F32
        stored[name] = _random_blocks(qtype, a.shape, rng)
        return stored[name], qtype

    cfg, got = _loaded(write_gguf(wide, tmp_path / "m.gguf", Q.F32, encode=encode))
    for name, tensor in got.items():
        if tensor.ndim == 1:
            continue
        want = gguf.quants.dequantize(stored[gguf_name(name)], qtype)
        assert np.isfinite(want).all() and np.abs(want).max() > 0
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # stored permuted, loaded in HF order
            tensor = permute(tensor, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        np.testing.assert_array_equal(tensor, want, err_msg=name)


@pytest.mark.parametrize("qtype", sorted(set(Q) - DEQUANTIZABLE, key=int), ids=lambda q: q.name)
def test_a_type_gguf_cannot_dequantize_is_refused_naming_the_tensor(wide, qtype, tmp_path):
    def encode(name: str, a: np.ndarray):
        if name == "blk.1.ffn_up.weight":
            return np.zeros(gguf.quant_shape_to_byte_shape(a.shape, qtype), np.uint8), qtype
        return a, Q.F32

    path = write_gguf(wide, tmp_path / "m.gguf", Q.F32, encode=encode)
    with pytest.raises(CheckpointError, match=rf"'blk\.1\.ffn_up\.weight'.*{qtype.name}"):
        gguf_io.load_gguf(path)


def test_an_unknown_block_type_is_refused_naming_the_tensor(wide, tmp_path):
    path = write_gguf(wide, tmp_path / "m.gguf", Q.F32)
    reader = gguf.GGUFReader(path, "r+")  # rewrite one tensor's type id in place
    (t,) = [t for t in reader.tensors if t.name == "blk.0.attn_v.weight"]
    t.field.parts[4][0] = 99
    reader.data.flush()
    del reader
    with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_v\.weight'.*block type 99 is unknown"):
        gguf_io.load_gguf(path)


def test_bf16_and_f16_load_as_their_casts(wide, tmp_path):
    for qtype, cast in ((Q.F16, np.float16), (Q.BF16, ml_dtypes.bfloat16)):
        _, got = _loaded(write_gguf(wide, tmp_path / f"m.{qtype.name}.gguf", qtype))
        for name, orig in hf.read_hf_tensors(wide).items():
            orig = np.asarray(orig, np.float32)
            want = orig if orig.ndim == 1 else orig.astype(cast).astype(np.float32)
            np.testing.assert_array_equal(got[name], want, err_msg=name)

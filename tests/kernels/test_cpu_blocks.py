"""GGUF block matmuls and embedding rows (`kernels/cpu_blocks.py`) against the `gguf` package's own
dequantize, on every path this CPU runs: random valid blocks of every format, several formats
in one call, and the real tensors of the SmolLM2 Q4_1 and Gemma 3 270M Q4_K_M files."""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from hotswap.checkpoint import gguf_io
from hotswap.kernels import cpu_blocks, cpu_isa

Q = gguf.GGMLQuantizationType
QTYPES = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q4_k": Q.Q4_K, "q6_k": Q.Q6_K}
PATHS = [p for p in cpu_blocks.PATHS if p in cpu_isa.runnable()]
# int8 x (llama.cpp's q8_0 of the activations) rounds each x to 1/254 of its group's largest:
# the error of a sum stays well under 1% of sum |x| |w|.
INT8_ERROR = 5e-3


def random_blocks(rng: np.random.Generator, fmt: str, n: int, k: int) -> np.ndarray:
    """Random bytes [n, row_bytes] with each f16 scale field set to a finite value of +-0.05:
    every code, packed scale and min takes random values as in a real file."""
    _, elems, nbytes = cpu_blocks.FORMATS[fmt]
    b = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    fields = {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q4_k": [0, 2], "q6_k": [208]}[fmt]
    for at in fields:
        half = rng.uniform(-0.05, 0.05, size=(n, k // elems)).astype(np.float16)
        b[..., at : at + 2] = half.view(np.uint8).reshape(n, k // elems, 2)
    return b.reshape(n, -1)


def check(x: np.ndarray, blocks: np.ndarray, fmt: str, y, tol: float) -> float:
    """|y - x @ W.T| / (|x| @ |W|.T), W = gguf's f32 dequantize, in float64; asserts it is <= tol."""
    w = gguf.quants.dequantize(blocks, QTYPES[fmt]).astype(np.float64)
    ref = x.astype(np.float64) @ w.T
    bound = np.abs(x).astype(np.float64) @ np.abs(w).T + 1e-30
    err = float((np.abs(np.asarray(y, np.float64) - ref) / bound).max())
    assert err <= tol, f"{fmt}: relative error {err:.2e} > {tol:.0e}"
    return err


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("exact", [True, False])
def test_every_format_in_one_call(path, exact):
    """Five weights of five formats share x in one call, for decode and prefill row counts;
    exact: f32 rounding (K = 512 sums); not exact: int8 x's rounding."""
    rng = np.random.default_rng(0)
    k = 512
    weights = [(random_blocks(rng, fmt, 37 + 8 * i, k), fmt) for i, fmt in enumerate(QTYPES)]
    dev = [(jnp.asarray(b), fmt) for b, fmt in weights]
    for m in (1, 2, 7, 33, 200):
        x = rng.standard_normal((m, k)).astype(np.float32)
        ys = cpu_blocks.matmuls(jnp.asarray(x), dev, isa=path, exact=exact)
        for (b, fmt), y in zip(weights, ys, strict=True):
            assert y.shape == (m, b.shape[0]) and y.dtype == jnp.float32
            check(x, b, fmt, y, 1e-6 if exact else INT8_ERROR)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_blocks_gguf_quantized(fmt):
    """Blocks as gguf.quants.quantize writes them (the formats it quantizes), a K of 3 blocks."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((19, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(w, QTYPES[fmt])
    x = rng.standard_normal((3, 96)).astype(np.float32)
    for path in PATHS:
        check(x, blocks, fmt, cpu_blocks.matmul(jnp.asarray(x), jnp.asarray(blocks), fmt, isa=path), 1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_panel_over_several_chunks(path):
    """K = 2,560 is more than one 2,048-weight panel fill: the second (partial) fill adds to the
    first's sums; 21 outputs leave the last 16-output panel part empty; 5, 13 and 19 rows take
    the panel tiles (8-row tiles and their remainders) or, on AVX-512, the direct items in blocks
    of 8 x rows (q4_1 up to 16 rows, q6_k up to 8)."""
    rng = np.random.default_rng(2)
    k = 2560
    weights = [(random_blocks(rng, fmt, 21, k), fmt) for fmt in ("q4_1", "q6_k")]
    dev = [(jnp.asarray(b), fmt) for b, fmt in weights]
    for m in (5, 13, 19):
        x = rng.standard_normal((m, k)).astype(np.float32)
        ys = cpu_blocks.matmuls(jnp.asarray(x), dev, isa=path)
        for (b, fmt), y in zip(weights, ys, strict=True):
            check(x, b, fmt, y, 1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_runs_longer_than_a_panel(path):
    """300 outputs split over the threads in runs of more than 16 rows at 3 and 4 x rows: each
    path takes those row counts without a panel or splits them into panels (AVX2 once read
    past its 16-row panel there)."""
    rng = np.random.default_rng(3)
    blocks = random_blocks(rng, "q4_1", 300, 512)
    for m in (3, 4):
        x = rng.standard_normal((m, 512)).astype(np.float32)
        check(
            x, blocks, "q4_1", cpu_blocks.matmul(jnp.asarray(x), jnp.asarray(blocks), "q4_1", isa=path), 1e-6
        )


def _tensors(path) -> dict[str, tuple[np.ndarray, str]]:
    """The block tensors of a GGUF file: (uint8 [N, row bytes], still memory-mapped, format),
    read through hotswap's header cache (gguf's reader parses a 262k-token vocabulary first)."""
    names = {q: n for n, q in QTYPES.items()}
    tensors = gguf_io.GGUFFile(path).tensors.values()
    return {t.name: (t.data, names[Q(t.tensor_type)]) for t in tensors if Q(t.tensor_type) in names}


def test_smollm2_layer0_and_embeddings(smollm2_gguf):
    """SmolLM2-135M's blk.0 Q4_1 weights as the file stores them: q/k/v in one call, gate/up in
    one, down (K = 1,536); token_embd (Q8_0) rows, and a slice of it as the LM head."""
    t = _tensors(smollm2_gguf)
    rng = np.random.default_rng(2)
    for names in (["attn_q", "attn_k", "attn_v"], ["ffn_gate", "ffn_up"], ["attn_output"], ["ffn_down"]):
        ws = [t[f"blk.0.{n}.weight"] for n in names]
        k = ws[0][0].shape[1] // 20 * 32
        for m in (1, 16):
            x = rng.standard_normal((m, k)).astype(np.float32)
            for path in PATHS:
                ys = cpu_blocks.matmuls(jnp.asarray(x), [(jnp.asarray(b), f) for b, f in ws], isa=path)
                for (b, f), y in zip(ws, ys, strict=True):
                    assert f == "q4_1"
                    check(x, b, f, y, 1e-6)
    embd, fmt = t["token_embd.weight"]
    ids = np.array([0, 1, 17, 49151, 2, 17], np.int32)
    got = cpu_blocks.rows(jnp.asarray(embd), fmt, jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(got), gguf.quants.dequantize(np.asarray(embd[ids]), Q.Q8_0))
    head = np.asarray(embd[:2048])
    x = rng.standard_normal((2, 576)).astype(np.float32)
    check(x, head, fmt, cpu_blocks.matmul(jnp.asarray(x), jnp.asarray(head), fmt), 1e-6)


def test_gemma3_k_quants(gemma3_gguf):
    """Gemma 3 270M Q4_K_M's blk.0 attn_output (Q4_K, K = 1,024), ffn_down (Q6_K, K = 2,048) and
    attn_v (Q8_0): exact on every path, int8 within its rounding; token_embd rows."""
    t = _tensors(gemma3_gguf)
    rng = np.random.default_rng(3)
    for name, want in (("attn_output", "q4_k"), ("ffn_down", "q6_k"), ("attn_v", "q8_0")):
        b, fmt = t[f"blk.0.{name}.weight"]
        assert fmt == want
        _, elems, nbytes = cpu_blocks.FORMATS[fmt]
        x = rng.standard_normal((5, b.shape[1] // nbytes * elems)).astype(np.float32)
        for path in PATHS:
            for exact in (True, False):
                y = cpu_blocks.matmul(jnp.asarray(x), jnp.asarray(b), fmt, isa=path, exact=exact)
                check(x, b, fmt, y, 1e-6 if exact else INT8_ERROR)
    embd, fmt = t["token_embd.weight"]
    ids = np.array([2, 262143, 106, 2], np.int32)
    got = cpu_blocks.rows(jnp.asarray(embd), fmt, jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(got), gguf.quants.dequantize(np.asarray(embd[ids]), QTYPES[fmt]))


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q4_0"])
def test_rows_random_blocks(fmt):
    """get_rows decodes exactly gguf's f32 values (the same products, one rounding each)."""
    rng = np.random.default_rng(4)
    table = random_blocks(rng, fmt, 50, 512)
    ids = np.array([49, 0, 7, 7], np.int32)
    got = cpu_blocks.rows(jnp.asarray(table), fmt, jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(got), gguf.quants.dequantize(table[ids], QTYPES[fmt]))


def test_bad_input():
    x = jnp.ones((2, 512), jnp.float32)
    blocks = jnp.zeros((4, 512 // 32 * 18), jnp.uint8)
    with pytest.raises(ValueError, match="q5_k"):
        cpu_blocks.matmuls(x, [(blocks, "q5_k")])
    with pytest.raises(ValueError, match="q4_1 rows of K = 512 weights are 320 bytes, got 288"):
        cpu_blocks.matmuls(x, [(blocks, "q4_1")])
    with pytest.raises(ValueError, match="K = 500 is not"):
        cpu_blocks.matmuls(jnp.ones((1, 500), jnp.float32), [(blocks, "q4_0")])
    with pytest.raises(ValueError, match="q3_k"):
        cpu_blocks.rows(blocks, "q3_k", jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="kernel has no path 'avx512_bf16'"):
        cpu_blocks.matmuls(x, [(blocks, "q4_0")], isa="avx512_bf16")
    with pytest.raises(Exception, match=r"id 4 outside \[0, 4\)"):
        np.asarray(cpu_blocks.rows(blocks, "q4_0", jnp.array([1, 4], jnp.int32)))

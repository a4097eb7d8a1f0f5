"""bf16 x bf16 matmuls on a CPU's bf16 dot instructions (`cpu/bf16_matmul.cc`, `cpu_matmul`):
every path this CPU runs against a float64 numpy oracle, and which calls go where."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hotswap.kernels import cpu_isa, cpu_matmul

# The kernel's paths this CPU runs (it offers AVX512_BF16; scalar runs everywhere).
PATHS = [p for p in cpu_isa.runnable() if p in ("avx512_bf16", "scalar")]
WIDTHS = (2085, 96, 35, 64)  # column pairs of 32 with a 1-pair last panel, tail columns, one short of a pair


def _bf16(rng, shape) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def _check(ys, x, ws, k):
    """Each y against x @ w in float64: the products are exact in f32, the sums f32 in another order."""
    for y, w in zip(ys, ws, strict=True):
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        assert y.dtype == jnp.float32 and y.shape == want.shape
        np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5, atol=2e-6 * k)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [1, 3, 9, 32, 64, 300])
def test_every_path_matches_float64(path, rows):
    """Rows in one tile, several (9 = 5 + 4, 300 = 50 x 6), one row (whole-row sweeps of K
    ranges: 301 splits into ranges of 74-77 rows, sweeps of 16 rows and a shorter, odd last one);
    K odd (the last k pairs with a zero) and K long enough for several k-blocks."""
    rng = np.random.default_rng(rows)
    for k in (301, 1000):
        x = _bf16(rng, (rows, k))
        ws = [_bf16(rng, (k, n)) for n in WIDTHS]
        _check(jax.jit(lambda x, *ws: cpu_matmul.bf16_matmuls(x, ws, path=path))(x, *ws), x, ws, k)


@pytest.mark.parametrize("path", PATHS)
def test_short_and_empty_k(path):
    rng = np.random.default_rng(5)
    for rows, k in ((2, 1), (7, 3), (1, 0), (4, 0), (1, 1), (1, 3), (1, 17), (1, 34)):
        x = _bf16(rng, (rows, k))
        ws = [_bf16(rng, (k, n)) for n in (64, 33)]
        _check(jax.jit(lambda x, *ws: cpu_matmul.bf16_matmuls(x, ws, path=path))(x, *ws), x, ws, max(k, 1))


def test_a_path_this_cpu_lacks_is_a_clear_error():
    lacking = [p for p in ("avx512_bf16",) if p not in cpu_isa.runnable()] or ["avx512_vnni"]  # not offered
    x = jnp.ones((3, 64), jnp.bfloat16)
    with pytest.raises(jax.errors.JaxRuntimeError, match="isa .* is not a path of this kernel"):
        jax.block_until_ready(jax.jit(lambda x: cpu_matmul.bf16_matmuls(x, [x.T], path=lacking[0]))(x))


def _program(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("rows", [1, 16, 64, 65, 512])
def test_routing_of_a_bf16_model_s_matmuls(rows):
    """With AVX512_BF16 a bf16 x and bf16 weights go to the bf16 kernel up to BF16_MAX_ROWS rows
    and to XLA's bf16 dot with f32 sums above; an f32 x keeps the widening paths. Without it,
    nothing reaches the bf16 kernel. Results are the float64 sums rounded once to bf16."""
    rng = np.random.default_rng(rows)
    x, ws = _bf16(rng, (rows, 300)), [_bf16(rng, (300, n)) for n in (96, 35)]
    text = _program(lambda x, *ws: cpu_matmul.matmuls(x, ws), x, *ws)
    kernel = text.count("custom_call @hotswap_HotswapBf16Matmul")
    bf16_dot = any("dot_general" in line and "300xbf16>" in line for line in text.splitlines())
    if cpu_matmul.bf16_dots():
        assert kernel == (1 if cpu_matmul.BF16_MIN_ROWS <= rows <= cpu_matmul.BF16_MAX_ROWS else 0)
        assert bf16_dot == (rows > cpu_matmul.BF16_MAX_ROWS)
    else:
        assert kernel == 0 and not bf16_dot
    x32 = x.astype(jnp.float32)
    assert "HotswapBf16Matmul" not in _program(lambda x, *ws: cpu_matmul.matmuls(x, ws), x32, *ws)
    for y, w in zip(jax.jit(lambda x, *ws: cpu_matmul.matmuls(x, ws))(x, *ws), ws, strict=True):
        assert y.dtype == jnp.bfloat16
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2**-8, atol=1e-3 * np.sqrt(300))
    logits = jax.jit(lambda x, w: cpu_matmul.matmuls(x, [w], out_dtype=jnp.float32)[0])(x, ws[0])
    assert logits.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(ws[0], np.float64)
    np.testing.assert_allclose(np.asarray(logits, np.float64), want, rtol=1e-5, atol=1e-5 * np.sqrt(300))

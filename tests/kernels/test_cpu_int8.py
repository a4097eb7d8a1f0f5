"""The int8 weight-only matmul (`kernels/cpu_int8.py`) on every path this CPU runs, against numpy's
float64 product of the dequantized weight (data * scales) with x."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hotswap.kernels import cpu_int8

ROWS = (1, 2, 5, 16, 33, 300)  # GEMV (K split), 1-2 tiles, several row passes, prefill-sized
GROUPS = (None, 32, 128)  # per-channel, and groups of 32 and 128 rows
K = 256
# Several weights in one call: widths off the 16- and 8-lane vectors (100 = 6 x 16 + 4, 36) and
# one of several column panels (272).
WIDTHS = (100, 36, 272)


def _weight(rng, n, group, k=K):
    g = 1 if group is None else k // group
    data = rng.integers(-128, 128, (k, n), dtype=np.int8)
    scales = (rng.random((g, n)) * 0.02 + 1e-3).astype(np.float32)
    return data, scales


def _dense(data, scales):
    return data.astype(np.float64) * np.repeat(
        scales.astype(np.float64), len(data) // scales.shape[0], axis=0
    )


def _check(x, weights, ys, quantized_x):
    """Each y within f32 rounding of the float64 product, relative to sum |x||w| (and, where x was
    quantized, within the bound of that rounding: half of x's step, amax / 127 per row and
    group, times sum |w| of the group)."""
    x64 = x.astype(np.float64)
    K = x.shape[1]  # noqa: N806 (the module's K unless a test passes another)
    for (data, scales), y in zip(weights, ys, strict=True):
        w = _dense(data, scales)
        bound = 1e-5 * (np.abs(x64) @ np.abs(w)) + 1e-30
        if quantized_x:
            gl = K if scales.shape[0] == 1 else K // scales.shape[0]
            for g in range(K // gl):
                rows = slice(g * gl, (g + 1) * gl)
                step = np.abs(x64[:, rows]).max(axis=1, keepdims=True) / 127
                bound += step / 2 * np.abs(w[rows]).sum(axis=0)[None, :]
        err = np.abs(np.asarray(y, np.float64) - x64 @ w)
        assert y.shape == (x.shape[0], data.shape[1]) and y.dtype == jnp.float32
        assert np.all(err <= bound), f"worst error / bound {np.max(err / bound):.3g}"


@pytest.mark.parametrize("path", cpu_int8.runnable())
def test_every_path_matches_the_float64_product(path):
    """Every row count and scale layout on `path`, three weights sharing x in one call. The VNNI
    path is asked with exact=False (it quantizes x) and checked against its rounding's bound."""
    rng = np.random.default_rng(0)
    vnni = path == "avx512_vnni"
    for group in GROUPS:
        weights = [_weight(rng, n, group) for n in WIDTHS]
        for m in ROWS:
            x = rng.standard_normal((m, K)).astype(np.float32)
            ys = cpu_int8.matmuls(jnp.asarray(x), weights, isa=path, exact=not vnni)
            _check(x, weights, ys, quantized_x=vnni)


@pytest.mark.parametrize("path", cpu_int8.runnable())
def test_k_off_the_4_row_steps(path):
    """K = 250 in groups of 50 (and per-channel): the GEMV's 4-row steps and the K split end
    mid-step. VNNI takes 4 k a step and refuses such groups, naming the problem."""
    rng = np.random.default_rng(4)
    for group in (None, 50):
        weights = [_weight(rng, n, group, k=250) for n in (40, 96)]
        for m in (1, 2, 5, 33):
            x = rng.standard_normal((m, 250)).astype(np.float32)
            if path == "avx512_vnni":
                with pytest.raises(jax.errors.JaxRuntimeError, match="multiple of 4"):
                    cpu_int8.matmuls(jnp.asarray(x), weights, isa=path, exact=False)
                continue
            _check(x, weights, cpu_int8.matmuls(jnp.asarray(x), weights, isa=path), quantized_x=False)


def test_jit_leading_dims_and_one_custom_call():
    """Under jit, x with leading dims [2, 3, K] gives [2, 3, N] per weight, all from one call."""
    rng = np.random.default_rng(1)
    weights = [_weight(rng, n, 32) for n in (64, 48)]
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    fn = jax.jit(lambda x, ws: cpu_int8.matmuls(x, ws))
    ys = fn(jnp.asarray(x), weights)
    assert fn.lower(jnp.asarray(x), weights).as_text().count("hotswap_HotswapInt8Matmuls") == 1
    assert [y.shape for y in ys] == [(2, 3, 64), (2, 3, 48)]
    _check(x.reshape(6, K), weights, [y.reshape(6, -1) for y in ys], quantized_x=False)


def test_auto_is_exact_unless_allowed_to_quantize_x():
    """ "auto" with exact=True gives the f32 path's bits; with exact=False and 16+ rows, a CPU
    with VNNI quantizes x (a different, bounded result) and below 16 rows it stays exact."""
    rng = np.random.default_rng(2)
    weights = [_weight(rng, 128, None)]
    paths = cpu_int8.runnable()
    best_exact = next(p for p in paths if p != "avx512_vnni")
    for m in (5, 33):
        x = jnp.asarray(rng.standard_normal((m, K)).astype(np.float32))
        exact = np.asarray(cpu_int8.matmuls(x, weights)[0])
        np.testing.assert_array_equal(exact, np.asarray(cpu_int8.matmuls(x, weights, isa=best_exact)[0]))
        loose = np.asarray(cpu_int8.matmuls(x, weights, exact=False)[0])
        if "avx512_vnni" in paths and m >= 16:
            assert not np.array_equal(loose, exact)
            _check(np.asarray(x), weights, [loose], quantized_x=True)
        else:
            np.testing.assert_array_equal(loose, exact)


def test_refuses_what_it_cannot_run():
    """An unknown path name and malformed weights raise before any call; a path this kernel has
    no code for (avx512_bf16), or VNNI with exact=True, fails the call naming the problem."""
    rng = np.random.default_rng(3)
    data, scales = _weight(rng, 32, None)
    x = jnp.ones((2, K), jnp.float32)
    with pytest.raises(ValueError, match="unknown CPU path 'avx1024'"):
        cpu_int8.matmuls(x, [(data, scales)], isa="avx1024")
    with pytest.raises(ValueError, match="do not divide K"):
        cpu_int8.matmuls(x, [(data, np.ones((3, 32), np.float32))])
    with pytest.raises(ValueError, match="need data"):
        cpu_int8.matmuls(x, [(data[:100], scales)])
    with pytest.raises(TypeError, match="int8 data"):
        cpu_int8.matmuls(x, [(data.astype(np.float32), scales)])
    with pytest.raises(jax.errors.JaxRuntimeError, match="avx512_bf16 is not one this kernel has"):
        cpu_int8.matmuls(x, [(data, scales)], isa="avx512_bf16")
    if "avx512_vnni" in cpu_int8.runnable():
        with pytest.raises(jax.errors.JaxRuntimeError, match="exact = 1 forbids"):
            cpu_int8.matmuls(x, [(data, scales)], isa="avx512_vnni", exact=True)

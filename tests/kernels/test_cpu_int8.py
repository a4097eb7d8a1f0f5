"""The int8 weight-only matmul (`kernels/cpu_int8.py`) on every path this CPU runs, against numpy's
float64 product of the dequantized weight (data * scales) with x."""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hotswap.kernels import cpu_build, cpu_int8, cpu_isa
from hotswap.kernels.cpu_target import host

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
    paths are asked with exact=False (they quantize x) and checked against its rounding's bound."""
    rng = np.random.default_rng(0)
    vnni = path in cpu_int8.QUANTIZING
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
            if path in cpu_int8.QUANTIZING:
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
    with VNNI quantizes x (a different, bounded result) and below 16 rows it stays exact. Each
    time the bits are those of the path the kernel's table (`path_for`) names for this CPU."""
    rng = np.random.default_rng(2)
    weights = [_weight(rng, 128, None)]
    paths = cpu_int8.runnable()
    best_exact = next(p for p in paths if p not in cpu_int8.QUANTIZING)
    for m in (5, 33):
        x = jnp.asarray(rng.standard_normal((m, K)).astype(np.float32))
        exact = np.asarray(cpu_int8.matmuls(x, weights)[0])
        assert cpu_int8.path_for(m) == best_exact
        np.testing.assert_array_equal(exact, np.asarray(cpu_int8.matmuls(x, weights, isa=best_exact)[0]))
        loose = np.asarray(cpu_int8.matmuls(x, weights, exact=False)[0])
        chosen = cpu_int8.path_for(m, exact=False)
        quantized = chosen in cpu_int8.QUANTIZING
        assert quantized == (m >= 16 and any(p in cpu_int8.QUANTIZING for p in paths))
        np.testing.assert_array_equal(
            loose, np.asarray(cpu_int8.matmuls(x, weights, chosen, exact=not quantized)[0])
        )
        if quantized:
            assert not np.array_equal(loose, exact)
            _check(np.asarray(x), weights, [loose], quantized_x=True)
        else:
            np.testing.assert_array_equal(loose, exact)


# cpuinfo flags of CPUs this one is not: the table must pick each one's path.
_AVX512 = ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"]
CPUS = {
    "haswell": ["avx2", "fma", "f16c"],
    "alder_lake": ["avx2", "fma", "f16c", "avx_vnni"],  # also Sierra Forest: AVX-VNNI, no AVX-512
    "skylake_x": _AVX512,
    "zen4": [*_AVX512, "avx512_vnni", "avx512_bf16"],  # AVX512_VNNI, no AVX-VNNI
    "sapphire_rapids": [*_AVX512, "avx512_vnni", "avx512_bf16", "avx_vnni"],  # also Zen 5
    "none": ["sse4_2"],
}
# cpu -> (auto exact, auto with exact=False from 16 rows)
AUTO = {
    "haswell": ("avx2", "avx2"),
    "alder_lake": ("avx2", "avx_vnni"),
    "skylake_x": ("avx512", "avx512"),
    "zen4": ("avx512", "avx512_vnni"),
    "sapphire_rapids": ("avx512", "avx512_vnni"),
    "none": ("scalar", "scalar"),
}


@pytest.mark.parametrize("cpu", CPUS)
def test_the_table_picks_each_cpu_s_path(cpu):
    """The kernel's own dispatch (`Choose`, a pure function of the CPU's features) for CPUs this
    one is not: "auto" quantizes x only with exact=False, 16+ rows and packable weights, on the
    best VNNI the CPU has (AVX-VNNI on an AVX2 CPU with it and no AVX-512); a path asked by name
    runs only where the CPU has every flag it needs, and a quantizing one only with exact=False."""
    flags = CPUS[cpu]
    exact, loose = AUTO[cpu]
    assert cpu_int8.path_for(64, exact=True, flags=flags) == exact
    assert cpu_int8.path_for(64, exact=False, flags=flags) == loose
    assert cpu_int8.path_for(15, exact=False, flags=flags) == exact
    assert cpu_int8.path_for(64, exact=False, flags=flags, packable=False) == exact
    for path in cpu_int8.PATHS:
        runs = set(cpu_isa.NEEDS[path]) <= set(flags)
        assert cpu_int8.path_for(64, exact=False, isa=path, flags=flags) == (path if runs else None)
        quantizes = path in cpu_int8.QUANTIZING
        assert cpu_int8.path_for(64, exact=True, isa=path, flags=flags) == (
            path if runs and not quantizes else None
        )
    assert cpu_int8.path_for(64, exact=False, isa="avx512_bf16", flags=CPUS["sapphire_rapids"]) is None


def test_python_s_table_is_isa_h_s():
    """cpu_isa's names and flags are isa.h's: each path needs exactly NEEDS' flags, and this
    CPU's features as the C++ runtime reads CPUID are those its cpuinfo flags name."""
    lib = cpu_build.library("int8_matmul")
    lib.HotswapIsaNeeds.restype = lib.HotswapCpuFeatures.restype = ctypes.c_uint32
    lib.HotswapIsaNeeds.argtypes = [ctypes.c_int32]
    for path, needs in cpu_isa.NEEDS.items():
        assert lib.HotswapIsaNeeds(cpu_isa.PATHS[path]) == cpu_isa.features(needs), path
    assert len(set(cpu_isa.PATHS.values())) == len(cpu_isa.PATHS)
    assert lib.HotswapCpuFeatures() == cpu_isa.features(host().isa)


def test_a_path_this_cpu_lacks_is_refused_naming_what_it_lacks():
    """Every path of the kernel is built on every box (each has its own target attribute): one this
    CPU cannot run (on an AVX-512 CPU without AVX-VNNI, such as Zen 4: avx_vnni) reaches the
    kernel, which refuses it naming the flags the CPU lacks; "auto" never picks it."""
    rng = np.random.default_rng(6)
    data, scales = _weight(rng, 64, 32)
    x = jnp.asarray(rng.standard_normal((32, K)).astype(np.float32))
    have = set(host().isa)
    lacking = [p for p in cpu_int8.PATHS if p not in cpu_int8.runnable()]
    if "avx_vnni" not in have:
        assert "avx_vnni" in lacking
    for path in lacking:
        missing = " ".join(f for f in cpu_isa.FEATURES if f in cpu_isa.NEEDS[path] and f not in have)
        with pytest.raises(
            jax.errors.JaxRuntimeError, match=f"path {path} needs .*; this CPU lacks {missing}(\n|$)"
        ):
            jax.block_until_ready(cpu_int8.matmuls(x, [(data, scales)], isa=path, exact=False))
        assert cpu_int8.path_for(32, exact=False) != path


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
    for path in (p for p in cpu_int8.QUANTIZING if p in cpu_int8.runnable()):
        with pytest.raises(jax.errors.JaxRuntimeError, match=f"{path} quantizes x, which exact = 1 forbids"):
            cpu_int8.matmuls(x, [(data, scales)], isa=path, exact=True)

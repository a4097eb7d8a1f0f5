"""The C++ CPU kernels' small matmul against numpy, and how the engine picks its attention.
(The C++ attention is checked in test_reference_attention.py, beside the jnp paths.)"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hotswap import LLM, SamplingParams
from hotswap.engine_config import default_dtype
from hotswap.errors import ConfigError
from hotswap.kernels import cpu_build, cpu_matmul
from hotswap.kernels.backend import Backend


@pytest.mark.parametrize(
    "lead,k,n",
    [
        ((1,), 768, 2304),  # GEMV: 1-2 rows
        ((2,), 131, 77),
        ((1, 1), 5, 3),
        ((2, 1), 1000, 64),
        ((3,), 131, 77),  # tiled (AVX-512 or AVX2): 3-32 rows, a chunk per thread, 13 tail columns
        ((16,), 768, 2048),  # two 8-row tiles: 1,024-column chunks, one per thread
        ((9,), 131, 20),  # one 9-row tile: one 16-column chunk split over K, 4 tail columns
        ((2, 6), 100, 4160),  # 12 rows (6 + 6): five 832-column chunks
        ((4, 8), 200, 4160),  # 32 rows (4 x 8): column chunks of a wide matrix, like the lm head
        ((7,), 9, 64),  # K too short to split
        ((5,), 0, 70),  # empty K: zeros
        ((1,), 0, 70),
    ],
)
def test_matches_numpy(lead, k, n):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((*lead, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w2 = rng.standard_normal((k, 2 * n + 1)).astype(np.float32)
    got, got2 = jax.jit(lambda x, w, w2: (cpu_matmul.matmul(x, w), cpu_matmul.matmul(x, w2)))(x, w, w2)
    assert got.shape == (*lead, n) and got2.shape == (*lead, 2 * n + 1)
    for y, ww in ((got, w), (got2, w2)):
        np.testing.assert_allclose(
            np.asarray(y), x.astype(np.float64) @ ww, rtol=1e-4, atol=1e-4 * np.sqrt(k)
        )


def test_routes_only_decode_sized_f32_and_bf16_matmuls_to_the_kernel():
    """More rows than max_rows() (a prefill), another dtype, or weights of two dtypes in one
    call stay on XLA's dot (no custom call in the program)."""
    w = jnp.ones((64, 32), jnp.float32)

    def custom_calls(x, w):
        two = jax.jit(lambda x, w: (cpu_matmul.matmul(x, w), cpu_matmul.matmul(x, w)))
        return two.lower(x, w).as_text().count("custom_call")

    top = cpu_matmul.max_rows()
    flags = set(open("/proc/cpuinfo").read().split())
    assert top == (32 if "avx512f" in flags or {"avx2", "fma"} <= flags else 2)  # register tiles
    assert custom_calls(jnp.ones((2, 64), jnp.float32), w) == 2
    assert custom_calls(jnp.ones((top, 64), jnp.float32), w) == 2
    assert custom_calls(jnp.ones((top + 1, 64), jnp.float32), w) == 0
    assert custom_calls(jnp.ones((1, 64), jnp.bfloat16), w.astype(jnp.bfloat16)) == 2
    assert custom_calls(jnp.ones((1, 64), jnp.float16), w.astype(jnp.float16)) == 0
    mixed = jax.jit(lambda x: cpu_matmul.matmuls(x, [w, w.astype(jnp.bfloat16)]))
    assert mixed.lower(jnp.ones((1, 64), jnp.float32)).as_text().count("custom_call") == 0


def _choose(attention: str, n: int | None = None, dtype: str = "float32") -> str:
    """The attention `Backend.choose` picks for a cache on `n` CPU devices (None: the default)."""
    devices = None if n is None else jax.devices()[:1] * n  # only their platform and count are read
    return Backend.choose(attention, head_dim=64, dtype=dtype, devices=devices).attention


def test_auto_picks_the_cpu_kernel_on_one_cpu_device_only():
    assert cpu_build.available()  # CI has a C++ compiler: the kernels must build there
    assert _choose("auto") == "cpu"
    assert _choose("auto", 1) == "cpu"
    # An opaque custom call would make GSPMD gather a head-sharded cache: the jnp path instead.
    assert _choose("auto", 2) == "reference"
    assert _choose("reference") == "reference"
    with pytest.raises(ConfigError, match="one device"):
        _choose("cpu", 2)


def test_the_cpu_kernels_take_f32_and_bf16_only(tiny_dir):
    """bf16 on CPU runs the C++ attention (f32 softmax inside); float16, which it does not
    take, runs the jnp reference under "auto" and is refused when "cpu" is asked for."""
    assert _choose("auto", dtype="bfloat16") == "cpu"
    assert _choose("auto", dtype="float16") == "reference"
    with pytest.raises(ConfigError, match="dtype"):
        _choose("cpu", dtype="float16")
    llm = LLM(tiny_dir, dtype="float16", max_model_len=64, warmup=False)
    assert llm.engine.ecfg.attention == "reference" and llm.state.kv.pages[0].dtype == jnp.float16
    assert (
        len(llm.generate([1, 2, 3], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids)
        == 2
    )
    with pytest.raises(ConfigError, match="dtype"):
        LLM(tiny_dir, dtype="float16", attention="cpu", max_model_len=64, warmup=False)


def test_default_dtype_is_bf16_on_tpu_only(tiny_dir):
    assert default_dtype("tpu") == "bfloat16"
    assert default_dtype("cpu") is None and default_dtype("gpu") is None  # the checkpoint's
    assert LLM(tiny_dir, max_model_len=64, warmup=False).config.dtype == "float32"


def test_without_a_compiler_auto_falls_back_to_the_jnp_reference(tmp_path):
    """A machine where the kernels cannot build still serves: "auto" means "reference" there,
    and asking for "cpu" names the failed build."""
    code = (
        "from hotswap.kernels import cpu_build\n"
        "from hotswap.kernels.backend import Backend\n"
        "print(Backend.choose('auto', head_dim=64).attention)\n"
        "try:\n"
        "    cpu_build.register('paged_attention', 'HotswapPagedAttention')\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    env = {**os.environ, "CXX": "/bin/false", "HOTSWAP_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "reference"
    assert lines[1].startswith("ConfigError building a CPU kernel failed")


def test_a_shared_header_is_part_of_every_kernels_build_key(tmp_path, monkeypatch):
    """The kernels include cpu/parallel.h: editing it must rebuild them, not reuse a stale .so."""
    src = tmp_path / "cpu"
    src.mkdir()
    for f in cpu_build.SOURCES.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(cpu_build, "SOURCES", src)
    cxx = cpu_build._compiler()
    target = cpu_build.native_target(cxx)
    before = cpu_build._library_path(src / "small_matmul.cc", cxx, target)
    (src / "parallel.h").write_text((src / "parallel.h").read_text() + "\n// edited\n")
    assert cpu_build._library_path(src / "small_matmul.cc", cxx, target) != before


@pytest.mark.parametrize("r,v", [(1, 32000), (32, 1000), (3, 17), (4, 1)])
def test_row_stats_match_the_jnp_sampler(r, v):
    """Argmax (first index of a tie) and logsumexp as `sampling.argmax_logsumexp`; an all
    -inf row gives index 0 and -inf, a row with NaN index V - 1 and NaN."""
    from hotswap.kernels import cpu_sampling
    from hotswap.programs.sampler import argmax_logsumexp

    rng = np.random.default_rng(r * v)
    x = (rng.standard_normal((r, v)) * 5).astype(np.float32)
    x[0, -1] = x[0, 0] = x[0].max()  # a tie: the first index wins
    if r > 2:
        x[1] = -np.inf
        x[2, v // 2] = np.nan
    idx, lse = jax.jit(cpu_sampling.argmax_logsumexp)(x)
    ref_idx, ref_lse = jax.jit(argmax_logsumexp)(x)
    idx, lse, ref_idx, ref_lse = map(np.asarray, (idx, lse, ref_idx, ref_lse))
    ok = np.isfinite(ref_lse)
    assert idx[0] == 0
    np.testing.assert_array_equal(idx[ok], ref_idx[ok])
    np.testing.assert_allclose(lse[ok], ref_lse[ok], rtol=1e-6, atol=1e-6)
    if r > 2:
        assert (idx[1], lse[1]) == (0, -np.inf)
        assert idx[2] == v - 1 and np.isnan(lse[2])


@pytest.mark.parametrize("rows", [1, 5, 16, 32])
def test_weights_sharing_x_go_in_one_call(rows):
    """`matmuls` (a layer's q/k/v or gate/up) makes one custom call for all its weights, and
    each result equals numpy's: GEMV, tiled and strip row counts, a narrow weight split over
    K, tail columns, and different widths side by side."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 300)).astype(np.float32)
    ws = [rng.standard_normal((300, n)).astype(np.float32) for n in (1088, 256, 77)]
    fn = jax.jit(lambda x, *ws: cpu_matmul.matmuls(x, ws))
    calls = fn.lower(x, *ws).as_text().count("stablehlo.custom_call @hotswap_HotswapSmallMatmul")
    assert calls == (1 if rows <= cpu_matmul.max_rows() else 0)  # 2 rows without register tiles
    for y, w in zip(fn(x, *ws), ws, strict=True):
        np.testing.assert_allclose(
            np.asarray(y), x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4 * np.sqrt(300)
        )


@pytest.mark.parametrize("rows", [3, 4, 5, 9, 10, 13, 17, 23, 27, 31, 32])
def test_every_row_count_of_the_tiled_path(rows):
    """3-32 rows go in register tiles of at most 9 rows with AVX-512 (4 zmm wide up to 4 rows,
    else 3) or 6 with AVX2 (3 ymm wide up to 3 rows, else 2): row counts that split unevenly
    (10 = 5 + 5, 17 = 9 + 8, 31 = 8 + 8 + 8 + 7; 13 = 5 + 4 + 4 in ymm), widths whose last panel is
    narrower than the others or that end in columns past a multiple of the lanes, K not a multiple
    of the k-block, and a wide weight beside narrow ones in one call. About 1 s."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 300)).astype(np.float32)
    ws = [rng.standard_normal((300, n)).astype(np.float32) for n in (2085, 784, 80, 35)]
    for y, w in zip(jax.jit(lambda x, *ws: cpu_matmul.matmuls(x, ws))(x, *ws), ws, strict=True):
        np.testing.assert_allclose(
            np.asarray(y), x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4 * np.sqrt(300)
        )


@pytest.mark.parametrize("rows", [*range(1, 11), 13, 16, 17, 23, 31, 32])
def test_bf16_weights_at_every_row_count(rows):
    """bf16 weights widened in registers, on the GEMV (1-2 rows) and the tiled path (3-32, with
    AVX-512 or AVX2; XLA's dot above max_rows()): a
    bf16 x gives bf16 results (XLA's dot's dtype), rounded once from the f32 sums; an f32 x
    with `out_dtype` f32 (the LM head's logits) is exact to f32 sums. Widths with tail columns
    and a weight of another width in the same call, as in `test_every_row_count_of_the_tiled_path`."""
    rng = np.random.default_rng(100 + rows)
    x = jnp.asarray(rng.standard_normal((rows, 300)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((300, n)), jnp.bfloat16) for n in (2085, 80, 35)]
    want = [np.asarray(x, np.float64) @ np.asarray(w, np.float64) for w in ws]
    fn = jax.jit(lambda x, *ws: cpu_matmul.matmuls(x, ws))
    text = fn.lower(x, *ws).as_text()  # with AVX512_BF16 a bf16 x takes the bf16 kernel (test_cpu_bf16)
    calls = sum(text.count(f"custom_call @hotswap_{s}") for s in ("HotswapSmallMatmul", "HotswapBf16Matmul"))
    assert calls == (1 if rows <= cpu_matmul.max_rows() else 0)  # 2 without register tiles
    for y, ref in zip(fn(x, *ws), want, strict=True):
        assert y.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=2**-8, atol=1e-3 * np.sqrt(300))
    x32 = np.asarray(x, np.float32)
    logits = jax.jit(lambda x, w: cpu_matmul.matmuls(x, [w], out_dtype=jnp.float32)[0])(x32, ws[0])
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), want[0], rtol=1e-4, atol=1e-4 * np.sqrt(300))


@pytest.mark.parametrize(
    "lead,k,n",
    [
        ((1,), 768, 2304),  # 1 row: 16-row sweeps of four K ranges
        ((2,), 301, 77),  # 2 rows, ranges ending in single-row sweeps, 13 tail columns
        ((1, 1), 5, 3),  # K too short to split, no 32-column block
        ((1,), 17, 35),
    ],
)
def test_bf16_weights_on_the_gemv_with_an_f32_x(lead, k, n):
    """The GEMV's bf16 weights (widened in registers; with AVX-512 by interleaving with zeros,
    its partial sums kept in that order until the slice's end) against float64: an f32 x with
    bf16 weights stays on this path on every CPU."""
    rng = np.random.default_rng(k)
    x = rng.standard_normal((*lead, k)).astype(np.float32)
    ws = [jnp.asarray(rng.standard_normal((k, m)), jnp.bfloat16) for m in (n, 2 * n + 1)]
    text = jax.jit(lambda x, *ws: cpu_matmul.matmuls(x, ws)).lower(x, *ws).as_text()
    assert text.count("custom_call @hotswap_HotswapSmallMatmul") == 1
    for y, w in zip(jax.jit(lambda x, *ws: cpu_matmul.matmuls(x, ws))(x, *ws), ws, strict=True):
        assert y.dtype == jnp.float32 and y.shape == (*lead, w.shape[1])
        want = x.astype(np.float64) @ np.asarray(w, np.float64)
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
def test_bf16_weights_above_the_kernels_rows_take_a_widened_f32_dot(out_dtype):
    """Above max_rows() a bf16 weight and its x are widened to f32 before XLA's dot (its bf16 dot
    into f32 logits was the slow one): the program holds an f32 dot and no bf16 one, and the
    result is the f32 sums rounded once, to bf16 or (logits) kept in f32. With AVX512_BF16 a bf16
    x keeps its bf16 dot (test_cpu_bf16), so there the x is f32, which is widened the same way."""
    rows = cpu_matmul.max_rows() + 32
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((rows, 300)), jnp.bfloat16)
    if cpu_matmul.bf16_dots():
        x = x.astype(jnp.float32)
    w = jnp.asarray(rng.standard_normal((300, 70)), jnp.bfloat16)
    fn = jax.jit(lambda x, w: cpu_matmul.matmuls(x, [w], out_dtype=out_dtype)[0])
    dots = [line for line in fn.lower(x, w).as_text().splitlines() if "dot_general" in line]
    assert len(dots) == 1 and "300xf32>" in dots[0] and "bf16>" not in dots[0], dots
    y = fn(x, w)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert y.dtype == (out_dtype or x.dtype)
    rtol = 1e-5 if y.dtype == jnp.float32 else 2**-8
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=rtol, atol=rtol * np.sqrt(300))


def test_all_finite_flags_each_array():
    """The C++ NaN/Inf check behind `update_weights`: one flag per array, f32 and bf16, a bad
    value anywhere (first element, a 1 MB piece boundary, the tail past the vector width)."""
    from hotswap.kernels import cpu_finite

    rng = np.random.default_rng(0)
    big = 1 << 18  # f32 elements in one 1 MB piece
    shapes = [(3, 5), (2, big + 7), (big + 100,), (1,), (0, 4)]
    clean = [jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    clean += [x.astype(jnp.bfloat16) for x in clean[:3]]
    assert cpu_finite.usable(clean)
    assert np.asarray(jax.jit(cpu_finite.all_finite)(clean)).all()
    bad = list(clean)
    bad[0] = bad[0].at[0, 0].set(jnp.nan)
    bad[1] = bad[1].at[1, 0].set(jnp.inf)  # element big + 7: the second piece
    bad[2] = bad[2].at[-1].set(-jnp.inf)
    bad[6] = bad[6].at[1, big + 6].set(jnp.nan)
    got = np.asarray(jax.jit(cpu_finite.all_finite)(bad))
    np.testing.assert_array_equal(got, [False, False, False, True, True, True, False, True])


def test_kernels_refuse_inputs_they_cannot_take():
    """Shapes or dtypes a kernel was not built for are a clear error, not a wrong answer:
    a weight whose K differs from x's, and an integer array given to the finiteness check."""
    from hotswap.kernels import cpu_finite

    x = jnp.ones((4, 8), jnp.float32)
    target = cpu_build.register("small_matmul", "HotswapSmallMatmul")
    bad_k = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct((4, 3), jnp.float32)])
    with pytest.raises(Exception, match="need w \\[K, N\\] and y \\[M, N\\]"):
        jax.block_until_ready(jax.jit(bad_k)(x, jnp.ones((9, 3), jnp.float32)))
    ints = [jnp.ones((3,), jnp.int32)]
    assert not cpu_finite.usable(ints)  # update_weights takes XLA's check for these
    with pytest.raises(Exception, match="f32 or bf16"):
        jax.block_until_ready(jax.jit(cpu_finite.all_finite)(ints))

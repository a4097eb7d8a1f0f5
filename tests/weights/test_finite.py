"""The one finiteness check (`kernels/finite.py`): each backend's path finds every NaN and Inf."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hotswap.kernels import cpu_build, finite


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_all_finite(dtype):
    check = jax.jit(finite.all_finite)
    x = np.linspace(-3e4, 3e4, 1_000_003).astype(np.float32)
    assert bool(check(jnp.asarray(x, dtype)))
    for bad in (np.nan, np.inf, -np.inf):
        for at in (0, 777_777, x.size - 1):
            y = x.copy()
            y[at] = bad
            assert not bool(check(jnp.asarray(y, dtype))), (bad, at)
    assert bool(check(jnp.zeros((0, 4), dtype)))


def test_host_finiteness_check_covers_every_slab():
    scratch = np.empty(1000, np.bool_)
    for size in (1, 999, 1000, 1001, 5 * 1000 + 7):
        x = np.ones(size, np.float32)
        assert finite.host_all_finite(x, scratch)
        for at in {0, size // 2, size - 1}:
            y = x.copy()
            y[at] = np.nan
            assert not finite.host_all_finite(y.reshape(1, -1), scratch), (size, at)


def test_finite_check_names_bad_arrays_in_order_whatever_the_path():
    """Host arrays, arrays for the C++ call (f32/bf16 on one CPU device) and arrays for the
    XLA reduction (f16) in one check: the flags come back under the right names, in order."""
    rng = np.random.default_rng(0)
    arrays = {
        "host_f32": rng.standard_normal((64, 33)).astype(np.float32),
        "host_bf16": rng.standard_normal(100).astype(ml_dtypes.bfloat16),
        "dev_f32": jnp.asarray(rng.standard_normal((300, 7)), jnp.float32),
        "dev_bf16": jnp.asarray(rng.standard_normal(513), jnp.bfloat16),
        "dev_f16": jnp.asarray(rng.standard_normal((3, 5)), jnp.float16),
        "empty": jnp.zeros((0, 4), jnp.float32),
    }
    assert finite.non_finite(arrays) == []
    bad = dict(arrays)
    for name in ("host_bf16", "dev_f32", "dev_f16"):
        flat = np.array(arrays[name]).reshape(-1)
        flat[flat.size // 2] = np.nan if name != "dev_f32" else -np.inf
        bad[name] = jnp.asarray(flat.reshape(arrays[name].shape)) if name.startswith("dev") else flat
    assert finite.non_finite(bad) == ["host_bf16", "dev_f32", "dev_f16"]


def test_cpu_device_arrays_take_the_cpp_call(monkeypatch):
    if jax.default_backend() != "cpu" or not cpu_build.available():
        pytest.skip("the C++ kernels run on the CPU backend only")
    calls = []
    real = finite._cpp_finite
    monkeypatch.setattr(finite, "_cpp_finite", lambda leaves: calls.append(len(leaves)) or real(leaves))
    x = jnp.ones((8, 8), jnp.float32).at[1, 2].set(jnp.nan)
    assert finite.non_finite({"a": jnp.ones(4, jnp.bfloat16), "b": x, "c": jnp.ones(3, jnp.float16)}) == ["b"]
    assert calls == [2]  # f32 and bf16 in one call; f16 went to the XLA reduction
    check = finite.FiniteCheck()
    check.add({"a": jnp.ones(4, jnp.bfloat16)})
    check.add({"b": x})
    assert check.non_finite() == ["b"] and calls == [2, 1, 1]  # added one by one: a call each

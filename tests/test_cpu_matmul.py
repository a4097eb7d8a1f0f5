"""The C++ small matmul (decode steps of 1-2 rows on CPU) against numpy, and its routing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hotswap.kernels import cpu_matmul


@pytest.mark.parametrize("lead,k,n", [((1,), 768, 2304), ((2,), 131, 77), ((1, 1), 5, 3), ((2, 1), 1000, 64)])
def test_matches_numpy(lead, k, n):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((*lead, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w2 = rng.standard_normal((k, 2 * n + 1)).astype(np.float32)
    got, got2 = jax.jit(cpu_matmul.matmuls)(x, [w, w2])
    assert got.shape == (*lead, n) and got2.shape == (*lead, 2 * n + 1)
    for y, ww in ((got, w), (got2, w2)):
        np.testing.assert_allclose(
            np.asarray(y), x.astype(np.float64) @ ww, rtol=1e-4, atol=1e-4 * np.sqrt(k)
        )


def test_routes_only_few_f32_rows_to_the_kernel():
    """Three or more rows, or another dtype, stay on XLA's dot (no custom call in the program)."""
    w = jnp.ones((64, 32), jnp.float32)

    def custom_calls(x, w):
        return jax.jit(cpu_matmul.matmuls).lower(x, [w, w]).as_text().count("custom_call")

    assert custom_calls(jnp.ones((2, 64), jnp.float32), w) == 2
    assert custom_calls(jnp.ones((3, 64), jnp.float32), w) == 0
    assert custom_calls(jnp.ones((1, 64), jnp.bfloat16), w.astype(jnp.bfloat16)) == 0

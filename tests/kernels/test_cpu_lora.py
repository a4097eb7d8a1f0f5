"""The C++ LoRA merge (`kernels/cpu_lora.py`) against its jnp twin (XLA's dot, add and convert),
and the merged sync taking it on one CPU device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hotswap.kernels import cpu_build, cpu_lora
from hotswap.model import lora

# (W shape, number of W's leading dims A takes, rank): sizes off the kernel's 6-row and 16-column
# tiles and its 192 x 256 work items (197 x 300: a second row block of 5 rows, a second column
# block of two panels and 12 loose columns), several leaves in one call, W of 3 dims either way round
# (wq [D, Hq, hd]: A [D, r]; wo [Hq, hd, D]: A [Hq, hd, r]), rank 1 and an empty rank.
LEAVES = [
    ((53, 37), 1, 7),
    ((197, 300), 1, 64),
    ((6, 16), 1, 1),
    ((13, 3, 5), 1, 16),
    ((3, 5, 41), 2, 9),
    ((5, 2), 1, 0),
]


def _triples(dtype, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for shape, n_in, rank in LEAVES:
        w = rng.standard_normal(shape).astype(np.float32)
        a = rng.standard_normal((*shape[:n_in], rank)).astype(np.float32) * 0.5
        b = rng.standard_normal((rank, *shape[n_in:])).astype(np.float32) * 0.5
        out.append((jnp.asarray(w, dtype), jnp.asarray(a), jnp.asarray(b)))
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_equals_the_xla_merge(dtype):
    """Every leaf of one call equals W + scale·A·B as XLA computes it: f32 to rounding, bf16 to
    one unit of its last place (a sum rounded a hair apart may round to the other neighbour)."""
    triples = _triples(dtype)
    got = jax.jit(lambda t: cpu_lora.merge(t, scale=0.75))(triples)
    want = jax.jit(lambda t: cpu_lora.merge_jnp(t, scale=0.75))(triples)
    assert "hotswap_HotswapLoraMerge" in jax.jit(cpu_lora.merge).lower(triples).as_text()
    for g, w, (base, a, _) in zip(got, want, triples, strict=True):
        assert g.shape == base.shape and g.dtype == base.dtype
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if dtype == jnp.float32:
            np.testing.assert_allclose(g64, w64, rtol=1e-5, atol=1e-5 * np.sqrt(a.shape[-1] + 1))
        else:
            np.testing.assert_allclose(g64, w64, rtol=2.0**-7, atol=1e-6)
            assert np.mean(g64 == w64) >= 0.99


def test_bf16_rounds_to_nearest_even_as_xla_converts():
    """A sum exactly halfway between two bf16 values rounds to the even one; one past it, up."""
    w = jnp.asarray([[1.0, 1.0, 1.0, 3.0 + 2**-6]], jnp.bfloat16)
    a = jnp.ones((1, 1), jnp.float32)
    half = 2.0**-8  # half a unit in the last place of 1.0 in bf16 (of 3.0: 2**-7)
    b = jnp.asarray([[half, half * 1.5, 0.0, half * 2]], jnp.float32)
    got = jax.jit(cpu_lora.merge)([(w, a, b)])[0]
    want = jax.jit(cpu_lora.merge_jnp)([(w, a, b)])[0]
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(got, np.float32), [[1.0, 1.0 + 2**-7, 1.0, 3.0 + 2**-5]])


def test_the_merge_takes_the_kernel_on_one_cpu_device():
    """`lora.merge` on params on one CPU device runs the C++ call (the program holds it) and
    gives XLA's merge; the base is untouched and other leaves are the base's own arrays."""
    assert cpu_build.available()
    rng = np.random.default_rng(1)
    base = {
        "embed": jnp.asarray(rng.standard_normal((11, 24)), jnp.float32),
        "layers": [
            {
                "wq": jnp.asarray(rng.standard_normal((24, 2, 8)), jnp.bfloat16),
                "wo": jnp.asarray(rng.standard_normal((2, 8, 24)), jnp.float32),
            }
        ],
    }
    factors = {
        "layers.0.wq": (
            jnp.asarray(rng.standard_normal((24, 4)), jnp.float32),
            jnp.ones((4, 2, 8), jnp.float32),
        ),
        "layers.0.wo": (
            jnp.ones((2, 8, 4), jnp.float32),
            jnp.asarray(rng.standard_normal((4, 24)), jnp.float32),
        ),
    }
    weights = {n: lora._get(base, n) for n in factors}
    assert lora.uses_kernel(weights, factors)
    shardings = tuple(sorted((n, w.sharding) for n, w in weights.items()))
    program = lora._merger(shardings, True)[0].lower(weights, factors).as_text()
    assert "hotswap_HotswapLoraMerge" in program and "dot_general" not in program
    before = jax.tree.map(np.asarray, base)
    merged = lora.merge(base, factors)
    assert merged["embed"] is base["embed"]
    for n in factors:
        want = lora._merge_leaves({n: weights[n]}, {n: factors[n]})[n]
        got = lora._get(merged, n)
        assert got.dtype == weights[n].dtype and got.sharding == weights[n].sharding
        tol = 2.0**-7 if got.dtype == jnp.bfloat16 else 1e-5
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol
        )
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, base), before)


def test_other_dtypes_stay_on_xla():
    """An f16 weight (or an f16 factor) is not the kernel's: the merge keeps XLA's jit."""
    w = jnp.ones((4, 4), jnp.float16)
    a, b = jnp.ones((4, 2), jnp.float32), jnp.ones((2, 4), jnp.float32)
    assert not cpu_lora.usable([(w, a, b)])
    assert not cpu_lora.usable([(w.astype(jnp.float32), a.astype(jnp.float16), b)])
    assert cpu_lora.usable([(w.astype(jnp.float32), a, b)])
    merged = lora.merge({"layers": [{"wq": w}]}, {"layers.0.wq": (a, b)})
    np.testing.assert_array_equal(np.asarray(merged["layers"][0]["wq"]), np.full((4, 4), 3.0, np.float16))

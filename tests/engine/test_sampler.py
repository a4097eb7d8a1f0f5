"""The device sampler (`programs/sampler.py`): plain temperature rows take no sort, and draw the
same tokens whether or not a filtering row shares their batch; draws follow the distribution.
The filters' keep thresholds (the C++ kernel and its jnp twin) keep exactly what sorting keeps."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hotswap.engine.sampling import SamplingParams
from hotswap.kernels import cpu_sampling, reference
from hotswap.programs.sampler import SamplingArrays, sample

V = 64
# The Backend's two `keep_thresholds` and `categorical`: the C++ kernels (CPU) and their jnp
# twins (TPU, reference).
TWINS = {"cpp": cpu_sampling.keep_thresholds, "jnp": reference.keep_thresholds}
DRAWS = {"cpp": cpu_sampling.categorical, "jnp": reference.categorical}
SAMPLE = {
    name: jax.jit(partial(sample, keep_thresholds=f, categorical=DRAWS[name])) for name, f in TWINS.items()
}


def _logits(rows: int, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(0, 2.0, (rows, V)), jnp.float32)


def _tokens(logits, params: list[SamplingParams], seeds, steps, twin: str = "jnp") -> np.ndarray:
    sa = SamplingArrays.from_rows(list(zip(params, seeds, steps, strict=True)), len(params), logits.shape[-1])
    return np.asarray(SAMPLE[twin](logits, sa).tokens)


def _kept_by_sorting(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The filters by a sort of the row, in float64 (vLLM's definitions): top-k keeps values >=
    the k-th largest; top-p the sorted prefix whose preceding mass is below top_p, with the
    ties of its last entry; min-p probs >= min_p * the max prob. They apply together."""
    v = x.shape[0]
    keep = np.ones(v, bool)
    desc = np.sort(x)[::-1]
    if 0 < top_k < v:
        keep &= x >= desc[top_k - 1]
    probs = np.exp(x.astype(np.float64) - x.max())
    probs /= probs.sum()
    if top_p < 1:
        p_desc = np.sort(probs)[::-1]
        n = max(int(np.sum(np.cumsum(p_desc) - p_desc < top_p)), 1)
        keep &= x >= desc[n - 1]
    if min_p > 0:
        keep &= probs >= min_p * probs.max()
    return keep


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("v", [1, 2, 7, 64, 1000, 5003])
def test_keep_thresholds_keep_what_sorting_keeps(twin, v):
    """On random rows, every third rounded to integers (ties at the k-th entry and at top-p's
    last) and every fourth with a third of its entries -inf (masked tokens), with top-k, top-p
    and min-p alone and together: the entries >= the threshold are the sort's kept set."""
    rng = np.random.default_rng(v)
    r = 60
    x = rng.normal(0, 3, (r, v)).astype(np.float32)
    x[::3] = np.round(x[::3])
    x[1::4, : v // 3] = -np.inf
    k = rng.integers(1, v + 2, r).astype(np.int32)
    p = rng.uniform(0.02, 1.0, r).astype(np.float32)
    mp = rng.uniform(0.0, 0.5, r).astype(np.float32)
    # Which filters each row sets: all eight combinations of top-k, top-p and min-p.
    on = np.arange(r)[:, None] >> np.arange(3) & 1 == 1
    k, p, mp = np.where(on[:, 0], k, 0), np.where(on[:, 1], p, 1.0), np.where(on[:, 2], mp, 0.0)
    t = np.asarray(jax.jit(TWINS[twin])(x, k, p.astype(np.float32), mp.astype(np.float32)))
    for i in range(r):
        np.testing.assert_array_equal(x[i] >= t[i], _kept_by_sorting(x[i], k[i], p[i], mp[i]), err_msg=str(i))
    assert np.all(t[~on.any(axis=1)] == -np.inf)  # no filter: every entry, exactly


@pytest.mark.parametrize("twin", TWINS)
def test_keep_thresholds_of_degenerate_rows(twin):
    """An all -inf row keeps everything (-inf); top_k >= V and top_p = 1 filter nothing; a row
    of equal values keeps them all under any filter; min_p = 1 keeps the max and its ties."""
    x = np.array([[-np.inf] * 4, [1.0, 2.0, 3.0, 4.0], [2.0] * 4, [0.0, 5.0, -0.0, 5.0]], np.float32)
    k = np.array([1, 4, 1, 0], np.int32)
    p = np.array([0.5, 1.0, 0.1, 1.0], np.float32)
    mp = np.array([0.5, 0.0, 0.9, 1.0], np.float32)
    t = np.asarray(jax.jit(TWINS[twin])(x, k, p, mp))
    np.testing.assert_array_equal(t, [-np.inf, -np.inf, 2.0, 5.0])


def _chi_square_z(counts: np.ndarray, want: np.ndarray) -> float:
    """Pearson's chi-square of `counts` against the distribution `want`, as a standard normal
    z-score (Wilson-Hilferty: (X/df)^(1/3) is near normal). Categories expected fewer than 5
    times are pooled into one, as the test requires."""
    n = counts.sum()
    big = want * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(want[big] * n, want[~big].sum() * n)
    obs, exp = obs[exp > 0], exp[exp > 0]
    x2, df = float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
    return (((x2 / df) ** (1 / 3)) - (1 - 2 / (9 * df))) / np.sqrt(2 / (9 * df))


FILTERS = {
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "combined": dict(top_k=12, top_p=0.9, min_p=0.02),
}


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("case", FILTERS)
def test_filtered_draws_follow_the_filtered_softmax(twin, case):
    """4,000 seeded draws of one row at temperature 0.8: no token outside the sort's kept set,
    and the frequencies pass a chi-square test against softmax(logits / T) renormalised over
    that set (z below 3.5: p above 2e-4)."""
    n, temp = 4000, 0.8
    logits = _logits(1, seed=11)
    params = SamplingParams(temperature=temp, **FILTERS[case])
    toks = _tokens(jnp.broadcast_to(logits, (n, V)), [params] * n, range(n), [0] * n, twin)
    scaled = np.asarray(logits[0]) / temp
    keep = _kept_by_sorting(scaled, params.top_k, params.top_p, params.min_p)
    assert 2 < keep.sum() < V  # the filter matters here
    assert keep[np.unique(toks)].all()
    want = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    assert _chi_square_z(np.bincount(toks, minlength=V), want / want.sum()) < 3.5


@pytest.mark.parametrize("twin", TWINS)
def test_a_plain_row_draws_the_same_token_beside_filtering_rows_or_alone(twin):
    plain = SamplingParams(temperature=0.8)
    filtering = [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(top_p=0.5),
        SamplingParams(min_p=0.2),
    ]
    logits = _logits(4)
    for step in range(20):
        for other in filtering:
            mixed = _tokens(logits, [plain, other, plain, other], [7, 8, 9, 10], [step] * 4, twin)
            alone = _tokens(logits, [plain, plain, plain, plain], [7, 8, 9, 10], [step] * 4, twin)
            assert mixed[0] == alone[0] and mixed[2] == alone[2], (step, other)


@pytest.mark.parametrize("twin", TWINS)
def test_plain_temperature_draws_follow_the_softmax(twin):
    """4,000 seeded draws of one row against softmax(logits / T): total variation below 0.04
    (the expected sampling error at 4,000 draws over 64 tokens is about 0.03 at most)."""
    n, t = 4000, 0.7
    logits = jnp.broadcast_to(_logits(1, seed=3), (n, V))
    toks = _tokens(logits, [SamplingParams(temperature=t)] * n, range(n), [0] * n, twin)
    freq = np.bincount(toks, minlength=V) / n
    want = np.asarray(jax.nn.softmax(logits[0] / t))
    assert 0.5 * np.abs(freq - want).sum() < 0.04


@pytest.mark.parametrize("v", [1, 2, 7, 511, 512, 513, 5003, 49152])
def test_the_draw_twins_agree_and_invert_the_cdf(v):
    """The C++ draw and its jnp twin pick the same token from the same uniform: the first entry
    whose running probability (in float64 here) passes u x total, masked entries never, at
    vocabulary sizes around the kernel's 512-entry blocks."""
    rng = np.random.default_rng(v)
    rows = 64
    x = rng.normal(0, 3.0, (rows, v)).astype(np.float32)
    x[rng.random((rows, v)) < 0.3] = -np.inf  # filtered entries
    x[:, 0] = np.maximum(x[:, 0], 0.0)  # every row keeps an entry
    u = rng.random(rows).astype(np.float32)
    u[:3] = [0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5]
    got = {name: np.asarray(jax.jit(f)(jnp.asarray(x), jnp.asarray(u))) for name, f in DRAWS.items()}
    p = np.where(np.isinf(x), 0.0, np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True)))
    c = np.cumsum(p, axis=1)
    want = np.minimum((c <= u[:, None].astype(np.float64) * c[:, -1:]).sum(axis=1), v - 1)
    for name, toks in got.items():
        assert np.isfinite(x[np.arange(rows), toks]).all(), name  # never a masked entry
        # Equal to the float64 inverse CDF but where the target sits within rounding of a boundary.
        near = np.abs(c[np.arange(rows), np.minimum(want, v - 1)] - u * c[:, -1]) < 1e-5 * c[:, -1]
        assert ((toks == want) | near).all(), (name, np.flatnonzero(toks != want))
    assert (got["cpp"] == got["jnp"]).mean() >= 0.98


def test_draws_of_degenerate_rows():
    """An all -inf row draws 0, a row with NaN V - 1 (as argmax), a +inf entry is certain, and
    u at the top of [0, 1) takes the last entry of non-zero probability."""
    x = np.full((4, 6), -np.inf, np.float32)
    x[1, 2] = np.nan
    x[2, [1, 4]] = [0.0, np.inf]
    x[3, [0, 3]] = [0.0, 0.0]
    u = np.array([0.5, 0.5, 0.5, np.nextafter(np.float32(1), np.float32(0))], np.float32)
    for name, f in DRAWS.items():
        assert np.asarray(jax.jit(f)(jnp.asarray(x), jnp.asarray(u))).tolist() == [0, 5, 4, 3], name

"""vLLM's `logprobs_mode` and the kept set (`return_kept_set`) in the sampler, against a numpy
reference written from the definitions: the processed logits are the logits after the
structured-output mask, divided by the temperature, with the entries the top-k / top-p / min-p
filters drop at -inf (a greedy row's: its masked logits); processed log-probs their log-softmax;
the kept set their finite entries (a greedy row's: its argmax). Rows of every mode, greedy and
sampled, constrained and not, share one batch; both sampler twins (C++ kernels, jnp)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hotswap.engine.sampling import SamplingParams
from hotswap.errors import RequestError
from hotswap.kernels import cpu_sampling, reference
from hotswap.programs.sampler import SamplingArrays, mask_words, sample, unpack_mask

V = 300
TWINS = {
    "cpp": dict(
        row_stats=cpu_sampling.argmax_logsumexp,
        keep_thresholds=cpu_sampling.keep_thresholds,
        categorical=cpu_sampling.categorical,
    ),
    "jnp": dict(
        row_stats=reference.argmax_logsumexp,
        keep_thresholds=reference.keep_thresholds,
        categorical=reference.categorical,
    ),
}
SAMPLE = {name: jax.jit(partial(sample, **kw)) for name, kw in TWINS.items()}

# One batch: (SamplingParams, constrained). Every mode, filters alone and together, greedy rows.
ROWS = [
    (SamplingParams(temperature=0.0, logprobs=5), False),
    (SamplingParams(temperature=0.7, top_k=20, logprobs=20, logprobs_mode="processed_logprobs"), False),
    (SamplingParams(temperature=1.3, top_p=0.8, logprobs=20, logprobs_mode="processed_logprobs"), False),
    (SamplingParams(temperature=1.0, min_p=0.1, logprobs=3, logprobs_mode="processed_logprobs"), False),
    (
        SamplingParams(
            temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, logprobs=20, logprobs_mode="processed_logits"
        ),
        False,
    ),
    (SamplingParams(temperature=0.0, logprobs=20, logprobs_mode="processed_logprobs"), True),
    (SamplingParams(temperature=0.8, top_k=30, logprobs=20, logprobs_mode="raw_logprobs"), False),
    (SamplingParams(temperature=1.1, logprobs=20, logprobs_mode="raw_logits"), False),
    (SamplingParams(temperature=0.6, top_p=0.95, logprobs=20, logprobs_mode="processed_logprobs"), True),
    (SamplingParams(temperature=1.0, logprobs=20, logprobs_mode="processed_logits"), False),
]


def _batch(seed: int, rows=ROWS, kept: str | None = "ids"):
    """Random logits [R, V], the rows' SamplingArrays (constrained rows allow a random half of
    the vocabulary), and the allowed tokens [R, V] bool."""
    rng = np.random.default_rng(seed)
    r = len(rows)
    x = rng.normal(0, 2.5, (r, V)).astype(np.float32)
    allowed = np.ones((r, V), bool)
    params = []
    for i, (sp, constrained) in enumerate(rows):
        params.append(dataclasses.replace(sp, return_kept_set=kept))
        if constrained:
            allowed[i] = rng.random(V) < 0.5
    sa = SamplingArrays.from_rows([(sp, 1000 + i, 3) for i, sp in enumerate(params)], r, V)
    words = np.zeros((r, mask_words(V) * 32), bool)
    words[:, :V] = allowed
    mask = np.packbits(words.reshape(r, -1, 32), axis=-1, bitorder="little").view("<i4").reshape(r, -1)
    constrained = np.array([c for _, c in rows])
    return x, dataclasses.replace(sa, mask=mask, constrained=constrained), allowed


def _reference(x: np.ndarray, sp: SamplingParams, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One row's processed logits (float64, dropped entries -inf) and its kept set, from the
    definitions (vLLM's filters, each on the full scaled distribution, kept together)."""
    masked = np.where(allowed, x.astype(np.float64), -np.inf)
    if sp.temperature == 0:
        return masked, None  # greedy: its kept set is the drawn token
    scaled = masked / sp.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    keep = np.isfinite(scaled)
    order = np.sort(scaled[keep])[::-1]
    if sp.top_k > 0 and sp.top_k < keep.sum():
        keep &= scaled >= order[sp.top_k - 1]
    if sp.top_p < 1:
        p_desc = np.sort(probs)[::-1]
        n = max(int(np.sum(np.cumsum(p_desc) - p_desc < sp.top_p)), 1)
        keep &= scaled >= order[n - 1]
    if sp.min_p > 0:
        keep &= probs >= sp.min_p * probs.max()
    return np.where(keep, scaled, -np.inf), keep


def _log_softmax(z: np.ndarray) -> np.ndarray:
    m = z[np.isfinite(z)].max()
    return z - (m + np.log(np.sum(np.exp(z - m))))


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_mode_reports_the_distribution_it_names(twin, seed):
    x, sa, allowed = _batch(seed)
    out = jax.device_get(SAMPLE[twin](jnp.asarray(x), sa))
    for i, (sp, _) in enumerate(ROWS):
        mode = sp.logprobs_mode or "raw_logprobs"
        proc, keep = _reference(x[i], sp, allowed[i])
        tok = int(out.tokens[i])
        if keep is None:
            assert tok == int(np.argmax(np.where(allowed[i], x[i], -np.inf))), i
            keep = np.arange(V) == tok
        assert keep[tok], i
        want = {
            "raw_logprobs": _log_softmax(x[i].astype(np.float64)),
            "raw_logits": x[i].astype(np.float64),
            "processed_logprobs": _log_softmax(proc),
            "processed_logits": proc,
        }[mode]
        np.testing.assert_allclose(out.logprobs[i], want[tok], rtol=1e-5, atol=1e-5, err_msg=f"row {i}")
        # The top entries are the named distribution's: its largest values, largest first.
        k = sp.logprobs
        top_ids, top_lps = out.top_ids[i, :k], out.top_lps[i, :k]
        np.testing.assert_allclose(top_lps, np.sort(want)[::-1][:k], rtol=1e-5, atol=1e-5, err_msg=f"row {i}")
        finite = np.isfinite(top_lps)
        np.testing.assert_allclose(want[top_ids[finite]], top_lps[finite], rtol=1e-5, atol=1e-5)
        # The kept set: its size, and the packed bitmask the set.
        assert out.kept[i] == keep.sum(), i
        np.testing.assert_array_equal(unpack_mask(out.kept_mask[i])[:V], keep, err_msg=f"row {i}")
        assert not unpack_mask(out.kept_mask[i])[V:].any()


@pytest.mark.parametrize("twin", TWINS)
def test_asking_for_processed_log_probs_or_the_kept_set_never_changes_a_token(twin):
    """The processed path draws from the logits it reports; a row's token is the one the plain
    path (no row asking) draws for the same seed and step."""
    for seed in range(4):
        x, sa, _ = _batch(seed)
        plain = dataclasses.replace(sa, mode=np.zeros_like(sa.mode), want_kept=np.zeros_like(sa.want_kept))
        asked = SAMPLE[twin](jnp.asarray(x), sa)
        base = SAMPLE[twin](jnp.asarray(x), plain)
        np.testing.assert_array_equal(asked.tokens, base.tokens)
        assert not np.asarray(base.kept).any() and not np.asarray(base.kept_mask).any()


@pytest.mark.parametrize("twin", TWINS)
def test_every_drawn_token_is_in_the_kept_set(twin):
    """Many seeded draws per filtering row (one row per seed): each token lies in the row's
    kept set, the set equals the reference's, and the draws reach beyond a single token."""
    rows = [r for r in ROWS if r[0].temperature > 0]
    x, _, allowed = _batch(7, rows)
    n = 64
    for i, (sp, constrained) in enumerate(rows):
        _, keep = _reference(x[i], sp, allowed[i])
        reps = [(sp, constrained)] * n
        _, sa, _ = _batch(7, reps)
        sa = dataclasses.replace(
            sa,
            seed=np.arange(n, dtype=np.uint32),
            mask=np.broadcast_to(_batch(7, rows)[1].mask[i], sa.mask.shape).copy(),
        )
        drawn = set()
        for step in range(4):
            out = SAMPLE[twin](
                jnp.asarray(np.broadcast_to(x[i], (n, V))), dataclasses.replace(sa, step=sa.step + step)
            )
            tokens = np.asarray(out.tokens)
            assert keep[tokens].all(), (i, tokens[~keep[tokens]])
            np.testing.assert_array_equal(unpack_mask(np.asarray(out.kept_mask)[0])[:V], keep)
            drawn |= set(tokens.tolist())
        assert len(drawn) > 1, i


def test_a_row_that_asks_nothing_gets_no_kept_set():
    rows = [(SamplingParams(temperature=0.8, top_k=5, logprobs_mode="processed_logprobs"), False)] * 2
    x, sa, _ = _batch(3, rows, kept=None)
    sa = dataclasses.replace(sa, want_kept=np.array([True, False]))
    out = jax.device_get(SAMPLE["jnp"](jnp.asarray(x), sa))
    assert out.kept[0] == 5 and out.kept[1] == 0 and not out.kept_mask[1].any()


def test_bad_values_are_typed_errors():
    with pytest.raises(RequestError, match="raw_logprobs, raw_logits, processed_logprobs, processed_logits"):
        SamplingParams(logprobs_mode="processed")
    with pytest.raises(RequestError, match="count, ids, mask"):
        SamplingParams(return_kept_set="all")
    assert SamplingParams(return_kept_set=True).return_kept_set == "count"
    assert SamplingParams(return_kept_set=False).return_kept_set is None

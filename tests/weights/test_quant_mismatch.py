"""`hotswap bench --quantization` (benchmarks/quant_mismatch.py) on the tiny seeded model: the
figures of an int8 rollout against its full-precision policy, none for a policy against itself,
the full-vocabulary KL against one computed from `LLM.score` token by token, and the flag."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
from helpers import KNOBS

from benchmarks import bench, quant_mismatch
from benchmarks.quant_mismatch import Sample
from hotswap import LLM

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
N, TOKENS = 2, 8


@pytest.fixture(scope="module")
def engines(tiny_dir):
    """The policy, a second engine of the same weights, and an int8 engine of them."""
    opts = {**KNOBS, "warmup": False}
    return LLM(tiny_dir, **opts), LLM(tiny_dir, **opts), LLM(tiny_dir, **opts, quantization="int8")


def test_an_int8_rollout_differs_from_its_policy_by_finite_figures(engines):
    policy, _, int8 = engines
    got = quant_mismatch.mismatch(int8, policy, PROMPTS, N, TOKENS, seed=0)
    assert got["samples"] == len(PROMPTS) * N and 0 < got["tokens"] <= got["samples"] * TOKENS
    assert all(math.isfinite(v) for v in got.values())
    assert 0 <= got["kl_full_mean"] <= got["kl_full_max"]
    assert 0 < got["logp_diff_abs_mean"] <= got["logp_diff_abs_max"]  # int8 rounding moves every logit
    assert got["kl_k3"] >= 0  # ratio - 1 - log ratio >= 0 token by token
    # The sampler's log-probs are of the same distribution up to int8 rounding of x: the scoring
    # forward's 16+ rows take the kernel's VNNI path (x quantized per row), a 2-row decode step
    # the exact one. A token scored at the wrong position would be off by nats.
    assert got["sampler_vs_rollout_abs_max"] < 0.05
    assert got["score_vs_forward_abs_max"] < 1e-5


def test_a_policy_against_itself_has_no_mismatch(engines):
    policy, again, _ = engines
    got = quant_mismatch.mismatch(again, policy, PROMPTS, N, TOKENS, seed=0)
    for key in ("logp_diff_mean", "logp_diff_abs_mean", "logp_diff_abs_max", "kl_full_mean", "kl_full_max"):
        assert got[key] == 0.0, key
    assert got["kl_k1"] == got["kl_k3"] == 0.0
    # f32: a decode step's log-probs are the cache-free forward's up to the order of f32 sums
    assert got["sampler_vs_rollout_abs_max"] < 1e-5 and got["sampler_logp_diff_abs_max"] < 1e-5
    assert all(got[f"ratio_above_{c:g}"] == got[f"ratio_below_1/{c:g}"] == 0.0 for c in quant_mismatch.CAPS)


def test_the_full_kl_is_that_of_the_distributions_llm_score_gives_token_by_token(engines):
    """At one position, every vocabulary token scored by each engine (`LLM.score`, the public
    path a trainer uses): their KL in float64 is the benchmark's per-position KL there."""
    policy, _, int8 = engines
    s = Sample([1, 2, 3, 4, 5], [9, 17, 3], np.zeros(3, np.float32))
    got = quant_mismatch.compare(int8, policy, [s])
    assert {k: v.shape for k, v in got.items()} == {"kl": (3,), "r": (3,), "p": (3,)}
    prefix = s.prompt + s.tokens[:1]  # the position that drew tokens[1]
    pairs = [(prefix, [v]) for v in range(policy.config.vocab_size)]
    lr, lp = (np.concatenate(e.score(pairs)).astype(np.float64) for e in (int8, policy))
    assert np.exp(lr).sum() == pytest.approx(1.0, abs=1e-5)
    assert got["r"][1] == pytest.approx(lr[s.tokens[1]], abs=1e-5)
    assert got["p"][1] == pytest.approx(lp[s.tokens[1]], abs=1e-5)
    # KL(r || p) = log E_r[exp(d)] - E_r[d], d = log p - log r (as sum p = 1), in float64: the
    # form unmoved by the f32 rounding of each score's normalizer (a shift of all V entries)
    r, d = np.exp(lr) / np.exp(lr).sum(), lp - lr
    want = np.log(np.sum(r * np.exp(d))) - np.sum(r * d)
    assert got["kl"][1] == pytest.approx(want, rel=1e-2)
    assert got["kl"][1] > 0


def test_bench_quantization_with_no_value_runs_the_mismatch_and_with_one_is_the_engine_option():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["--quantization"]).quantization is bench.MISMATCH
    assert parser.parse_args(["--quantization", "int8"]).quantization == "int8"
    assert not hasattr(parser.parse_args([]), "quantization")  # engine flags: absent unless given
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])


def test_bench_quantization_runs_every_row_with_the_other_engine_flags(monkeypatch, tmp_path):
    """The dispatch, with the 30-minute SmolLM2 run replaced by a recorder: every scheme, the
    engine flags given beside it (not the flag itself), the result in bench.json."""
    calls = []
    monkeypatch.setattr(quant_mismatch, "run", lambda schemes, engine: calls.append((schemes, engine)) or {})
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--quantization", "--attention", "reference", "--out", str(tmp_path)])
    assert bench.run(args) == 0
    assert calls == [(list(quant_mismatch.SCHEMES), {"attention": "reference"})]
    assert json.loads((tmp_path / "bench.json").read_text())["quantization_mismatch"] == {}

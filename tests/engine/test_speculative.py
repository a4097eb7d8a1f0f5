"""Speculative decoding (speculative_config) on the tiny seeded checkpoints: the tokens are those
of decoding without it, in every case a batch meets; the sampled distribution is the target's
(a chi-square test, which fails when the acceptance rule is broken on purpose); a weight update
mid-run never lets a token through unchecked by the weights that serve it.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from scipy import stats

from hotswap import LLM, SamplingParams
from hotswap.engine import scheduler
from hotswap.errors import ConfigError

KNOBS = dict(
    max_model_len=512,
    max_num_seqs=64,
    max_num_batched_tokens=64,  # prompts past 64 tokens are prefilled in chunks
    num_pages=512,
    max_waiting=20_000,  # the distribution test queues every draw at once (as n samples)
    warmup=False,
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _prompts() -> list[list[int]]:
    """Rows that draft much (repeated runs), rows that never find a match, a chunked one."""
    rng = np.random.default_rng(0)
    loop = [17, 40, 99, 5, 230]
    return [
        loop * 4,
        [7, 8, 9, 10, 7, 8, 9, 10, 7],
        rng.choice(np.arange(4, 512), 12, replace=False).tolist(),  # no repeats: nothing to look up
        (loop * 30)[:150],  # three chunks of 64
        rng.integers(4, 512, 90).tolist(),
    ]


@pytest.fixture(scope="module")
def pair(tiny_dir):
    """(plain, speculating): two engines on the same weights."""
    return LLM(tiny_dir, **KNOBS), LLM(tiny_dir, speculative_config=NGRAM, **KNOBS)


def _run(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_config_is_checked_once_with_clear_errors():
    from hotswap.speculative import SpeculativeConfig

    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert SpeculativeConfig.parse({}) is None
    bad = [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be in \[1, 15\]"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "got 99"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "<=",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tokens": 2}, "unknown key"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "must be >= 1"),
        ("{not json", "not a JSON object"),
    ]
    for value, match in bad:
        with pytest.raises(ConfigError, match=match):
            SpeculativeConfig.parse(value)


def test_tokens_equal_decoding_without_speculation(pair, tiny_dir, tiny_dir_b):
    """Greedy and seeded sampling; chunked prefill; prefix hits (the same prompts again); a
    batch where some rows speculate and some do not; after a weight update."""
    plain, spec = pair
    prompts = _prompts()
    cases = [
        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=48, temperature=0.9, top_p=0.9, top_k=40, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=48, temperature=1.0, logprobs=3, seed=5, ignore_eos=True),
    ]
    before = dict(spec.engine.stats)
    for round_ in range(2):  # round 2: every prompt's full pages are prefix hits
        if round_ == 1:
            assert spec.engine.stats["cached_tokens"] > before["cached_tokens"]
        for params in cases:
            want, got = _run(plain, prompts, params), _run(spec, prompts, params)
            for w, g in zip(want, got, strict=True):
                assert g.token_ids == w.token_ids
                assert g.weights_versions == w.weights_versions
                np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
                if params.logprobs:
                    assert [sorted(t) for t in g.top_logprobs] == [sorted(t) for t in w.top_logprobs]
    drafted = spec.engine.stats["spec_draft_tokens"] - before["spec_draft_tokens"]
    took = spec.engine.stats["steps"] - before["steps"]
    assert drafted > 0 and spec.engine.stats["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    for g in got:  # per sample, as `usage` reports it
        assert g.num_accepted_tokens <= g.num_draft_tokens <= g.num_drafts * NGRAM["num_speculative_tokens"]
        if g.num_drafts:
            assert 1 <= g.mean_acceptance_length <= 1 + NGRAM["num_speculative_tokens"]
    spec.engine.check_invariants()
    assert took > 0

    for llm in pair:  # after an update: version 2, the cache emptied, the same tokens again
        llm.update_weights(str(tiny_dir_b))
    want, got = _run(plain, prompts, cases[1]), _run(spec, prompts, cases[1])
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert {v for g in got for v in g.weights_versions} == {plain.engine.weights_version}
    for llm in pair:
        llm.update_weights(str(tiny_dir))
    spec.engine.check_invariants()
    usage = spec.engine.state.pool.usage(spec.engine.state.prefix)
    assert usage["owned"] == 0, usage  # every page a rejected draft held went back


def test_fewer_steps_on_repetitive_text(pair):
    """What speculation is for: a looping prompt decodes in far fewer steps."""
    plain, spec = pair
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    steps = []
    for llm in pair:
        before = llm.engine.stats["steps"]
        _run(llm, [[17, 40, 99, 5, 230] * 6], params)
        steps.append(llm.engine.stats["steps"] - before)
    print(f"\nsteps for 64 tokens: {steps[0]} plain, {steps[1]} with ngram")
    assert steps[1] < steps[0]


SELF = {"method": "draft_model", "model": "self", "draft_layers": 1, "num_speculative_tokens": 3}


def test_self_draft_tokens_equal_decoding_and_swap_with_the_policy(pair, tiny_dir, tiny_dir_b):
    """The model's first layer and its head draft (self-speculation): the same tokens as
    decoding without it, before and after an update, which swaps the draft with the policy
    (it is the policy's own layers: nothing else to update), and after a sleep and a wake-up."""
    plain = pair[0]
    spec = LLM(tiny_dir, speculative_config=SELF, **KNOBS)
    prompts = _prompts()
    cases = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.9, top_k=40, seed=4, ignore_eos=True),
    ]
    for weights in (tiny_dir_b, tiny_dir):
        for params in cases:
            want, got = _run(plain, prompts, params), _run(spec, prompts, params)
            assert [g.token_ids for g in got] == [w.token_ids for w in want]
            for w, g in zip(want, got, strict=True):
                np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
        for llm in (plain, spec):
            llm.update_weights(str(weights))
    spec.sleep(1)  # the draft's params and KV are the model's: asleep and awake with them
    spec.wakeup()
    want, got = _run(plain, prompts, cases[0]), _run(spec, prompts, cases[0])
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = spec.engine.stats
    assert stats["spec_drafts"] > 0 and 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    spec.engine.check_invariants()


def test_deterministic_mode_covers_speculation(tiny_dir):
    """Deterministic mode's kernels give a position the same bits in a verification chunk as in a
    decode step: speculating or not, the log-probs are bitwise equal."""
    knobs = {**KNOBS, "deterministic": True}
    plain = LLM(tiny_dir, **knobs)
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=9, ignore_eos=True)
    want = _run(plain, _prompts(), params)
    for config in (NGRAM, SELF):
        got = _run(LLM(tiny_dir, speculative_config=config, **knobs), _prompts(), params)
        for w, g in zip(want, got, strict=True):
            assert g.token_ids == w.token_ids and g.logprobs == w.logprobs


def test_disable_by_batch_size_drafts_only_in_small_batches(tiny_dir):
    """vLLM's `disable_by_batch_size`: no drafts while that many sequences run (a large batch is
    compute-bound), drafts again in the tail."""
    llm = LLM(tiny_dir, speculative_config={**NGRAM, "disable_by_batch_size": 2}, **KNOBS)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    loop = [17, 40, 99, 5, 230] * 4
    _run(llm, [loop, loop[1:], loop[2:]], params)
    assert llm.engine.stats["spec_drafts"] == 0
    _run(llm, [loop], params)
    assert llm.engine.stats["spec_drafts"] > 0


# ---- the distribution ---------------------------------------------------------------------

DRAWS = KNOBS["max_waiting"]
# The third token only lets the second be verified (a draft never runs past max_tokens).
PAIR_PARAMS = dict(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
BROKEN_DRAWS = 4_000  # a broken rule shows at once


FORKS = 50  # samples a request (n): they share its prompt's pages, one prefix lookup for 50 draws


def _pairs(llm, prompt, start: int, draws: int) -> collections.Counter:
    """`draws` samples' (first, second) tokens, from requests seeded start, start + 1, ... (each
    sample of a request has its own seed, derived from the request's and its index)."""
    seeds = range(start, start + draws // FORKS)
    params = [SamplingParams(seed=s, n=FORKS, **PAIR_PARAMS) for s in seeds]
    outs = llm.generate([prompt] * len(seeds), params, use_tqdm=False)
    return collections.Counter(tuple(c.token_ids[:2]) for o in outs for c in o.outputs)


def _top4(llm, ids: list[int]) -> dict[int, float]:
    """The distribution a top-k 4, T = 1 draw after `ids` is from: the 4 most likely next
    tokens' probabilities, renormalised."""
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, logprobs=4), use_tqdm=False)
    top = out[0].outputs[0].top_logprobs[0]
    p = {t: float(np.exp(lp)) for t, lp in top.items()}
    return {t: v / sum(p.values()) for t, v in p.items()}


def _expected_pairs(llm, prompt: list[int]) -> dict[tuple[int, int], float]:
    """The exact distribution of the first two sampled tokens, from the model's own log-probs."""
    return {
        (t1, t2): p1 * p2
        for t1, p1 in _top4(llm, prompt).items()
        for t2, p2 in _top4(llm, [*prompt, t1]).items()
    }


def _p_value(seen: collections.Counter, expected: dict[tuple[int, int], float]) -> float:
    """Chi-square goodness of fit of the drawn (first, second) pairs to `expected`; a pair the
    distribution cannot produce refutes it outright (p = 0)."""
    if set(seen) - set(expected):
        return 0.0
    n = sum(seen.values())
    return float(stats.chisquare([seen[k] for k in expected], [p * n for p in expected.values()]).pvalue)


@pytest.fixture(scope="module")
def lookup_prompt():
    """481 of the 512 tokens once each: whatever the first sampled token, prompt lookup (n = 1)
    nearly always finds it and drafts what followed it, so the second token is verified. 30
    full pages and one token: every draw after the first computes one prompt token."""
    return np.random.default_rng(1).permutation(np.arange(4, 4 + 30 * 16 + 1)).tolist()


def test_sampling_is_exact_and_the_test_can_fail(pair, lookup_prompt, monkeypatch):
    """>= 20k seeded draws of the first two tokens, with and without speculation: each fits the
    model's own distribution of the pair (top-k 4 at T = 1, from its log-probs; chi-square,
    p > 0.01). With the rule broken (a draft token accepted without checking it against the
    target's) the same test fails: it can see a wrong acceptance rule."""
    plain, spec = pair
    expected = _expected_pairs(plain, lookup_prompt)
    p_plain = _p_value(_pairs(plain, lookup_prompt, 0, DRAWS), expected)
    before = spec.engine.stats["spec_drafts"]
    p_spec = _p_value(_pairs(spec, lookup_prompt, DRAWS, DRAWS), expected)
    verified = spec.engine.stats["spec_drafts"] - before
    assert verified >= 0.8 * DRAWS, verified  # nearly every second token went through a verification

    monkeypatch.setattr(scheduler, "accepted", lambda draft, tokens: 1 if draft else 0)
    p_broken = _p_value(_pairs(spec, lookup_prompt, 2 * DRAWS, BROKEN_DRAWS), expected)
    print(
        f"\nchi-square p: plain {p_plain:.3g}, speculating {p_spec:.3g}, acceptance rule broken {p_broken:.3g}"
    )
    assert p_plain > 0.01 and p_spec > 0.01
    assert p_broken < 1e-6


# ---- weight updates mid-run -----------------------------------------------------------------


@pytest.mark.parametrize("policy", ["drain", "recompute", "abort", "keep"])
def test_an_update_mid_run_leaves_no_token_unchecked(pair, tiny_dir, tiny_dir_b, policy):
    """Requests speculating when an update lands: each token's log-prob is the one `LLM.score`
    gives under the weights version that produced it (speculation never lets a token through
    that the serving weights did not sample). Under `keep` the tokens after the update were
    computed over older KV: labelled so (their KV version), and scored only before it."""
    plain, spec = pair
    engine = spec.engine
    prompts = _prompts()[:3]
    params = SamplingParams(max_tokens=40, temperature=0.5, seed=2, ignore_eos=True)
    outs = {}  # every final output, the ones a drain or an abort delivers inside the update too

    def sink(out):
        if out.finished:
            outs[out.request_id] = out

    for i, p in enumerate(prompts):
        engine.add_request(f"{policy}-{i}", p, params, sink=sink)
    drafts = engine.stats["spec_drafts"]
    while engine.stats["spec_drafts"] == drafts:  # until drafts are being verified
        engine.step()
        assert engine.has_unfinished()
    v1 = engine.weights_version
    spec.update_weights(str(tiny_dir_b), policy=policy)
    while engine.has_unfinished():
        engine.step()
    weights = {v1: tiny_dir, v1 + 1: tiny_dir_b}
    scored = 0
    for i, p in enumerate(prompts):
        c = outs[f"{policy}-{i}"].outputs[0]
        for v in set(c.weights_versions):
            plain.update_weights(str(weights[v]))
            want = plain.score(p, c.token_ids)
            at = [j for j, w in enumerate(c.weights_versions) if w == v == c.kv_versions[j]]
            np.testing.assert_allclose(np.asarray(c.logprobs)[at], want[at], atol=1e-5)
            scored += len(at)
        if policy == "keep":
            assert c.mixed_weights_kv and c.weights_versions[-1] == v1 + 1 and c.kv_versions[-1] == v1
    assert scored > 0
    plain.update_weights(str(tiny_dir))
    spec.update_weights(str(tiny_dir))
    engine.check_invariants()

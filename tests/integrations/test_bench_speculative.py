"""`hotswap bench --speculative` (benchmarks/speculative.py): its per-request timing and counts,
its summary's ratios, the token check that fails the run, and the flag."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import bench, speculative
from benchmarks.speculative import Decode
from hotswap import LLM, SamplingParams


def test_configs_parse_as_k_and_lookup_span():
    assert speculative.parse_configs("2:1-3,6:2") == [(2, 1, 3), (6, 2, 2)]
    assert speculative.label((4, 2, 4)) == "k4_n2-4"
    assert speculative.ngram(4, 2, 4) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }


def test_decode_counts_every_step_after_the_first_token_and_its_verifications(tiny_dir):
    """At batch 1 with no early stop, each decode step yields its accepted draft tokens plus one:
    the counts the benchmark reports (acceptance, accepted length per verification) add up."""
    opts = {"max_model_len": 128, "max_num_seqs": 1, "max_num_batched_tokens": 64, "warmup": False}
    plain = LLM(tiny_dir, **opts)
    spec = LLM(tiny_dir, **opts, speculative_config=speculative.ngram(3, 1, 2))
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref, got = speculative.decode(plain, prompt, sp), speculative.decode(spec, prompt, sp)
    assert got.tokens == ref.tokens and len(got.tokens) == 24
    assert ref.steps == 23 and ref.verifications == ref.drafted == ref.accepted == 0
    assert got.verifications > 0  # the prompt repeats: lookup finds a draft
    assert 0 <= got.accepted <= got.drafted
    assert got.steps + got.accepted == len(got.tokens) - 1
    assert got.prefill_s > 0 and got.decode_s > 0


def _run(tokens, decode_s, drafted=0, accepted=0, steps=None, verifications=0):
    return Decode(tokens, 0.1, decode_s, steps or len(tokens) - 1, verifications, drafted, accepted)


def test_summary_ratios_are_to_plain_in_the_same_repeat_and_flag_changed_tokens():
    toks = list(range(11))  # 10 decode tokens
    runs = {
        "plain": [[_run(toks, 1.0), _run(toks, 2.0)], [_run(toks, 2.0), _run(toks, 4.0)]],
        # twice as fast as plain on each prompt of each repeat; 8 drafted, 6 accepted in 4 steps
        "k4_n1-3": [
            [_run(toks, 0.5, 8, 6, 4, 2), _run(toks, 1.0, 8, 6, 4, 2)],
            [_run(toks, 1.0, 8, 6, 4, 2), _run(toks[:-1] + [99], 2.0, 8, 6, 4, 2)],
        ],
    }
    got = speculative.summarise(runs)
    assert got["plain"]["ratio_median"] == got["plain"]["ratio_summed"] == 1.0
    row = got["k4_n1-3"]
    assert row["ratio_median"] == pytest.approx(2.0) and row["ratio_summed"] == pytest.approx(2.0)
    assert row["tok_s"] == pytest.approx(2 * got["plain"]["tok_s"])
    assert row["acceptance"] == pytest.approx(0.75)
    assert row["accepted_per_verification"] == pytest.approx(3.0)
    assert row["tokens_per_step"] == pytest.approx(2.5)
    assert row["equal_to_plain"] is False  # one output differs in its last token
    with pytest.raises(AssertionError, match="k4_n1-3"):
        speculative.check({"grounded": got, "free": got})


def test_bench_flag_runs_only_the_speculative_benchmark_and_keeps_the_config_flag():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["--speculative"]).speculative is True
    assert parser.parse_args([]).speculative is False
    given = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert given.speculative is False

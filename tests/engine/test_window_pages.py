"""The sliding-window layers' own page pool (engine/window_pages.py), end to end.

A tiny Gemma 3 (sliding, full, sliding; window 16, 8-token pages) serves the same requests
with the pool bounded by the window and with `disable_hybrid_kv_cache_manager` (every layer
keeps every page): chunked prefill of prompts 20x the window, an n=4 sampled group sharing
its prompt's pages, prefix hits past the window, an update under the `keep` policy. Tokens
and log-probs must be the same; the window layers' buffers must be smaller and the pages
their sequences hold must stay within the bound at every step, with the pool's invariants
checked after each one. HF parity through the bounded pool is tests/models/test_gemma.py's.
"""

from __future__ import annotations

import numpy as np
import pytest

from hotswap import LLM, SamplingParams
from hotswap.checkpoint.create import create_checkpoint
from hotswap.programs import kv_sizing

WINDOW, PS = 16, 8
ARGS = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=32, page_size=PS, warmup=False)
LENGTHS = (5, 40, 150, 330)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_checkpoint(
        tmp_path_factory.mktemp("window") / "gemma3",
        preset="tiny",
        arch="gemma3",
        seed=5,
        overrides={"num_hidden_layers": 3, "head_dim": 32, "sliding_window": WINDOW},
    )


@pytest.fixture(scope="module")
def engines(model_dir):
    return LLM(model_dir, **ARGS), LLM(model_dir, disable_hybrid_kv_cache_manager=True, **ARGS)


def _run(llm, requests):
    """Step `requests` ([(prompt, SamplingParams)]) to the end, checking the pool after every
    step. Returns ({request id: (token ids, logprobs)}, the most window pages held at once)."""
    engine = llm.engine
    ids = [engine.add_request(None, prompt, sp) for prompt, sp in requests]
    done, most = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(list(c.token_ids), np.asarray(c.logprobs)) for c in out.outputs]
        engine.check_invariants()
        most = max(most, engine.state.pool.usage(engine.state.prefix).get("window_held", 0))
    return [done[i] for i in ids], most


def _same(a, b):
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb
        np.testing.assert_allclose(la, lb, atol=1e-5)


def test_bounded_pool_serves_what_the_full_one_does(engines):
    bounded, full = engines
    st = bounded.engine.state
    window = st.pool.window
    assert window is not None and full.engine.state.pool.window is None
    bound = kv_sizing.window_pages(bounded.config, bounded.engine.ecfg)
    assert window.num_pages == bound < st.num_pages
    sizes = [p.shape[0] for p in st.kv.pages]  # sliding, full, sliding
    assert sizes == [bound, st.num_pages, bound]
    assert [p.shape[0] for p in full.engine.state.kv.pages] == [st.num_pages] * 3

    rng = np.random.default_rng(0)
    vocab = bounded.config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in LENGTHS]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    group = SamplingParams(n=4, max_tokens=20, temperature=1.0, seed=3, ignore_eos=True, logprobs=0)
    first = [(p, greedy) for p in prompts]
    # Each prompt again with half its continuation: prefix hits past the window, through twins
    # the first run released as it moved on. Then a sampled group sharing its prompt's pages.
    again = lambda got: [(p + out[0][0][:6], greedy) for p, out in zip(prompts, got, strict=True)]  # noqa: E731
    runs = [first, again, [(prompts[2], group)]]
    most, hits, got = 0, [], None
    for make in runs:
        cached = bounded.engine.stats["cached_tokens"]
        requests = make(got) if callable(make) else make
        got, held = _run(bounded, requests)
        hits.append(bounded.engine.stats["cached_tokens"] - cached)
        want, _ = _run(full, requests)
        for a, b in zip(got, want, strict=True):
            _same(a, b)
        most = max(most, held)
    assert 0 < most <= bound - 1
    # The longest prompt alone spans 42 pages; the window layers never held more than a window
    # and a chunk of each sequence's.
    assert most < sum(-(-n // PS) for n in LENGTHS)
    assert hits[1] >= 3 * 4 * PS  # the three longer prompts hit past their window


def test_a_hit_is_cut_back_to_where_the_window_twins_remain(engines):
    """Evict every released twin (a flood of other prompts), then ask for a cached prompt
    again: the full layers' pages are still indexed, but a hit needs the window's twins, so it
    is cut back (here to nothing usable past the window) and recomputed, with the same tokens."""
    rng = np.random.default_rng(1)
    vocab = engines[0].config.vocab_size
    prompt = rng.integers(0, vocab, 200).tolist()
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    flood = [(rng.integers(0, vocab, 60).tolist(), sp) for _ in range(12)]
    hits, outs = [], []
    for llm in engines:  # the same pool of full-layer pages, with and without the window pool
        first, _ = _run(llm, [(prompt, sp)])
        _run(llm, flood)
        cached = llm.engine.stats["cached_tokens"]
        second, _ = _run(llm, [(prompt, sp)])
        hits.append(llm.engine.stats["cached_tokens"] - cached)
        _same(first[0], second[0])
        outs.append(second[0])
    assert hits[1] == 199 // PS * PS  # the full layers' pages survived the flood...
    assert hits[0] < 200 - WINDOW  # ...but the window's twins did not: the hit is cut back
    _same(outs[0], outs[1])


def test_update_keep_policy_keeps_the_running_sequences_twins(engines):
    bounded, _ = engines
    engine = bounded.engine
    rng = np.random.default_rng(2)
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for _ in range(2):
        engine.add_request(None, rng.integers(0, bounded.config.vocab_size, 90).tolist(), sp)
    for _ in range(14):  # past the prompts, decoding
        engine.step()
    version = engine.state.weights_version
    engine.update_weights(engine.state.params, policy="keep")
    st = engine.state
    assert st.weights_version == version + 1 and st.prefix.num_cached == 0
    engine.check_invariants()
    held = st.pool.usage(st.prefix)["window_held"]
    assert 0 < held <= 2 * (-(-WINDOW // PS) + 2)  # each kept sequence's window, no more
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    st = engine.state
    assert st.pool.usage(st.prefix)["window_held"] == 0

"""The serving core against HF transformers: paging, prefix cache, chunked prefill, preemption."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import count_compiles, hf_greedy

from hotswap import LLM, SamplingParams
from hotswap.errors import PromptTooLong, RequestError

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts(n=16, seed=0):
    """Prompts of different lengths; most share a 2-page prefix (page_size 16) with each other."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(10, 500, 37).tolist()
    out = []
    for i in range(n):
        tail = rng.integers(10, 500, int(rng.integers(1, 40))).tolist()
        out.append((shared if i % 4 else shared[:5]) + tail)
    return out


@pytest.fixture(scope="module")
def prompts():
    return _prompts()


@pytest.fixture(scope="module")
def hf_ref(tiny_dir, prompts):
    return hf_greedy(tiny_dir, prompts, MAX_NEW)


CONFIGS = {
    "prefix-on-ps16": dict(page_size=16),
    "prefix-off-ps16": dict(page_size=16, enable_prefix_caching=False),
    "prefix-on-ps4": dict(page_size=4),
    "prefix-off-ps4": dict(page_size=4, enable_prefix_caching=False),
    "chunked-prefill": dict(page_size=4, max_num_batched_tokens=16),
    # 40 pages of 4 tokens cannot hold 16 sequences of ~60 tokens: forces preemption.
    "preemption": dict(page_size=4, num_pages=40, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf(tiny_dir, prompts, hf_ref, name):
    kw = dict(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64, warmup=False) | CONFIGS[name]
    llm = LLM(tiny_dir, **kw)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (o, ref) in enumerate(zip(outs, hf_ref, strict=True)):
        assert o.outputs[0].token_ids == ref, f"prompt {i} differs from HF"
        assert o.outputs[0].finish_reason == "length"
        assert o.outputs[0].weights_versions == [1] * MAX_NEW
    if name == "preemption":
        assert llm.engine.sched.num_preemptions > 0
    if name == "chunked-prefill":
        assert max(len(p) for p in prompts) > 16  # prompts really were split into chunks
    llm.engine.check_invariants()
    assert not llm.engine.sched.running and not llm.engine.sched.waiting
    assert int(llm.engine.state.pool.refcount.sum()) == 0  # nothing owned: no leak
    # logprobs are the raw-distribution log-probs that score() returns
    scores = llm.score([(p, o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)])
    for o, s in zip(outs, scores, strict=True):
        np.testing.assert_allclose(o.outputs[0].logprobs, s, atol=1e-4)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, page_size=16)


def test_repeated_prompt_hits_prefix_cache(llm, prompts):
    p = prompts[1]
    first = llm.generate([p], GREEDY, use_tqdm=False)[0]
    again = llm.generate([p], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(p) - 1) // 16 * 16 > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    np.testing.assert_allclose(again.outputs[0].logprobs, first.outputs[0].logprobs, atol=1e-5)


def test_seeded_sampling_is_batch_independent(llm, prompts):
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompts[3]], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)] * 5
    batch = llm.generate(prompts[:5] + [prompts[3]], others + [sp], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True)
    a, b = llm.generate([prompts[3], prompts[3]], unseeded, use_tqdm=False)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids  # independent draws


def test_n_samples_share_prompt_pages(llm, prompts):
    sp = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    out = llm.generate([prompts[2]], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:  # each sample's logprobs are the model's, under its own prefix
        np.testing.assert_allclose(c.logprobs, llm.score(prompts[2], c.token_ids), atol=1e-4)
    llm.engine.check_invariants()


def test_sampling_filters(llm, prompts):
    top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True, seed=3)
    greedy = llm.generate([prompts[4]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate([prompts[4]], top1, use_tqdm=False)[0].outputs[0].token_ids == greedy[:8]
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, ignore_eos=True, seed=3)
    assert llm.generate([prompts[4]], tiny_p, use_tqdm=False)[0].outputs[0].token_ids == greedy[:8]
    minp = SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8, ignore_eos=True, seed=3)
    assert llm.generate([prompts[4]], minp, use_tqdm=False)[0].outputs[0].token_ids == greedy[:8]


def test_stop_conditions(llm, prompts):
    greedy = llm.generate([prompts[5]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[greedy[3]], ignore_eos=True
    )
    out = llm.generate([prompts[5]], stop_tok, use_tqdm=False)[0].outputs[0]
    first = greedy.index(greedy[3])
    assert (
        out.token_ids == greedy[: first + 1] and out.finish_reason == "stop" and out.stop_reason == greedy[3]
    )
    text = llm.tokenizer.decode(greedy)
    stop_str = text[len(text) // 2 : len(text) // 2 + 2]
    out = llm.generate(
        [prompts[5]],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=[stop_str], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and stop_str not in out.text and text.startswith(out.text)
    # EOS ends generation unless ignore_eos
    eos = llm.engine.eos_ids[0]
    assert eos in llm.engine.eos_ids


def test_streamed_deltas_add_up_to_the_text(llm, prompts):
    """Each streamed output's text_delta is the new text; together they are the final text."""
    text = llm.generate([prompts[5]], GREEDY, use_tqdm=False)[0].outputs[0].text
    assert len(text) > 6
    stop = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=[text[4:6]], ignore_eos=True)
    for sp in (GREEDY, stop):
        want = llm.generate([prompts[5]], sp, use_tqdm=False)[0].outputs[0].text
        outs = []
        llm.engine.add_request(None, prompts[5], sp, sink=outs.append, stream=True)
        while llm.engine.has_unfinished():
            llm.engine.step()
        assert outs[-1].finished and outs[-1].outputs[0].text == want
        assert "".join(o.outputs[0].text_delta for o in outs) == want
    assert text[4:6] not in want and text.startswith(want)


def test_text_prompts_and_errors(llm):
    out = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt == "Hello world" and out.prompt_token_ids == llm.tokenizer.encode("Hello world")
    with pytest.raises(PromptTooLong, match="max_model_len is 128"):
        llm.generate([[5] * 128], GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([[10**6]], GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert not llm.engine.requests  # refused requests left nothing behind


def test_abort_frees_pages(llm, prompts):
    eng = llm.engine
    rids = [
        eng.add_request(None, p, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        for p in prompts[:6]
    ]
    for _ in range(3):
        eng.step()
    assert eng.num_running() > 0
    for r in rids:
        eng.abort(r)
    assert eng.num_running() == 0 and not eng.requests
    eng.check_invariants()
    assert int(eng.state.pool.refcount.sum()) == 0


def test_no_recompilation_after_warmup(llm):
    rng = np.random.default_rng(5)
    batches = [
        [rng.integers(10, 500, int(n)).tolist() for n in rng.integers(1, 100, size=k)] for k in (1, 3, 8, 5)
    ]
    with count_compiles() as compiles:
        for b in batches:
            llm.generate(
                b,
                SamplingParams(temperature=0.7, max_tokens=int(rng.integers(2, 20)), seed=1),
                use_tqdm=False,
            )
    assert compiles() == 0


def test_a_step_that_fails_after_donating_the_cache_loses_no_request(tiny_dir, prompts, hf_ref, monkeypatch):
    """The C++ attention writes into its donated page buffers, so a step that fails on the
    device leaves the cache unusable. The engine rebuilds it, recomputes every running
    sequence and serves on: every request still finishes with HF's greedy tokens."""
    from hotswap.engine import runner

    llm = LLM(tiny_dir, page_size=16, max_num_seqs=8)
    assert llm.engine.ecfg.attention == "cpu"  # the default on this backend
    eng = llm.engine
    rids = [eng.add_request(None, p, GREEDY) for p in prompts[:6]]
    for _ in range(3):
        eng.step()
    real = runner.run_step
    given = []

    def fails_after_donating(params, pages, batch, sa, **kw):
        given.append(pages)
        real(params, pages, batch, sa, **kw)  # the old pages are donated, and now gone
        raise RuntimeError("injected device failure")

    monkeypatch.setattr(runner, "run_step", fails_after_donating)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    monkeypatch.setattr(runner, "run_step", real)
    assert given and given[0][0].is_deleted()  # the failed step had consumed the cache
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert set(done) == set(rids)
    for i, r in enumerate(rids):
        assert done[r] == hf_ref[i], f"request {i} after recovery"
    eng.check_invariants()


def test_fill_pads_or_defers_whichever_costs_fewer_tokens():
    from hotswap.engine_config import EngineConfig
    from hotswap.kernels.backend import Backend
    from hotswap.programs.step import Buckets

    ecfg = EngineConfig(max_model_len=1088, max_num_seqs=32, max_num_batched_tokens=512, page_size=16)
    b = Buckets.for_config(ecfg, Backend.choose("cpu", head_dim=64))
    assert b.batch == (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512) and b.blocks == ()
    assert b.samples(512, 1) == 32 and b.samples(16, 1) == 16
    assert b.fill(300) == 256  # 44 tokens wait a step rather than 84 padded ones
    assert b.fill(350) == 350  # 34 padded rather than 94 deferred
    assert b.fill(512) == 512 and b.fill(1) == 1
    # Backends that tile a packed prefill keep their decode and prefill calls apart and pad.
    ref = Buckets.for_config(ecfg, Backend.choose("reference", head_dim=64))
    assert ref.batch == (1, 2, 4, 8, 16, 32) and ref.blocks[-1] == 32 and ref.fill(300) == 300


def test_decode_rows_and_prefill_chunks_run_in_one_call(tiny_dir, prompts, hf_ref, monkeypatch):
    """On the C++ backend a step is one [T, 1] call holding every decode token and prefill
    chunk, trimmed so its tokens land on a compiled size; the tokens still equal HF's."""
    from hotswap.engine.runner import Runner

    llm = LLM(tiny_dir, max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64, page_size=16)
    assert llm.engine.backend.ragged_steps
    calls = []
    real = Runner._call

    def spy(self, params, pages, rows, tables, kind, *rest):
        calls.append((kind, sum(n for _, n in rows), sum(n > 1 for _, n in rows), len(rows)))
        return real(self, params, pages, rows, tables, kind, *rest)

    monkeypatch.setattr(Runner, "_call", spy)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_ref
    assert {kind for kind, *_ in calls} == {"ragged"}
    assert any(chunks and chunks < rows for _, _, chunks, rows in calls)  # decode + prefill together
    buckets = llm.engine.runner.buckets.batch
    assert any(tokens in buckets and tokens > 32 for _, tokens, chunks, _ in calls if chunks)
    assert llm.engine.stats["steps"] == len(calls)  # one call per step
    llm.engine.check_invariants()


def test_a_lone_prompt_pads_its_last_chunk_rather_than_take_a_step_of_its_own(tiny_dir, monkeypatch):
    """Trimming a 37-token prompt to the 32 bucket would leave its last 5 tokens a step (and a
    program for that bucket) of their own: alone, it runs as one padded step. Beside another
    row the next step runs anyway, so the chunk is still trimmed to the bucket below."""
    from hotswap.engine.runner import Runner

    llm = LLM(tiny_dir, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64, page_size=16,
              warmup=False)  # fmt: skip
    assert {32, 48} <= set(llm.engine.runner.buckets.batch)
    calls = []
    real = Runner._call

    def spy(self, params, pages, rows, tables, kind, *rest):
        calls.append([n for _, n in rows])
        return real(self, params, pages, rows, tables, kind, *rest)

    monkeypatch.setattr(Runner, "_call", spy)
    prompt = (_prompts(1, seed=3)[0] * 8)[:37]
    two = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    alone = llm.generate([prompt], two, use_tqdm=False)[0].outputs[0].token_ids
    assert calls == [[37], [1]]
    calls.clear()
    llm.engine.reset_prefix_cache()  # "second" computes its whole prompt again
    llm.engine.add_request("first", _prompts(1, seed=4)[0][:20], two)
    llm.engine.step()  # "first"'s prompt; it decodes beside the next prompt
    llm.engine.add_request("second", prompt, two)
    got = {}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            got[out.request_id] = out
    assert calls[1] == [1, 31]  # 32 tokens: the chunk's last 6 wait for the step "first" takes anyway
    assert got["second"].outputs[0].token_ids == alone
    llm.engine.check_invariants()

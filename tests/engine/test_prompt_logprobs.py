"""`SamplingParams.prompt_logprobs` (engine/prompt_record.py, programs/prompt_logprobs.py): the
prompt tokens' log-probs, ranks and top-k, computed by the step programs, equal `LLM.score` and
the cache-free forward's full distribution: over chunked prefill, in a batch with rows that do
not ask, with the prompt in the prefix cache (recomputed), for n > 1, and on the reference
attention's packed prefill."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hotswap import LLM, SamplingParams
from hotswap.errors import RequestError
from hotswap.model.forward import forward_dense

# test_structured_outputs.py's engine knobs: its compiled steps are loaded, not compiled again.
KW = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, page_size=16)
PROMPT = list(range(20, 90))  # 70 tokens: three chunks of at most 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **KW)


def _asking(k: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=k, **kw)


def _reference(llm: LLM, ids: list[int]) -> np.ndarray:
    """log_softmax of the cache-free forward's logits [len(ids), V] (f32, full vocabulary)."""
    eng = llm.engine
    logits = forward_dense(
        eng.state.params, np.asarray([ids], np.int32), np.asarray([len(ids)], np.int32), cfg=eng.mcfg
    )[0]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def _check(llm: LLM, ids: list[int], plp, k: int) -> None:
    """vLLM's shape, the prompt tokens' log-probs equal to `score`, ranks and top-k to the full
    distribution's."""
    assert len(plp) == len(ids) and plp[0] is None
    got = np.array([plp[t][ids[t]].logprob for t in range(1, len(ids))])
    np.testing.assert_allclose(got, llm.score(ids[:1], ids[1:]), atol=1e-5)
    ref = _reference(llm, ids)
    for t in range(1, len(ids)):
        row, entry, x = ref[t - 1], plp[t], ref[t - 1][ids[t]]
        # rank: 1 + the tokens likelier than it (within f32 noise of a tie either way)
        assert 1 + (row > x + 1e-5).sum() <= entry[ids[t]].rank <= 1 + (row > x - 1e-5).sum(), t
        # the prompt's own token first, then the top k (the token once, if among them)
        assert list(entry)[0] == ids[t] and len(entry) - 1 <= k <= len(entry)
        kth = np.sort(row)[::-1][k - 1] if k else np.inf
        for i, e in entry.items():
            np.testing.assert_allclose(e.logprob, row[i], atol=1e-5)
            assert i == ids[t] or (e.logprob >= kth - 1e-5 and e.rank <= k)
            assert e.decoded_token == llm.engine.tokenizer.decode([i], skip_special_tokens=False)


def test_chunked_prompt_in_a_batch_with_rows_that_do_not_ask(llm):
    others = [PROMPT[5:40], PROMPT[:12]]
    alone = llm.generate(others, GREEDY, use_tqdm=False)
    outs = llm.generate([others[0], PROMPT, others[1]], [GREEDY, _asking(3), GREEDY], use_tqdm=False)
    _check(llm, PROMPT, outs[1].prompt_logprobs, 3)
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None
    # rows that do not ask are untouched by the one that does
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [o.outputs[0].token_ids for o in alone]
    # the generated tokens' log-probs are the sampler's as ever
    c = outs[1].outputs[0]
    np.testing.assert_allclose(c.logprobs, llm.score(PROMPT, c.token_ids), atol=1e-5)


def test_a_cached_prompt_is_recomputed_and_scores_the_same(llm):
    ids = PROMPT[10:60]  # 50 tokens: three full pages
    llm.generate([ids], GREEDY, use_tqdm=False)
    hit = llm.generate([ids], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 48  # the prompt is in the prefix cache
    out = llm.generate([ids], _asking(0), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # asked for prompt log-probs: recomputed (engine/prompt_record.py)
    _check(llm, ids, out.prompt_logprobs, 0)
    assert all(len(d) == 1 for d in out.prompt_logprobs[1:])  # k = 0: the token alone


def test_n_samples_share_one_prompt_logprobs_and_short_prompts(llm):
    ids = PROMPT[:20]
    out = llm.generate([ids], _asking(2, n=2), use_tqdm=False)[0]
    assert len(out.outputs) == 2
    _check(llm, ids, out.prompt_logprobs, 2)
    one = llm.generate([[PROMPT[0]]], _asking(2), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]  # one prompt token: nothing before it to condition on


@pytest.mark.parametrize("k", [-1, 21])
def test_prompt_logprobs_out_of_range_is_refused(k):
    with pytest.raises(RequestError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=k)


def test_reference_attention_packed_prefill(tiny_dir):
    """The reference attention's two programs (read, then write) and its [Nb, 16] packed prefill."""
    ref = LLM(tiny_dir, **KW, attention="reference", warmup=False)
    outs = ref.generate([PROMPT[:40], PROMPT], [GREEDY, _asking(1)], use_tqdm=False)
    plp = outs[1].prompt_logprobs
    got = np.array([plp[t][PROMPT[t]].logprob for t in range(1, len(PROMPT))])
    np.testing.assert_allclose(got, ref.score(PROMPT[:1], PROMPT[1:]), atol=1e-5)

"""SmolLM2-135M-Instruct's Q4_1 file served as its blocks (`quantization="gguf"`): greedy chats
equal to the same file dequantized to f32, and the blocks held once (the tied head is the
embedding's Q8_0 blocks)."""

from __future__ import annotations

import numpy as np
import pytest

from hotswap import LLM, SamplingParams

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}],
]
ENGINE = dict(dtype="float32", max_model_len=512, num_pages=160, max_num_seqs=4, warmup=False)


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    return LLM(smollm2_gguf, quantization="gguf", **ENGINE), LLM(smollm2_gguf, **ENGINE)


def test_four_chats_greedy_equal_the_dequantized_model(served):
    blocks, dense = served
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    got = [o.outputs[0].token_ids for o in blocks.chat(CHATS, sp, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in dense.chat(CHATS, sp, use_tqdm=False)]
    for g, w, chat in zip(got, want, CHATS, strict=True):
        if g == w:
            continue
        # Where they part, the dequantized model's two candidates must be a tie within 1e-3.
        at = next(i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b)
        prompt = dense.tokenizer.apply_chat_template(chat, tokenize=True)
        lp = [float(dense.score(prompt + w[:at], [t])[0]) for t in (g[at], w[at])]
        assert abs(lp[0] - lp[1]) < 1e-3, (chat, at, lp)
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= 3


def test_blocks_are_held_once_and_smaller_than_the_file(served, smollm2_gguf):
    blocks, dense = served
    params = blocks.params
    assert params["lm_head"].data is params["embed"].data and params["embed"].fmt == "q8_0"
    assert {params["layers"][0][k].fmt for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")} == {
        "q4_1"
    }
    served_bytes = sum(x.nbytes for x in {id(a): a for a in _arrays(params)}.values())
    file_bytes = smollm2_gguf.stat().st_size
    assert served_bytes <= file_bytes
    dense_bytes = sum(np.asarray(x).nbytes for x in _arrays(dense.params))
    assert dense_bytes > 4 * served_bytes  # f32 holds 4-8x the file


def _arrays(tree):
    import jax

    return jax.tree.leaves(tree)

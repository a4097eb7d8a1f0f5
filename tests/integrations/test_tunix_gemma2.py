"""hotswap serving a Tunix Gemma 2 (`tunix.models.gemma`): against Tunix's own vanilla rollout,
Tunix's `compute_per_token_logps` on trained weights, and a bad state.

The model (`tunix_worker.gemma2_model`): 4 layers alternating sliding (window 4, shorter than
every prompt) and global, GQA, attention and final softcaps of 2 and 3, f32.

Tunix's Gemma 2 sliding mask compares a key's cache slot with the query's position, so a row
left-padded by p tokens slides over window + p keys: its output depends on its padding. hotswap
slides over `window` positions, as HF's Gemma 2 and an unpadded Tunix row do. The comparisons
below therefore give Tunix unpadded rows, and the log-probs test checks a padded row against
Tunix on the same row unpadded.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_tunix_logps import _logps, _train
from tunix.generate import tokenizer_adapter
from tunix.rl.rollout import base_rollout, vanilla_rollout
from tunix_worker import gemma2_model, padded_completions, tokenizer

from hotswap import LLM, SamplingParams
from hotswap.errors import WeightsMismatch
from hotswap.integrations.tunix import HotswapRollout

# 11 tokens each under the test tokenizer: no left padding at max_prompt_length=11.
PROMPTS = ["hello world, how are", "input string of text", "the cat sat on the mat", "hello world, how are"]


@pytest.fixture(scope="module")
def adapter():
    return tokenizer_adapter.TokenizerAdapter(tokenizer())


def test_greedy_tokens_and_logps_match_vanilla_rollout(adapter):
    m = gemma2_model(0)
    assert {len(adapter.encode(p)) for p in PROMPTS} == {11}
    rc = base_rollout.RolloutConfig(
        max_tokens_to_generate=8, max_prompt_length=11, kv_cache_size=64, top_p=None, temperature=0.0
    )
    cache = base_rollout.CacheConfig(cache_size=64, num_layers=4, num_kv_heads=2, head_dim=8)
    van = vanilla_rollout.VanillaRollout(m, adapter, cache)
    hs = HotswapRollout(rollout_actor=m, tokenizer=adapter, rollout_config=rc)
    cfg = hs.llm.config
    assert cfg.arch == "gemma2" and cfg.sliding_window == 4 and not cfg.qk_norm
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.rope_theta) == (2.0, 3.0, 1e4)
    a, b = van.generate(PROMPTS, rc), hs.generate(PROMPTS, rc)
    assert a.left_padded_prompt_tokens.tolist() == b.left_padded_prompt_tokens.tolist()
    assert adapter.pad_id() not in a.left_padded_prompt_tokens  # unpadded rows (see the docstring)
    assert all(adapter.pad_id() not in t.tolist() for t in a.tokens)
    assert [t.tolist() for t in b.tokens] == [t.tolist() for t in a.tokens]
    assert all(len(t) == 8 for t in b.tokens)
    comp = padded_completions(a.tokens, adapter.pad_id())
    lv = np.asarray(van.get_per_token_logps(jnp.asarray(a.left_padded_prompt_tokens), jnp.asarray(comp)))
    lh = np.asarray(hs.get_per_token_logps(a.left_padded_prompt_tokens, comp))
    assert float(np.max(np.abs(lv - lh))) <= 1e-5


def test_rollout_logps_match_tunix_on_trained_weights(adapter):
    """A few adam steps on Tunix's own log-likelihood sharpen the attention (random weights give
    near-uniform attention, which hides a wrong window or rope); full-width prompts of 16 tokens,
    completions right-padded (lengths 9..16)."""
    pad, eos = adapter.pad_id(), adapter.eos_id()
    rng = np.random.default_rng(0)
    prompts = rng.integers(10, 500, (4, 16)).astype(np.int32)
    comps = np.full((4, 16), pad, np.int32)
    for i, c in enumerate((16, 9, 13, 16)):
        comps[i, :c] = rng.integers(10, 500, c)
    m = _train(gemma2_model(0), prompts, comps, pad, eos)
    hs = HotswapRollout(rollout_actor=m, tokenizer=adapter, max_num_seqs=4)
    want = np.asarray(_logps(*nnx.split(m), prompts, comps, pad, eos))
    got = np.asarray(hs.get_per_token_logps(prompts, comps))
    mask = comps != pad
    assert want.dtype == got.dtype == np.float32
    assert np.all(got[~mask] == 0.0)
    assert float(np.max(np.abs(np.where(mask, want - got, 0.0)))) <= 1e-4
    start = np.asarray(_logps(*nnx.split(gemma2_model(0)), prompts, comps, pad, eos))
    assert np.mean(want[mask]) > np.mean(start[mask]) + 1.0  # trained
    # Row 1's prompt cut to 10 tokens and left-padded to 16: hotswap scores it as Tunix scores
    # it unpadded (Tunix's own padded score slides over 6 more keys and differs).
    short = np.full((1, 16), pad, np.int32)
    short[0, 6:] = prompts[1, 6:]
    padded = np.asarray(hs.get_per_token_logps(short, comps[1:2]))
    unpadded = np.asarray(_logps(*nnx.split(m), prompts[1:2, 6:], comps[1:2], pad, eos))
    tunix_padded = np.asarray(_logps(*nnx.split(m), short, comps[1:2], pad, eos))
    row = mask[1:2]
    assert float(np.max(np.abs(np.where(row, padded - unpadded, 0.0)))) <= 1e-4
    assert float(np.max(np.abs(np.where(row, tunix_padded - unpadded, 0.0)))) > 1e-3


def test_update_weights_takes_a_gemma2_state_and_refuses_one_missing_a_norm():
    """LLM.from_flax serves the Tunix Gemma 2; update_weights takes another seed's nnx.State and
    serves what a fresh engine on it serves. A state without one norm is refused with a
    WeightsMismatch naming it, and the version before keeps serving."""
    a, b = gemma2_model(0), gemma2_model(1)
    opts = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, warmup=False)
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = [5, 17, 42, 99, 7, 300, 12, 8, 64]  # longer than the window
    llm = LLM.from_flax(a, **opts)
    before = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    good = nnx.state(b, nnx.Param)
    missing = nnx.from_flat_state(
        [(p, v) for p, v in nnx.to_flat_state(good) if p != ("layers", 1, "post_attn_norm", "scale")]
    )
    with pytest.raises(WeightsMismatch, match=r"layers\.1\.post_attn_norm\.scale"):
        llm.update_weights(missing)
    assert llm.weights_version == 1
    assert llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids == before
    want = LLM.from_flax(b, **opts).generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert want != before
    assert llm.update_weights(good) == 2
    assert llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids == want

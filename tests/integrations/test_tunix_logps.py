"""HotswapRollout's log-probs against Tunix's own `compute_per_token_logps` on trained weights.

Random weights give near-uniform attention, which hides a wrong position encoding; a few
adam steps at a large learning rate sharpen it. Each model here is trained that way (on
Tunix's own log-likelihood of fixed completions), then both sides score left-padded
prompts of mixed lengths with right-padded completions, in f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tunix.generate import tokenizer_adapter
from tunix.models.llama3 import model as llama3
from tunix.models.qwen2 import model as qwen2
from tunix.models.qwen3 import model as qwen3
from tunix.rl import common
from tunix_worker import SIZES, gemma2_model, gemma3_model, tokenizer

from hotswap.integrations.tunix import HotswapRollout

# Each config says rope_theta 1e4; Tunix's Qwen2 applies it, its Llama3 and Qwen3 apply 1e6.
MODELS = {
    "llama3": lambda: llama3.Llama3(
        llama3.ModelConfig(**SIZES, rope_theta=10000, norm_eps=1e-5), rngs=nnx.Rngs(0)
    ),
    "qwen2": lambda: qwen2.Qwen2(
        qwen2.ModelConfig(**SIZES, rope_theta=10000, norm_eps=1e-6), rngs=nnx.Rngs(0)
    ),
    "qwen3": lambda: qwen3.Qwen3(
        qwen3.ModelConfig(**SIZES, rope_theta=10000, norm_eps=1e-6), rngs=nnx.Rngs(0)
    ),
    "gemma3": lambda: gemma3_model(),
}


def _batch(pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts left-padded to 16 (lengths 5..16), completions right-padded to 16 (lengths 9..16):
    the layout Tunix's learners score, with positions up to 31."""
    rng = np.random.default_rng(0)
    prompts = np.full((4, 16), pad, np.int32)
    comps = np.full((4, 16), pad, np.int32)
    for i, (p, c) in enumerate(((5, 16), (16, 9), (11, 13), (8, 16))):
        prompts[i, 16 - p :] = rng.integers(10, 500, p)
        comps[i, :c] = rng.integers(10, 500, c)
    return prompts, comps


def _logps(graphdef, state, prompts, comps, pad, eos, stop_gradient=True):
    return common.compute_per_token_logps(
        graphdef,
        state,
        prompt_tokens=jnp.asarray(prompts),
        completion_tokens=jnp.asarray(comps),
        pad_id=pad,
        eos_id=eos,
        stop_gradient=stop_gradient,
    )


def _train(m: nnx.Module, prompts, comps, pad, eos, steps: int = 6) -> nnx.Module:
    """A few adam steps at 1e-2 raising the completions' log-likelihood (Tunix's own log-probs)."""
    graphdef, params = nnx.split(m)
    mask = jnp.asarray(comps != pad)
    opt = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state):
        def loss(p):
            lp = _logps(graphdef, p, prompts, comps, pad, eos, stop_gradient=False)
            return -jnp.sum(jnp.where(mask, lp, 0.0)) / jnp.sum(mask)

        grads = jax.grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = opt.init(params)
    for _ in range(steps):
        params, opt_state = step(params, opt_state)
    return nnx.merge(graphdef, params)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_rollout_logps_match_tunix_on_trained_weights(family):
    adapter = tokenizer_adapter.TokenizerAdapter(tokenizer())
    pad, eos = adapter.pad_id(), adapter.eos_id()
    prompts, comps = _batch(pad)
    m = _train(MODELS[family](), prompts, comps, pad, eos)
    hs = HotswapRollout(rollout_actor=m, tokenizer=adapter, max_num_seqs=4)
    want = np.asarray(_logps(*nnx.split(m), prompts, comps, pad, eos))
    got = np.asarray(hs.get_per_token_logps(prompts, comps))
    mask = comps != pad
    assert want.dtype == got.dtype == np.float32
    assert np.all(got[~mask] == 0.0)  # pad positions, as Tunix masks them
    assert float(np.max(np.abs(np.where(mask, want - got, 0.0)))) <= 1e-5
    # trained: the completions are far likelier than under the near-uniform initial weights
    start = np.asarray(_logps(*nnx.split(MODELS[family]()), prompts, comps, pad, eos))
    assert np.mean(want[mask]) > np.mean(start[mask]) + 1.0


def test_deterministic_rollout_logps_are_its_generations_bit_for_bit():
    """`HotswapRollout(..., deterministic=True)` on trained weights: the log-probs a seeded
    rollout returned (four prompts of mixed lengths in one batch) are `get_per_token_logps`'s,
    bit for bit, and the first prompt alone samples the same tokens and log-probs as in the batch."""
    from tunix.rl.rollout import base_rollout

    adapter = tokenizer_adapter.TokenizerAdapter(tokenizer())
    pad, eos = adapter.pad_id(), adapter.eos_id()
    prompts, comps = _batch(pad)
    m = _train(MODELS["llama3"](), prompts, comps, pad, eos)
    hs = HotswapRollout(rollout_actor=m, tokenizer=adapter, max_num_seqs=4, deterministic=True)
    rc = base_rollout.RolloutConfig(
        max_tokens_to_generate=12,
        max_prompt_length=16,
        temperature=1.0,
        top_p=0.95,
        seed=5,
        return_logprobs=True,
    )
    texts = ["the quick brown fox", "a", "jumps over the lazy dog and then some more", "hello world"]
    out = hs.generate(texts, rc)
    width = max(len(t) for t in out.tokens)
    comp = np.full((len(texts), width), pad, np.int32)
    for i, t in enumerate(out.tokens):
        assert pad not in t.tolist()
        comp[i, : len(t)] = t
    got = np.asarray(hs.get_per_token_logps(out.left_padded_prompt_tokens, comp))
    for i, lp in enumerate(out.logprobs):
        assert got[i, : len(lp)].tobytes() == np.asarray(lp, np.float32).tobytes()
    first = hs.generate(texts[:1], rc)  # row 0 again, alone: the same row seed
    assert first.tokens[0].tolist() == out.tokens[0].tolist()
    assert (
        np.asarray(first.logprobs[0], np.float32).tobytes()
        == np.asarray(out.logprobs[0], np.float32).tobytes()
    )


@pytest.mark.parametrize("make", [gemma2_model, gemma3_model], ids=["gemma2", "gemma3"])
def test_a_tunix_gemma_state_maps_to_params_copying_only_q_k_v(make):
    """The Gemmas' q/k/v are Tunix einsum weights `[N, D, H]` (k and v stacked): taken by index
    and transposed, a copy each. Every other leaf (embedding, norms, attn_vec_einsum, MLP
    kernels) is the trainer's own array; the head is the embedding's transpose. A sync serves them."""
    from hotswap.model.spec import is_spec, param_specs
    from hotswap.weights import nnx as nnx_params

    adapter = tokenizer_adapter.TokenizerAdapter(tokenizer())
    hs = HotswapRollout(rollout_actor=make(0), tokenizer=adapter, max_num_seqs=2)
    state = nnx.state(make(1), nnx.Param)
    given = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(state)}
    cfg = hs.llm.config
    params = nnx_params.params_from_state(state, cfg)
    rows = jax.tree.leaves(param_specs(cfg), is_leaf=is_spec)
    mapped = dict(zip((s.name for s in rows), jax.tree.leaves(params), strict=True))
    copied = [s.name for s in rows if s.nnx_name and mapped[s.name] is not given[s.nnx_name]]
    layers = range(cfg.num_layers)
    assert sorted(copied) == sorted(f"layers.{i}.{k}" for i in layers for k in ("wq", "wk", "wv"))
    assert [s.name for s in rows if s.nnx_copies] == copied
    kv = np.asarray(given["layers.0.attn.kv_einsum.w"])  # [2, K, D, H] -> wk, wv [D, K, H]
    np.testing.assert_array_equal(mapped["layers.0.wv"], kv[1].transpose(1, 0, 2))
    np.testing.assert_array_equal(mapped["lm_head"], np.asarray(given["embedder.input_embedding"]).T)
    hs.update_params(state)
    assert hs.weights_version == 2
    served = jax.tree.leaves(hs.llm.engine.state.params)
    for s, x in zip(rows, served, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(mapped[s.name]), err_msg=s.name)
    # and back: the rollout's model() holds the served weights in Tunix's layout
    back = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.state(hs.model(), nnx.Param))}
    for name, a in given.items():
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(a), err_msg=name)


def test_gemma3_lora_sync_merges_k_and_v_from_their_one_pair():
    """Tunix's Gemma 3 stacks k and v in one `kv_einsum` `[2, K, D, H]`, and qwix puts one LoRA
    pair on it: A `[D, r]` and B `[r, 2, K, H]`. A LoRA-only sync serves wk + A·B[:, 0] and
    wv + A·B[:, 1] (scaled alpha / r), and the rollout's log-probs equal Tunix's on the actor."""
    from tunix_worker import gemma3_lora_model

    adapter = tokenizer_adapter.TokenizerAdapter(tokenizer())
    pad, eos = adapter.pad_id(), adapter.eos_id()
    prompts, comps = _batch(pad)
    actor = gemma3_lora_model(0, rank=4, alpha=8.0)
    hs = HotswapRollout(rollout_actor=actor, tokenizer=adapter, max_num_seqs=4)
    version = hs.weights_version  # the base, then its (zero) adapter merged
    # B starts at zero (qwix's init): a trained adapter's are not.
    lora = nnx.state(actor, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(lora))))
    lora = jax.tree.map(lambda x: 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), lora)
    nnx.update(actor, lora)
    flat = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(lora)}
    a, b = flat["layers.0.attn.kv_einsum.w_lora_a"], flat["layers.0.attn.kv_einsum.w_lora_b"]
    assert a.shape == (32, 4) and b.shape == (4, 2, 2, 8)  # [D, r], [r, 2, K, H]
    hs.update_params(lora)
    assert hs.weights_version == version + 1
    st = hs.llm.engine.state
    kv = np.asarray(nnx.state(actor, nnx.Param)["layers"][0]["attn"]["kv_einsum"]["w"][...])
    for key, part in (("wk", 0), ("wv", 1)):
        want = kv[part].transpose(1, 0, 2) + 2.0 * np.einsum("dr,rkh->dkh", a, b[:, part])  # alpha / r = 2
        np.testing.assert_allclose(np.asarray(st.params["layers"][0][key]), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(st.base["layers"][0][key]), kv[part].transpose(1, 0, 2))
    want = np.asarray(_logps(*nnx.split(actor), prompts, comps, pad, eos))
    got = np.asarray(hs.get_per_token_logps(prompts, comps))
    mask = comps != pad
    assert float(np.max(np.abs(np.where(mask, want - got, 0.0)))) <= 1e-4

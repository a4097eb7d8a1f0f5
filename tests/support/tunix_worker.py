"""Tunix checks on 2 fake CPU devices, run by tests/integrations/test_tunix.py in a subprocess.

Tunix's GRPO learner shards the trainer over a 2-device mesh, and the device count is
fixed when jax starts, so these checks run in their own process started with
XLA_FLAGS=--xla_force_host_platform_device_count=2. A tiny Tunix Llama3 and a byte-level
tokenizer built here (`hotswap.checkpoint.create`): nothing is downloaded. Prints one
JSON object on the last line of stdout; the tests assert on it.

usage: python tests/support/tunix_worker.py [CHECK ...]   (default: every check of CHECKS)
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import qwix
import transformers
from flax import nnx
from grain import python as grain
from jax.sharding import AxisType
from tunix.generate import tokenizer_adapter
from tunix.models.gemma import model as gemma
from tunix.models.gemma3 import model as gemma3
from tunix.models.llama3 import model as llama3
from tunix.models.qwen3 import model as qwen3
from tunix.rl import common
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl import utils as rl_utils
from tunix.rl.grpo import grpo_learner as grpo_lib
from tunix.rl.rollout import base_rollout, vanilla_rollout

from hotswap.checkpoint import create
from hotswap.errors import HotswapError
from hotswap.integrations.tunix import HotswapRollout

# The tiny shapes every Tunix check here and in test_tunix.py uses (the families differ in rope/norm).
SIZES = dict(
    num_layers=2, vocab_size=512, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8, num_kv_heads=2
)
CFG = llama3.ModelConfig(**SIZES, rope_theta=10000, norm_eps=1e-5)
PROMPTS = ["hello world", "My name is", "input string", "the cat sat"]
# 11 tokens each under `tokenizer()`: no left padding at max_prompt_length=11 (Tunix's Gemma 2).
GEMMA2_PROMPTS = [
    "hello world, how are",
    "input string of text",
    "the cat sat on the mat",
    "hello world, how are",
]
AUTO = (AxisType.Auto, AxisType.Auto)


def tokenizer():
    special = create.SPECIAL_TOKENS
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=create.build_tokenizer(CFG.vocab_size),
        bos_token=special[create.BOS_ID],
        eos_token=special[create.IM_END_ID],
        pad_token=special[create.EOT_ID],
    )


def model(seed: int = 0) -> llama3.Llama3:
    return llama3.Llama3(CFG, rngs=nnx.Rngs(seed))


def gemma3_model(seed: int = 0) -> gemma3.Gemma3:
    """A tiny Tunix Gemma 3 in f32: 6 layers (the 6th global, the others sliding over 8 tokens,
    shorter than the prompts), GQA, local / global rope bases 1e4 / 1e6."""
    sizes = {k: v for k, v in SIZES.items() if k not in ("vocab_size", "num_layers")}
    cfg = gemma3.ModelConfig(
        **sizes,
        num_layers=6,
        num_embed=SIZES["vocab_size"],
        sliding_window_size=8,
        local_base_frequency=10_000,
        global_base_frequency=1_000_000,
        param_dtype=jnp.float32,
    )
    return gemma3.Gemma3(cfg, rngs=nnx.Rngs(seed))


def qwen3_moe_model(seed: int = 0) -> qwen3.Qwen3:
    """A tiny Tunix Qwen3 MoE in f32: one sparse layer, 4 experts of hidden_dim, top-2. Tunix's
    CPU path unrolls a loop over the experts in every layer, and each one adds to the compile
    of its train step, the bulk of the GRPO run's time."""
    sizes = {**SIZES, "num_layers": 1}
    cfg = qwen3.ModelConfig(
        **sizes,
        rope_theta=1_000_000,
        norm_eps=1e-6,
        use_tied_embedding=False,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return qwen3.Qwen3(cfg, rngs=nnx.Rngs(seed))


def gemma2_model(seed: int = 0) -> gemma.Gemma:
    """A tiny Tunix Gemma 2 in f32: 4 layers alternating sliding (a window of 4 tokens, shorter
    than the prompts) and global, GQA (4 query heads, 2 KV heads), both softcaps low enough to
    bite. Tunix starts its norms and MLP at zero; seeded noise on every leaf makes each one count,
    so a mis-mapped or missing one shows."""
    sizes = {k: v for k, v in SIZES.items() if k not in ("vocab_size", "num_layers")}
    kinds = (gemma.AttentionType.LOCAL_SLIDING, gemma.AttentionType.GLOBAL)
    cfg = gemma.ModelConfig(
        **sizes,
        num_layers=4,
        num_embed=SIZES["vocab_size"],
        attention_types=kinds * 2,
        sliding_window_size=4,
        attn_logits_soft_cap=2.0,
        final_logit_softcap=3.0,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
    )
    m = gemma.Gemma(cfg, rngs=nnx.Rngs(seed))
    state = nnx.state(m, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(seed + 10), len(jax.tree.leaves(state))))
    nnx.update(m, jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), state))
    return m


def grpo(tok, make_model=model, prompts: list[str] = PROMPTS, prompt_len: int = 16) -> dict:
    """Tunix's own GRPOLearner + RLCluster, unmodified, with rollout_engine=HotswapRollout.
    `prompt_len`: the rollouts' `max_prompt_length` (prompts are left-padded to it)."""
    synced: list[int] = []

    class Recording(HotswapRollout):  # records the version each sync lands
        def update_params(self, params, filter_types=None):
            super().update_params(params, filter_types)
            synced.append(self.weights_version)

    mesh = jax.make_mesh((2, 1), ("fsdp", "tp"), axis_types=AUTO)
    rewards: list[list[float]] = []

    def reward_len(prompts, completions, **kw):
        r = [len(c) / 10 for c in completions]
        rewards.append(r)
        return r

    roles = rl_cluster_lib.Role
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
        rollout_engine=Recording,
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adam(1e-2), eval_every_n_steps=10, max_steps=3
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=8, max_prompt_length=prompt_len, kv_cache_size=256, temperature=0.9, seed=0
        ),
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=make_model(), reference=make_model(), tokenizer=tok, cluster_config=cluster_config
    )
    learner = grpo_lib.GRPOLearner(
        rl_cluster=cluster,
        reward_fns=reward_len,
        algo_config=grpo_lib.GRPOConfig(num_generations=2, num_iterations=1),
    )
    first = cluster.rollout.weights_version
    data = grain.MapDataset.source(prompts * 4).batch(2).map(lambda x: {"prompts": x, "answer": x})
    learner.train(data)
    loss = cluster.actor_trainer.metrics_logger.get_metric_history("actor", "loss", "train")
    generate_versions = [[v, sorted(s)] for v, s in cluster.rollout.version_log]
    # the trained actor's log-probs (Tunix's own) against the rollout's, on the rollout's tokens
    actor, pad = cluster.actor_trainer.model, tok.pad_token_id
    rc = base_rollout.RolloutConfig(
        max_tokens_to_generate=12,
        max_prompt_length=prompt_len,
        kv_cache_size=256,
        top_p=None,
        temperature=0.0,
    )
    out = cluster.rollout.generate(prompts, rc)
    comp = padded_completions(out.tokens, pad)
    want = common.compute_per_token_logps(
        *nnx.split(actor),
        prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
        completion_tokens=jnp.asarray(comp),
        pad_id=pad,
        eos_id=tok.eos_token_id,
    )
    got = cluster.rollout.get_per_token_logps(out.left_padded_prompt_tokens, comp)
    valid = np.cumprod(comp != pad, axis=1).astype(bool)  # up to a generated pad id, as Tunix masks
    config = cluster.rollout.llm.config
    return {
        "arch": config.arch,
        "num_experts": config.num_experts,
        "should_sync": bool(learner.should_sync_weights),
        "first_version": first,
        "synced": synced,
        "generate_versions": generate_versions,
        "trained_logp_max_diff": float(
            np.max(np.abs(np.where(valid, np.asarray(want) - np.asarray(got), 0.0)))
        ),
        "steps": learner._iter_steps,
        "loss": [float(x) for x in np.asarray(loss)],
        "rewards": rewards,
    }


# Tunix's gsm8k GRPO recipes' LoRA targets (qwix module paths), at rank 8 here.
LORA_MODULES = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj|.*up_proj"


def lora_model(seed: int = 0, rank: int = 8, alpha: float = 16.0) -> llama3.Llama3:
    """The tiny Llama3 with qwix LoRA on every recipe target, as Tunix's `apply_lora_to_model`
    (tunix/cli/utils/model.py) builds it from a recipe's `lora_config`."""
    base = model(seed)
    provider = qwix.LoraProvider(module_path=LORA_MODULES, rank=rank, alpha=alpha)
    return qwix.apply_lora_to_model(base, provider, **base.get_model_input(), rngs=nnx.Rngs(seed + 100))


# The same targets on Tunix's Gemma 3, whose attention is einsums: q_einsum, kv_einsum (k and v
# stacked: one LoRA pair, B [r, 2, K, H]) and attn_vec_einsum.
GEMMA3_LORA_MODULES = ".*q_einsum|.*kv_einsum|.*attn_vec_einsum|.*gate_proj|.*down_proj|.*up_proj"


def gemma3_lora_model(seed: int = 0, rank: int = 4, alpha: float = 8.0) -> gemma3.Gemma3:
    """The tiny Gemma 3 with qwix LoRA on its attention einsums and MLP."""
    base = gemma3_model(seed)
    provider = qwix.LoraProvider(module_path=GEMMA3_LORA_MODULES, rank=rank, alpha=alpha)
    return qwix.apply_lora_to_model(base, provider, **base.get_model_input(), rngs=nnx.Rngs(seed + 100))


def grpo_lora(tok) -> dict:
    """Tunix's GRPOLearner + RLCluster, unmodified, with a LoRA actor (rank 8) and HotswapRollout:
    every sync carries only `nnx.LoRAParam` leaves and lands as version + 1; the rollout's
    log-probs are Tunix's `compute_per_token_logps` on the trained actor with its adapter."""
    syncs: list[dict] = []

    class Recording(HotswapRollout):
        def update_params(self, params, filter_types=None):
            flat = [v for _, v in nnx.to_flat_state(params)]
            super().update_params(params, filter_types)
            syncs.append(
                {
                    "version": self.weights_version,
                    "leaves": len(flat),
                    "lora_only": all(isinstance(v, nnx.LoRAParam) for v in flat),
                    "filter": [t.__name__ for t in filter_types or ()],
                }
            )

    mesh = jax.make_mesh((2, 1), ("fsdp", "tp"), axis_types=AUTO)
    roles = rl_cluster_lib.Role
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
        rollout_engine=Recording,
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adam(3e-2), eval_every_n_steps=10, max_steps=3
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=8, max_prompt_length=16, kv_cache_size=256, temperature=0.9, seed=0
        ),
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=lora_model(), reference=model(), tokenizer=tok, cluster_config=cluster_config
    )
    learner = grpo_lib.GRPOLearner(
        rl_cluster=cluster,
        reward_fns=lambda prompts, completions, **kw: [len(c) / 10 for c in completions],
        algo_config=grpo_lib.GRPOConfig(num_generations=2, num_iterations=1),
    )
    first = cluster.rollout.weights_version
    data = grain.MapDataset.source(PROMPTS * 4).batch(2).map(lambda x: {"prompts": x, "answer": x})
    learner.train(data)
    actor, pad = cluster.actor_trainer.model, tok.pad_token_id
    rc = base_rollout.RolloutConfig(
        max_tokens_to_generate=12, max_prompt_length=16, kv_cache_size=256, top_p=None, temperature=0.0
    )
    out = cluster.rollout.generate(PROMPTS, rc)
    comp = padded_completions(out.tokens, pad)
    args = dict(
        prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
        completion_tokens=jnp.asarray(comp),
        pad_id=pad,
        eos_id=tok.eos_token_id,
    )
    want = common.compute_per_token_logps(*nnx.split(actor), **args)
    base_want = common.compute_per_token_logps(
        *nnx.split(cluster.inference_worker.get_model("reference")), **args
    )
    got = cluster.rollout.get_per_token_logps(out.left_padded_prompt_tokens, comp)
    valid = np.cumprod(comp != pad, axis=1).astype(bool)
    lora_b = [np.abs(np.asarray(v[...])).max() for p, v in nnx.to_flat_state(nnx.state(actor, nnx.LoRAParam))]
    return {
        "first_version": first,
        "syncs": syncs,
        "steps": learner._iter_steps,
        "trained_lora_b_max": float(max(lora_b)),
        "logp_max_diff": float(np.max(np.abs(np.where(valid, np.asarray(want) - np.asarray(got), 0.0)))),
        "adapter_moves_logps": float(
            np.max(np.abs(np.where(valid, np.asarray(want) - np.asarray(base_want), 0.0)))
        ),
        "served_base_kept": cluster.rollout.llm.engine.state.base is not None,
    }


def padded_completions(tokens, pad_id: int) -> np.ndarray:
    out = np.full((len(tokens), max(len(t) for t in tokens)), pad_id, np.int32)
    for i, t in enumerate(tokens):
        out[i, : len(t)] = t
    return out


def vs_vanilla(tok) -> dict:
    """Greedy tokens and teacher-forced log-probs against Tunix's vanilla rollout on the same model."""
    m, adapter = model(), tokenizer_adapter.TokenizerAdapter(tok)
    rc = base_rollout.RolloutConfig(
        max_tokens_to_generate=12, max_prompt_length=16, kv_cache_size=256, top_p=None, temperature=0.0
    )
    cache = base_rollout.CacheConfig(cache_size=256, num_layers=2, num_kv_heads=2, head_dim=8)
    van = vanilla_rollout.VanillaRollout(m, adapter, cache)
    hs = HotswapRollout(rollout_actor=m, tokenizer=adapter, mesh=None, rollout_config=rc)
    a, b = van.generate(PROMPTS, rc), hs.generate(PROMPTS, rc)
    comp = padded_completions(a.tokens, adapter.pad_id())
    lv = np.asarray(van.get_per_token_logps(jnp.asarray(a.left_padded_prompt_tokens), jnp.asarray(comp)))
    lh = np.asarray(hs.get_per_token_logps(a.left_padded_prompt_tokens, comp))
    mask = comp != adapter.pad_id()
    # Sampled at temperature 0.7: rollout log-probs are the scaled distribution's, as vanilla's.
    # The oracle is Tunix's compute_per_token_logps at that temperature: it matches vanilla's
    # own log-probs on vanilla's tokens, and hotswap's on hotswap's (the draws differ).
    rt = base_rollout.RolloutConfig(
        max_tokens_to_generate=8,
        max_prompt_length=16,
        kv_cache_size=256,
        temperature=0.7,
        top_p=1.0,
        seed=0,
        return_logprobs=True,
    )
    graphdef, state = nnx.split(m)

    def scaled_diff(out) -> float:
        c = padded_completions(out.tokens, adapter.pad_id())
        want = common.compute_per_token_logps(
            graphdef,
            state,
            prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
            completion_tokens=jnp.asarray(c),
            pad_id=adapter.pad_id(),
            eos_id=adapter.eos_id(),
            temperature=0.7,
            stop_gradient=True,
            return_logits=False,
        )
        got = np.zeros(c.shape, np.float32)
        for i, lp in enumerate(out.logprobs):
            got[i, : len(out.tokens[i])] = lp[: len(out.tokens[i])]
        # up to the first pad id: a sampled token equal to it (a draw at 0.7 can be one) is
        # masked out of the oracle's attention, so its later positions are not teacher forcing
        valid = np.cumprod(c != adapter.pad_id(), axis=1).astype(bool)
        return float(np.max(np.abs(np.where(valid, np.asarray(want) - got, 0.0))))

    scaled = {
        "vanilla": scaled_diff(van.generate(PROMPTS, rt)),
        "hotswap": scaled_diff(hs.generate(PROMPTS, rt)),
    }
    return {
        "scaled_logprob_max_diff": scaled,
        "vanilla_tokens": [t.tolist() for t in a.tokens],
        "hotswap_tokens": [t.tolist() for t in b.tokens],
        "same_padded_prompts": a.left_padded_prompt_tokens.tolist() == b.left_padded_prompt_tokens.tolist(),
        "same_text": a.text == b.text,
        "vanilla_logits": a.logits,
        "hotswap_logits": b.logits,
        "tokens_dtype": [str(t.dtype) for t in b.tokens],
        "logp_max_diff": float(np.max(np.abs(np.where(mask, lv - lh, 0.0)))),
    }


def after_sync(tok) -> dict:
    """A sync empties the prefix cache and serves what a fresh engine built from the new state serves."""
    adapter = tokenizer_adapter.TokenizerAdapter(tok)
    rc = base_rollout.RolloutConfig(
        max_tokens_to_generate=8, max_prompt_length=16, kv_cache_size=256, top_p=None, temperature=0.0
    )
    hs = HotswapRollout(rollout_actor=model(0), tokenizer=adapter, rollout_config=rc)
    long_prompt = "the quick brown fox jumps over the lazy dog " * 2  # > one 16-token page
    ids = hs._tokenize(long_prompt)
    sp = hs._sampling(rc, 0, [adapter.eos_id()])
    hs.llm.generate([ids], sp, use_tqdm=False)
    cached_before = hs.llm.generate([ids], sp, use_tqdm=False)[0].num_cached_tokens
    new = model(1)
    hs.update_params(nnx.state(new, nnx.Param))
    after = hs.llm.generate([ids], sp, use_tqdm=False)[0]
    fresh = HotswapRollout(rollout_actor=new, tokenizer=adapter, rollout_config=rc)
    got, want = hs.generate(PROMPTS, rc), fresh.generate(PROMPTS, rc)
    return {
        "cached_before_sync": cached_before,
        "cached_after_sync": after.num_cached_tokens,
        "after_versions": sorted(set(after.outputs[0].weights_versions)),
        "version": hs.weights_version,
        "same_as_fresh": [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens],
        "model_is_new_state": bool(
            np.array_equal(np.asarray(hs.model().lm_head.w[...]), np.asarray(new.lm_head.w[...]))
        ),
    }


def _pointers(x) -> list[int]:
    return [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]


def zero_copy(tok) -> dict:
    """A state already on the engine's sharding (tp=2) is swapped in without a copy of any
    leaf (attention included: Tunix's head-split layout is hotswap's), under
    jax.transfer_guard("disallow")."""
    from hotswap.model.spec import is_spec, param_specs

    mesh = jax.make_mesh((1, 2), ("fsdp", "tp"), axis_types=AUTO)
    hs = HotswapRollout(rollout_actor=model(0), tokenizer=tok, mesh=mesh)
    engine = hs.llm.engine
    new = model(2)
    state = nnx.state(new, nnx.Param)
    flat = []
    for path, var in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        flat.append((path, var.replace(jax.device_put(var[...], _engine_sharding(hs, name)))))
    state = nnx.from_flat_state(flat)
    # A rollout built from an actor already on the engine's sharding starts on its own copy:
    # Tunix compares model() with the actor once, and would never sync one that shares it.
    graphdef, _, rest = nnx.split(new, nnx.Param, ...)
    placed = nnx.merge(graphdef, state, rest)
    starts_shared = rl_utils.is_sharing_weights(placed, HotswapRollout(placed, tok, mesh=mesh).model())
    given = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(state)}
    rows = jax.tree.leaves(param_specs(hs.llm.config), is_leaf=is_spec)
    before = {s.name: _pointers(given[s.nnx_name]) for s in rows}
    with jax.transfer_guard("disallow"):
        hs.update_params(state)
    p = engine.state.params
    after = {s.name: _pointers(x) for s, x in zip(rows, jax.tree.leaves(p), strict=True)}
    same_object = {s.name: x is given[s.nnx_name] for s, x in zip(rows, jax.tree.leaves(p), strict=True)}
    wq = p["layers"][0]["wq"]
    return {
        "version": hs.weights_version,
        "same_buffers": {
            k: before[n] == after[n]
            for k, n in (("embed", "embed"), ("w_up", "layers.0.w_up"), ("final_norm",) * 2, ("lm_head",) * 2)
        },
        "every_leaf_same_buffers": {k: before[k] == after[k] for k in before},
        "every_leaf_same_object": same_object,
        "shards_per_leaf": sorted({len(v) for v in after.values()}),
        "new_rollout_shares_actor": bool(starts_shared),
        "wq_sharding_ok": wq.sharding.is_equivalent_to(engine.abstract["layers"][0]["wq"].sharding, wq.ndim),
    }


def _engine_sharding(hs: HotswapRollout, nnx_name: str):
    from hotswap.model.spec import is_spec, param_specs

    for s, a in zip(
        jax.tree.leaves(param_specs(hs.llm.config), is_leaf=is_spec),
        jax.tree.leaves(hs.llm.engine.abstract),
        strict=True,
    ):
        if s.nnx_name == nnx_name:
            return a.sharding
    raise KeyError(nnx_name)


def bad_inputs(tok) -> dict:
    """Each bad state raises a typed error naming the parameter; the old version keeps serving."""
    adapter = tokenizer_adapter.TokenizerAdapter(tok)
    rc = base_rollout.RolloutConfig(
        max_tokens_to_generate=6, max_prompt_length=16, kv_cache_size=256, top_p=None, temperature=0.0
    )
    hs = HotswapRollout(rollout_actor=model(0), tokenizer=adapter, rollout_config=rc)
    ref = [t.tolist() for t in hs.generate(PROMPTS, rc).tokens]
    good = nnx.state(model(3), nnx.Param)

    def edit(fn):
        flat = [(p, v) for p, v in nnx.to_flat_state(good)]
        return nnx.from_flat_state(fn(flat))

    def with_value(name, value):
        return edit(lambda f: [(p, v.replace(value) if ".".join(map(str, p)) == name else v) for p, v in f])

    qcfg = qwen3.ModelConfig(**SIZES, rope_theta=10000, norm_eps=1e-5)
    lora = nnx.LoRA(32, 4, 64, rngs=nnx.Rngs(0))
    w_up = good["layers"][0]["mlp"]["up_proj"]["kernel"][...]
    cases = {
        "wrong_family": nnx.state(qwen3.Qwen3(qcfg, rngs=nnx.Rngs(0)), nnx.Param),
        "wrong_shape": with_value("layers.0.mlp.up_proj.kernel", w_up[:, :32]),
        "missing_layer": edit(lambda f: [(p, v) for p, v in f if p[:2] != ("layers", 1)]),
        "nan": with_value("layers.1.mlp.down_proj.kernel", jnp.full((64, 32), jnp.nan)),
        "lora": nnx.from_flat_state(
            list(nnx.to_flat_state(good))
            + [(("layers", 0, "mlp", "up_proj", "lora_a"), nnx.LoRAParam(lora.lora_a[...]))]
        ),
    }
    out = {}
    for name, state in cases.items():
        try:
            hs.update_params(state)
            out[name] = {"raised": None}
        except HotswapError as e:
            out[name] = {"raised": type(e).__name__, "message": str(e)}
        out[name]["version"] = hs.weights_version
        out[name]["same_output"] = [t.tolist() for t in hs.generate(PROMPTS, rc).tokens] == ref
    return out


CHECKS = {
    "grpo": grpo,
    "grpo_lora": grpo_lora,
    "vanilla": vs_vanilla,
    "sync": after_sync,
    "zero_copy": zero_copy,
    "bad": bad_inputs,
    "grpo_qwen3_moe": lambda tok: grpo(tok, qwen3_moe_model),
}
# Run alone (`tunix_worker.py grpo_gemma3`): the same GRPO loop on a tiny Tunix Gemma 3 or Gemma 2.
OTHER_CHECKS = {
    "grpo_gemma3": lambda tok: grpo(tok, gemma3_model),
    # unpadded prompts of 11 tokens: Tunix's Gemma 2 widens its window by a row's left padding
    "grpo_gemma2": lambda tok: grpo(tok, gemma2_model, GEMMA2_PROMPTS, 11),
}


def main() -> None:
    tok = tokenizer()
    result, times = {"devices": jax.device_count()}, {}
    names = sys.argv[1:] or list(CHECKS)
    for name, fn in ((n, {**CHECKS, **OTHER_CHECKS}[n]) for n in names):
        t0 = time.perf_counter()
        result[name] = fn(tok)
        times[name] = round(time.perf_counter() - t0, 2)
    result["seconds"] = times
    print(json.dumps(result))


if __name__ == "__main__":
    main()

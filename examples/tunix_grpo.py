"""Tunix GRPO with hotswap as the rollout engine: Tunix's own learner, hotswap's rollouts.

A tiny Tunix Llama3 (random weights) and a byte-level tokenizer built here, so nothing
is downloaded. Tunix's `GRPOLearner` trains it for a few steps with
`rollout_engine=HotswapRollout`; after every step Tunix syncs the trainer's weights
into the engine (a hotswap `update_weights`: version + 1, empty prefix cache), and the
next step's rollouts report the version that produced every token.

    python examples/tunix_grpo.py [--steps 4] [--devices 2]

Needs the extra: pip install -e '.[tunix]'. --devices > 1 fakes that many CPU devices
(the trainer's mesh is ("fsdp", "tp") = (devices, 1)).
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--devices", type=int, default=2, help="fake CPU devices for the trainer's mesh")
    args = ap.parse_args()
    if args.devices > 1:  # before jax starts
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

    import jax
    import optax
    import transformers
    from flax import nnx
    from grain import python as grain
    from tunix.models.llama3 import model as llama3
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner as grpo_lib
    from tunix.rl.rollout import base_rollout

    from hotswap.checkpoint import create
    from hotswap.integrations.tunix import HotswapRollout

    special = create.SPECIAL_TOKENS
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=create.build_tokenizer(512),
        bos_token=special[create.BOS_ID],
        eos_token=special[create.IM_END_ID],
        pad_token=special[create.EOT_ID],
    )
    cfg = llama3.ModelConfig(
        num_layers=2,
        vocab_size=512,
        embed_dim=32,
        hidden_dim=64,
        num_heads=4,
        head_dim=8,
        num_kv_heads=2,
        rope_theta=10000,
        norm_eps=1e-5,
    )
    actor, reference = llama3.Llama3(cfg, rngs=nnx.Rngs(0)), llama3.Llama3(cfg, rngs=nnx.Rngs(0))
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((args.devices, 1), ("fsdp", "tp"), axis_types=auto)

    step_rewards: list[float] = []

    def reward_vowels(prompts, completions, **kw):  # more vowels, more reward
        scores = [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]
        step_rewards.append(sum(scores) / len(scores))
        return scores

    roles = rl_cluster_lib.Role
    cluster = rl_cluster_lib.RLCluster(
        actor=actor,
        reference=reference,
        tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
            rollout_engine=HotswapRollout,  # or functools.partial(HotswapRollout, page_size=32)
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adam(1e-3), eval_every_n_steps=1000, max_steps=args.steps
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=16, max_prompt_length=16, kv_cache_size=256, temperature=0.9, seed=0
            ),
        ),
    )
    learner = grpo_lib.GRPOLearner(
        rl_cluster=cluster,
        reward_fns=reward_vowels,
        algo_config=grpo_lib.GRPOConfig(num_generations=4, num_iterations=1),
    )
    prompts = ["hello world", "My name is", "the cat sat", "once upon a time"] * args.steps
    data = grain.MapDataset.source(prompts).batch(2).map(lambda x: {"prompts": x, "answer": x})
    learner.train(data)

    rollout = cluster.rollout
    loss = cluster.actor_trainer.metrics_logger.get_metric_history("actor", "loss", "train")
    for i, ((version, used), r, l) in enumerate(zip(rollout.version_log, step_rewards, loss, strict=False)):
        print(
            f"step {i + 1}  rollout weights_version {version}  versions_used {sorted(used)}  reward {r:.3f}  loss {float(l):.6f}"
        )
    print(f"final weights_version {rollout.weights_version}")


if __name__ == "__main__":
    main()

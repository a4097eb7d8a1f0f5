"""A small GRPO loop for the demo: a programmatic task, rollouts with provenance checks, a trainer.

`task` defines prompts and rewards, `rollout` gets samples from an engine (in
process, or a `hotswap serve` subprocess over REST in `remote`), and `grpo` turns
them into group-normalised advantages and one optax step on the same params
pytree the engine serves.
"""

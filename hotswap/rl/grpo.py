"""GRPO on the engine's own params pytree: advantages, batch packing, one optax step.

The loss uses `hotswap.model.forward.token_logprobs`, the same pure forward the
engine's scorer uses, on the params layout the engine serves, so the trainer's
output can go straight into `LLM.update_weights` with no conversion. The step
also returns the trainer's log-probs under the params *before* the update,
which are exactly the weights that generated the rollout: comparing them with
the engine's logprobs is the train-inference mismatch check.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hotswap.model.config import ModelConfig
from hotswap.model.forward import forward_dense, token_logprobs
from hotswap.rl.rollout import Sample


class Batch(NamedTuple):
    """Prompt + completion per row, right-padded to a fixed length so the step compiles once."""

    tokens: np.ndarray  # int32[B, L]
    lengths: np.ndarray  # int32[B]
    mask: np.ndarray  # f32[B, L-1]: 1 where position t predicts a completion token
    old_logprobs: np.ndarray  # f32[B, L-1]: the engine's logprobs at those positions, else 0
    advantages: np.ndarray  # f32[B]


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """rewards [G, n] -> (r - group mean) / (group std + eps): GRPO's critic-free baseline."""
    mean, std = rewards.mean(axis=1, keepdims=True), rewards.std(axis=1, keepdims=True)
    return ((rewards - mean) / (std + 1e-4)).astype(np.float32)


def pack(samples: list[Sample], advantages: np.ndarray, length: int) -> Batch:
    """Samples (grouped, n per group, in order) -> a Batch of `length` columns."""
    b = len(samples)
    tokens = np.zeros((b, length), np.int32)
    lengths = np.zeros(b, np.int32)
    mask = np.zeros((b, length - 1), np.float32)
    old = np.zeros((b, length - 1), np.float32)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.token_ids
        if len(seq) > length:
            raise ValueError(f"sample of {len(seq)} tokens does not fit the batch length {length}")
        p, t = len(s.prompt_ids), len(seq)
        tokens[i, :t], lengths[i] = seq, t
        mask[i, p - 1 : t - 1] = 1.0  # position t-1 predicts token t
        old[i, p - 1 : t - 1] = s.logprobs
    return Batch(tokens, lengths, mask, old, advantages.reshape(-1).astype(np.float32))


def make_train_step(cfg: ModelConfig, optimizer: optax.GradientTransformation, clip: float = 0.2):
    """A jitted `(params, opt_state, batch) -> (params, opt_state, loss, logprobs)`.

    PPO-clipped surrogate against the engine's logprobs (the behaviour policy),
    averaged over completion tokens. Params are not donated: after a zero-copy
    `update_weights` the engine serves these very arrays.
    """

    def loss_fn(params, batch: Batch):
        lp = token_logprobs(params, batch.tokens, batch.lengths, cfg=cfg)  # [B, L-1]
        ratio = jnp.exp(lp - batch.old_logprobs)
        adv = batch.advantages[:, None]
        surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv)
        loss = -jnp.sum(surrogate * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)
        return loss, lp

    @jax.jit
    def train_step(params, opt_state, batch: Batch):
        (loss, lp), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, lp

    return train_step


def max_mismatch(trainer_logprobs, batch: Batch) -> float:
    """max |trainer - engine| log-prob over every generated token of the batch."""
    diff = np.abs(np.asarray(trainer_logprobs) - batch.old_logprobs) * batch.mask
    return float(diff.max()) if diff.size else 0.0


@partial(jax.jit, static_argnames=("cfg",))
def _full_logprobs(params, tokens, lengths, *, cfg: ModelConfig):
    return jax.nn.log_softmax(forward_dense(params, tokens, lengths, cfg=cfg), axis=-1)  # [B, L, V]


def resolve_ambiguous(samples: list[Sample], params, cfg: ModelConfig, length: int) -> int:
    """Pick ids for tokens whose text was ambiguous (--via-http), left to right; returns how many.

    The server's completions report token *text*; with a byte-level tokenizer the
    128 lone high bytes all read as U+FFFD. For each such token, the candidate
    whose teacher-forced log-prob (under the weights that generated it) is
    closest to the server's reported log-prob is the one that was sampled. A
    wrong pick would change the context of every later position and show up
    there as a large mismatch. (A server that returned token ids would make
    this unnecessary.)
    """
    total = sum(len(s.ambiguous) for s in samples)
    while any(s.ambiguous for s in samples):
        # The whole batch every round: one compiled shape.
        batch = pack(samples, np.zeros(len(samples), np.float32), length)
        lsm = np.asarray(_full_logprobs(params, batch.tokens, batch.lengths, cfg=cfg))
        for i, s in enumerate(samples):
            if s.ambiguous:
                k, cands = s.ambiguous.pop(0)
                row = lsm[i, len(s.prompt_ids) + k - 1]
                s.token_ids[k] = min(cands, key=lambda c: abs(float(row[c]) - s.logprobs[k]))
    return total

"""Prompt log-probs inside the step: log p(next prompt token) at the positions of rows that ask.

What vLLM's `prompt_logprobs`, OpenAI's `echo` + `logprobs` and SGLang's input-token log-probs
return, computed by the step program that computes the prompt's KV (`step._step`), from the
same hidden states: no second forward. A position t of a prompt chunk asks when the runner set
its target, the prompt token at t + 1 (`Batch.prompt_targets`, -1 elsewhere).

A step where no position asks pays one `any` (a `lax.cond`). One that asks never holds the
[B*C, V] logits of the whole step: the asking positions are gathered first (their count is
dynamic), then the lm head runs on blocks of `rows` of them at a time in a `while_loop`, each
block reduced (logsumexp, the target's logit and rank, and the top-k when asked) before the
next, so the logits live for one [rows, V] block. The logsumexp is the Backend's `row_stats`,
as the sampler's: a prompt token's log-prob is computed as a sampled token's is.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from hotswap.programs.sampler import TOP_LOGPROBS

BLOCK_BYTES = 32 << 20  # f32 logits of one block of asking positions, at most


def block_rows(vocab_size: int) -> int:
    """Asking positions per lm-head call: as many as BLOCK_BYTES of f32 logits hold, a power of
    two in [8, 128] (each block reads the whole [D, V] head once: larger blocks read it less)."""
    rows = 8
    while rows < 128 and 2 * rows * vocab_size * 4 <= BLOCK_BYTES:
        rows *= 2
    return rows


def nothing_asked(t: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    return (
        jnp.zeros(t, jnp.float32),
        jnp.zeros(t, jnp.int32),
        jnp.zeros((t, TOP_LOGPROBS), jnp.int32),
        jnp.zeros((t, TOP_LOGPROBS), jnp.float32),
    )


def prompt_logprobs(
    h: jax.Array,
    targets: jax.Array,
    top: jax.Array,
    logits_of: Callable[[jax.Array], jax.Array],
    row_stats: Callable,
    vocab_size: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """h [T, D] (final-normed hidden states), targets [T] i32 (-1: not asked), top [T] bool (the
    position's row wants top-k) -> (logprob f32 [T], rank i32 [T] (1 + the tokens more likely
    than the target), top_ids i32 [T, K], top_lps f32 [T, K]); zeros where not asked.
    `logits_of`: [r, D] -> f32 [r, V]; `row_stats`: the Backend's (argmax, logsumexp) per row;
    `vocab_size`: V, which sizes the blocks."""
    t = targets.shape[0]
    return jax.lax.cond(
        jnp.any(targets >= 0),
        lambda: _asked(h, targets, top, logits_of, row_stats, min(block_rows(vocab_size), t)),
        lambda: nothing_asked(t),
    )


def _asked(h, targets, top, logits_of, row_stats, rows: int):
    t = targets.shape[0]
    want = targets >= 0
    n = jnp.sum(want, dtype=jnp.int32)
    # The asking positions first, in order; padded so every block's slice is in range.
    order = jnp.argsort(~want, stable=True).astype(jnp.int32)
    order = jnp.concatenate([order, jnp.zeros(rows, jnp.int32)])

    def block(i, acc):
        idx = jax.lax.dynamic_slice(order, (i * rows,), (rows,))
        live = i * rows + jnp.arange(rows) < n
        target = jnp.maximum(targets[idx], 0)
        logits = logits_of(h[idx])  # [rows, V] f32
        _, lse = row_stats(logits)
        chosen = jnp.take_along_axis(logits, target[:, None], axis=-1)[:, 0]
        rank = 1 + jnp.sum(logits > chosen[:, None], axis=-1, dtype=jnp.int32)
        top_lps, top_ids = jax.lax.cond(
            jnp.any(top[idx] & live),
            lambda: _shifted_top(logits, lse),
            lambda: (
                jnp.zeros((rows, TOP_LOGPROBS), jnp.float32),
                jnp.zeros((rows, TOP_LOGPROBS), jnp.int32),
            ),
        )
        dest = jnp.where(live, idx, t)  # past the end: dropped
        got = (chosen - lse, rank, top_ids, top_lps)
        return tuple(a.at[dest].set(v, mode="drop") for a, v in zip(acc, got, strict=True))

    return jax.lax.fori_loop(0, (n + rows - 1) // rows, block, nothing_asked(t))


def _shifted_top(logits: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    lps, ids = jax.lax.top_k(logits, TOP_LOGPROBS)
    return lps - lse[:, None], ids.astype(jnp.int32)

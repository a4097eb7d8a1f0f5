"""On-device sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Stateless like gemma's sampler: each row's randomness is
`fold_in(key(seed), output_index)`, so a seeded request draws the same tokens
alone or inside any batch. `logprob` is always the chosen token's log-prob
under the *raw* model distribution (what `LLM.score` returns), whatever the
sampling transform. The request-side parameters are `engine/sampling.py`'s `SamplingParams`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.kernels.reference import argmax, argmax_logsumexp  # the jnp twins of the CPU kernel

TOP_LOGPROBS = 20  # the most top-logprobs a request may ask for (as in vLLM/OpenAI)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters as device arrays [R]."""

    temperature: jax.Array  # f32; 0 = greedy
    top_k: jax.Array  # i32; 0 = off
    top_p: jax.Array  # f32
    min_p: jax.Array  # f32
    seed: jax.Array  # u32
    step: jax.Array  # i32: index of the token being sampled in the row's output
    want_top: jax.Array  # bool: the row asked for top logprobs
    # Structured outputs (engine/structured.py): the row's allowed tokens, bit t % 32 of word
    # t // 32 (llguidance's packed layout, 1/32 of a [R, V] bool array to send), read only
    # where `constrained`.
    mask: jax.Array  # i32 [R, ceil(V / 32)]
    constrained: jax.Array  # bool

    @staticmethod
    def from_rows(
        rows: list[tuple[Any, int, int]], pad_to: int, vocab_size: int, mask: np.ndarray | None = None
    ) -> SamplingArrays:
        """rows: (SamplingParams, seed, output_index); padded rows are greedy. `mask`: the
        constrained rows' packed masks ([pad_to, mask_words(vocab_size)]; None: no row is)."""
        t = np.zeros(pad_to, np.float32)
        k = np.zeros(pad_to, np.int32)
        p = np.ones(pad_to, np.float32)
        m = np.zeros(pad_to, np.float32)
        s = np.zeros(pad_to, np.uint32)
        st = np.zeros(pad_to, np.int32)
        top = np.zeros(pad_to, bool)
        for i, (sp, seed, idx) in enumerate(rows):
            t[i], k[i], p[i], m[i] = sp.temperature, max(sp.top_k, 0), sp.top_p, sp.min_p
            s[i], st[i], top[i] = np.uint32(seed & 0xFFFFFFFF), idx, bool(sp.logprobs)
        con = np.zeros(pad_to, bool)
        if mask is None:
            mask = _no_mask(pad_to, mask_words(vocab_size))
        else:
            con[: len(rows)] = [sp.structured_outputs is not None for sp, _, _ in rows]
        return SamplingArrays(t, k, p, m, s, st, top, mask, con)


@functools.lru_cache(maxsize=64)
def _no_mask(rows: int, words: int) -> np.ndarray:
    """The mask of a step without constrained rows: one read-only array per shape, not a fresh
    [S, V/32] allocation every step (the device never reads it: no row is constrained)."""
    mask = np.zeros((rows, words), np.int32)
    mask.flags.writeable = False
    return mask


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's packed token mask."""
    return -(-vocab_size // 32)


def _masked(logits: jax.Array, sa: SamplingArrays) -> jax.Array:
    """Constrained rows' disallowed tokens at -inf; other rows as they are."""
    r, v = logits.shape
    bits = jnp.right_shift(sa.mask[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(r, -1)[:, :v] != 0
    return jnp.where(sa.constrained[:, None] & ~allowed, -jnp.inf, logits)


def _draw(scaled: jax.Array, sa: SamplingArrays) -> jax.Array:
    """One categorical draw per row from `scaled` [R, V] (masked entries -inf): the Gumbel-max
    draw of jax.random.categorical, with the vector argmax. A row's noise depends only on its
    seed and output index, so it draws the same token in any batch."""

    def draw(row_logits, seed, step):
        key = jax.random.fold_in(jax.random.key(seed), step)
        return argmax(jax.random.gumbel(key, row_logits.shape, row_logits.dtype) + row_logits)

    return jax.vmap(draw)(scaled, sa.seed, sa.step)


def _scaled(logits: jax.Array, sa: SamplingArrays) -> jax.Array:
    return logits / jnp.where(sa.temperature > 0, sa.temperature, 1.0)[:, None]


def _filters(sa: SamplingArrays) -> jax.Array:
    """Rows that ask for top-k, top-p or min-p [R]: only they need the sorted distribution."""
    return (sa.top_k > 0) | (sa.top_p < 1.0) | (sa.min_p > 0.0)


def _softmax(x: jax.Array) -> jax.Array:
    return jax.nn.softmax(x, axis=-1)


def _filtered_sample(logits: jax.Array, sa: SamplingArrays, softmax=_softmax) -> jax.Array:
    """Temperature + top-k + top-p + min-p, then a categorical draw per row. A row that sets
    no filter keeps every entry exactly, so it draws what `_draw` draws on its scaled logits
    (the unsorted path `sample` takes when no row filters): the batch never changes a token."""
    v = logits.shape[-1]
    scaled = _scaled(logits, sa)
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [R, V]
    k = jnp.where(sa.top_k > 0, jnp.minimum(sa.top_k, v), v)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    keep = scaled >= kth
    probs_sorted = softmax(sorted_desc)
    cum = jnp.cumsum(probs_sorted, axis=-1)
    # Smallest set whose mass reaches top_p: keep sorted entries whose preceding mass < top_p.
    n_keep = jnp.sum((cum - probs_sorted) < sa.top_p[:, None], axis=-1)
    p_thresh = jnp.take_along_axis(sorted_desc, (jnp.maximum(n_keep, 1) - 1)[:, None], axis=-1)
    # top_p = 1 keeps everything, exactly (the cumulative sum may round a tail entry's
    # preceding mass up to 1).
    keep &= (sa.top_p[:, None] >= 1.0) | (scaled >= p_thresh)
    probs = softmax(scaled)
    keep &= probs >= sa.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return _draw(jnp.where(keep, scaled, -jnp.inf), sa)


def _top_logprobs(logits: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The TOP_LOGPROBS most likely tokens' log-probs: the top logits, shifted by logsumexp."""
    top, ids = jax.lax.top_k(logits, TOP_LOGPROBS)
    return top - lse[:, None], ids


def _pick(logits: jax.Array, sa: SamplingArrays, greedy: jax.Array, softmax=_softmax) -> jax.Array:
    """Each row's token: `greedy` (its argmax) or a draw. No draw when every row is greedy; no
    [R, V] sort unless a sampling row filters (plain temperature sampling is a Gumbel-max over
    the scaled logits)."""
    sampling = sa.temperature > 0
    return jax.lax.cond(
        jnp.any(sampling),
        lambda: jnp.where(
            sampling,
            jax.lax.cond(
                jnp.any(sampling & _filters(sa)),
                lambda: _filtered_sample(logits, sa, softmax),
                lambda: _draw(_scaled(logits, sa), sa),
            ).astype(jnp.int32),
            greedy,
        ),
        lambda: greedy,
    )


def sample(
    logits: jax.Array, sa: SamplingArrays, row_stats=argmax_logsumexp, softmax=_softmax
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """logits [R, V] f32 -> (tokens i32[R], logprob f32[R], top_ids i32[R, K], top_lps f32[R, K]).
    `row_stats`: the Backend's (`argmax_logsumexp` or the C++ kernel, `cpu_sampling`);
    `softmax`: the filters' row softmax, the Backend's (`Backend.softmax`)."""
    # log p = logit - logsumexp: one fused reduction, never a [R, V] log-prob array (writing
    # and re-reading a vocabulary-wide array per row is memory traffic the step does not need).
    greedy, lse = row_stats(logits)
    # Constrained rows pick among their allowed tokens; a step without one runs none of it.
    # The log-probs stay those of the raw distribution (vLLM's default, what `score` returns).
    tokens = jax.lax.cond(
        jnp.any(sa.constrained),
        lambda: _pick(masked := _masked(logits, sa), sa, argmax(masked), softmax),
        lambda: _pick(logits, sa, greedy, softmax),
    )
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
    # Only when some row asked: under tensor parallelism top_k gathers the whole [R, V] row.
    r = logits.shape[0]
    top_lps, top_ids = jax.lax.cond(
        jnp.any(sa.want_top),
        lambda: _top_logprobs(logits, lse),
        lambda: (jnp.zeros((r, TOP_LOGPROBS), logits.dtype), jnp.zeros((r, TOP_LOGPROBS), jnp.int32)),
    )
    return tokens, chosen, top_ids.astype(jnp.int32), top_lps

"""On-device sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Stateless like gemma's sampler: each row's randomness is one uniform from
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

# The jnp twins of the CPU kernels (`sample`'s defaults; the engine passes its Backend's).
from hotswap.kernels.reference import argmax, argmax_logsumexp
from hotswap.kernels.reference import categorical as reference_categorical
from hotswap.kernels.reference import keep_thresholds as reference_keep_thresholds

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


def _draw(scaled: jax.Array, sa: SamplingArrays, categorical) -> jax.Array:
    """One categorical draw per row from `scaled` [R, V] (masked entries -inf) by the inverse
    CDF (`categorical`: the Backend's, the C++ kernel or its jnp twin), from one uniform per
    row. A row's uniform depends only on its seed and output index, so it draws the same token
    in any batch. Not jax.random.categorical's Gumbel-max: that pays a random number and two
    logs per vocabulary entry, most of a sampled decode step's extra time on CPU."""

    def uniform(seed, step):
        return jax.random.uniform(jax.random.fold_in(jax.random.key(seed), step), dtype=jnp.float32)

    return categorical(scaled, jax.vmap(uniform)(sa.seed, sa.step))


def _scaled(logits: jax.Array, sa: SamplingArrays) -> jax.Array:
    return logits / jnp.where(sa.temperature > 0, sa.temperature, 1.0)[:, None]


def _filters(sa: SamplingArrays) -> jax.Array:
    """Rows that ask for top-k, top-p or min-p [R]: only they need a keep threshold."""
    return (sa.top_k > 0) | (sa.top_p < 1.0) | (sa.min_p > 0.0)


def _filtered_sample(logits: jax.Array, sa: SamplingArrays, keep_thresholds, categorical) -> jax.Array:
    """Temperature + top-k + top-p + min-p, then a categorical draw per row. Each row keeps the
    scaled logits >= its threshold (`keep_thresholds`: the Backend's, a radix select or a
    bisection, never a [R, V] sort). A row that sets no filter gets -inf and keeps every entry
    exactly, so it draws what `_draw` draws on its scaled logits (the path `sample` takes when
    no row filters): the batch never changes a token."""
    scaled = _scaled(logits, sa)
    on = sa.temperature > 0  # a greedy row's filters are not worth a search
    t = keep_thresholds(
        scaled,
        jnp.where(on, sa.top_k, 0),
        jnp.where(on, sa.top_p, 1.0),
        jnp.where(on, sa.min_p, 0.0),
    )  # [R]
    return _draw(jnp.where(scaled >= t[:, None], scaled, -jnp.inf), sa, categorical)


def _top_logprobs(logits: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The TOP_LOGPROBS most likely tokens' log-probs: the top logits, shifted by logsumexp."""
    top, ids = jax.lax.top_k(logits, TOP_LOGPROBS)
    return top - lse[:, None], ids


def _pick(
    logits: jax.Array, sa: SamplingArrays, greedy: jax.Array, keep_thresholds, categorical
) -> jax.Array:
    """Each row's token: `greedy` (its argmax) or a draw. No draw when every row is greedy; no
    threshold search unless a sampling row filters (plain temperature sampling is a draw from
    the scaled logits)."""
    sampling = sa.temperature > 0
    return jax.lax.cond(
        jnp.any(sampling),
        lambda: jnp.where(
            sampling,
            jax.lax.cond(
                jnp.any(sampling & _filters(sa)),
                lambda: _filtered_sample(logits, sa, keep_thresholds, categorical),
                lambda: _draw(_scaled(logits, sa), sa, categorical),
            ).astype(jnp.int32),
            greedy,
        ),
        lambda: greedy,
    )


def sample(
    logits: jax.Array,
    sa: SamplingArrays,
    row_stats=argmax_logsumexp,
    *,
    keep_thresholds=reference_keep_thresholds,
    categorical=reference_categorical,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """logits [R, V] f32 -> (tokens i32[R], logprob f32[R], top_ids i32[R, K], top_lps f32[R, K]).
    `row_stats`, `keep_thresholds`, `categorical`: the Backend's (the jnp twins, or the C++ kernels of
    `cpu_sampling`; each row's on its own, so a row's token never depends on its batch)."""
    # log p = logit - logsumexp: one fused reduction, never a [R, V] log-prob array (writing
    # and re-reading a vocabulary-wide array per row is memory traffic the step does not need).
    greedy, lse = row_stats(logits)
    # Constrained rows pick among their allowed tokens; a step without one runs none of it.
    # The log-probs stay those of the raw distribution (vLLM's default, what `score` returns).
    tokens = jax.lax.cond(
        jnp.any(sa.constrained),
        lambda: _pick(masked := _masked(logits, sa), sa, argmax(masked), keep_thresholds, categorical),
        lambda: _pick(logits, sa, greedy, keep_thresholds, categorical),
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

"""On-device sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Stateless like gemma's sampler: each row's randomness is one uniform from
`fold_in(key(seed), output_index)`, so a seeded request draws the same tokens
alone or inside any batch. The chosen token's log-prob (and the top log-probs) are
by default those of the *raw* model distribution (what `LLM.score` returns); a row's
`logprobs_mode` (vLLM's) asks for the raw logits, or for the *processed* distribution the
token was drawn from: the logits after the structured-output mask, the temperature and the
top-k/top-p/min-p filters, filtered entries -inf. A greedy row's processed logits are its
masked logits (temperature 1, no filter: vLLM's all-greedy batch). A row that asks for its
kept set gets the size of the set it could draw from (the entries the filters keep, after
the mask; a greedy row's: its argmax alone) and that set as a packed bitmask.
The request-side parameters are `engine/sampling.py`'s `SamplingParams`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.args import LOGPROBS_MODES

# The jnp twins of the CPU kernels (`sample`'s defaults; the engine passes its Backend's).
from hotswap.kernels.reference import argmax, argmax_logsumexp
from hotswap.kernels.reference import categorical as reference_categorical
from hotswap.kernels.reference import keep_thresholds as reference_keep_thresholds

TOP_LOGPROBS = 20  # the most top-logprobs a request may ask for (as in vLLM/OpenAI)
# A row's `logprobs_mode` on device: its index in LOGPROBS_MODES; codes >= PROCESSED read the
# processed logits.
PROCESSED = LOGPROBS_MODES.index("processed_logprobs")


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
    mode: jax.Array  # i32: the row's index in LOGPROBS_MODES
    want_kept: jax.Array  # bool: the row asked for its kept set
    # Structured outputs (engine/structured.py): the row's allowed tokens, bit t % 32 of word
    # t // 32 (llguidance's packed layout, 1/32 of a [R, V] bool array to send), read only
    # where `constrained`.
    mask: jax.Array  # i32 [R, ceil(V / 32)]
    constrained: jax.Array  # bool

    @staticmethod
    def from_rows(
        rows: list[tuple[Any, int, int]],
        pad_to: int,
        vocab_size: int,
        mask: np.ndarray | None = None,
        logprobs_mode: str = LOGPROBS_MODES[0],
    ) -> SamplingArrays:
        """rows: (SamplingParams, seed, output_index); padded rows are greedy. `mask`: the
        constrained rows' packed masks ([pad_to, mask_words(vocab_size)]; None: no row is).
        `logprobs_mode`: the engine's, for rows whose params name none."""
        t = np.zeros(pad_to, np.float32)
        k = np.zeros(pad_to, np.int32)
        p = np.ones(pad_to, np.float32)
        m = np.zeros(pad_to, np.float32)
        s = np.zeros(pad_to, np.uint32)
        st = np.zeros(pad_to, np.int32)
        top = np.zeros(pad_to, bool)
        mode = np.zeros(pad_to, np.int32)
        kept = np.zeros(pad_to, bool)
        for i, (sp, seed, idx) in enumerate(rows):
            # top_k past the vocabulary keeps every token: clipped into int32 (a client may send any int)
            t[i], k[i], p[i], m[i] = sp.temperature, min(max(sp.top_k, 0), vocab_size), sp.top_p, sp.min_p
            s[i], st[i], top[i] = np.uint32(seed & 0xFFFFFFFF), idx, bool(sp.logprobs)
            mode[i] = LOGPROBS_MODES.index(sp.logprobs_mode or logprobs_mode)
            kept[i] = sp.return_kept_set is not None
        con = np.zeros(pad_to, bool)
        if mask is None:
            mask = _no_mask(pad_to, mask_words(vocab_size))
        else:
            con[: len(rows)] = [sp.structured_outputs is not None for sp, _, _ in rows]
        return SamplingArrays(t, k, p, m, s, st, top, mode, kept, mask, con)


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


def unpack_mask(words: np.ndarray) -> np.ndarray:
    """One row's packed mask (int32 [W], bit t % 32 of word t // 32) -> bool [32 W] (the bits
    past the vocabulary are 0)."""
    return np.unpackbits(np.ascontiguousarray(words, "<i4").view(np.uint8), bitorder="little").astype(bool)


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


def _top(source: jax.Array, shift: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The TOP_LOGPROBS largest entries of each row of `source` [R, V], less the row's `shift`
    [R] (its logsumexp for log-probs, 0 for logits): (values, ids)."""
    top, ids = jax.lax.top_k(source, TOP_LOGPROBS)
    return top - shift[:, None], ids.astype(jnp.int32)


def _no_top(r: int) -> tuple[jax.Array, jax.Array]:
    return jnp.zeros((r, TOP_LOGPROBS), jnp.float32), jnp.zeros((r, TOP_LOGPROBS), jnp.int32)


def _pack(keep: jax.Array) -> jax.Array:
    """bool [R, V] -> int32 [R, mask_words(V)], bit t % 32 of word t // 32 (the layout of
    `SamplingArrays.mask`)."""
    r, v = keep.shape
    bits = jnp.pad(keep, ((0, 0), (0, mask_words(v) * 32 - v))).reshape(r, -1, 32).astype(jnp.uint32)
    words = jnp.sum(jnp.left_shift(bits, jnp.arange(32, dtype=jnp.uint32)), axis=-1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampled:
    """One step's sampled rows, what `sample` returns (device arrays, R rows)."""

    tokens: jax.Array  # i32 [R]
    logprobs: jax.Array  # f32 [R]: the token's log-prob (or logit) under the row's logprobs_mode
    top_ids: jax.Array  # i32 [R, TOP_LOGPROBS]: rows that asked (want_top), else zeros
    top_lps: jax.Array  # f32 [R, TOP_LOGPROBS]: their log-probs (or logits), largest first
    kept: jax.Array  # i32 [R]: the size of the kept set (rows that asked, else 0)
    kept_mask: jax.Array  # i32 [R, mask_words(V)]: the kept set, packed (rows that asked, else 0)


def _raw(logits, sa: SamplingArrays, greedy, lse, keep_thresholds, categorical) -> Sampled:
    """No row asks for processed logits or its kept set: the token as `_pick` draws it, its
    raw log-prob (or logit), the raw top entries only when some row asked."""
    # Constrained rows pick among their allowed tokens; a step without one runs none of it.
    tokens = jax.lax.cond(
        jnp.any(sa.constrained),
        lambda: _pick(masked := _masked(logits, sa), sa, argmax(masked), keep_thresholds, categorical),
        lambda: _pick(logits, sa, greedy, keep_thresholds, categorical),
    )
    shift = jnp.where(sa.mode == 0, lse, 0.0)  # raw_logprobs: logit - logsumexp; raw_logits: 0
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - shift
    # Only when some row asked: under tensor parallelism top_k gathers the whole [R, V] row.
    r = logits.shape[0]
    top_lps, top_ids = jax.lax.cond(jnp.any(sa.want_top), lambda: _top(logits, shift), lambda: _no_top(r))
    return Sampled(tokens, chosen, top_ids, top_lps, jnp.zeros(r, jnp.int32), jnp.zeros_like(sa.mask))


def _processed(logits, sa: SamplingArrays, greedy, lse, row_stats, keep_thresholds, categorical) -> Sampled:
    """Some row asks for processed logits or its kept set: build the logits every row draws
    from [R, V] (mask, temperature, filters; what `_pick` builds on its way to a draw), draw
    from them, and read each row's values off the logits its mode names. Tokens are those
    `_raw` draws: the same kernels on the same values. Each [R, V] pass is one the asking rows
    need (this runs on a memory-bound step): no copy of the logits, the top entries' source and
    the kept set only when a row asks for them."""
    on = sa.temperature > 0  # a greedy row's processed logits: its masked logits, no filter
    scaled = jax.lax.cond(
        jnp.any(sa.constrained), lambda: _scaled(_masked(logits, sa), sa), lambda: _scaled(logits, sa)
    )
    t = jax.lax.cond(
        jnp.any(on & _filters(sa)),
        lambda: keep_thresholds(
            scaled,
            jnp.where(on, sa.top_k, 0),
            jnp.where(on, sa.top_p, 1.0),
            jnp.where(on, sa.min_p, 0.0),
        ),
        lambda: jnp.full(on.shape, -jnp.inf, scaled.dtype),
    )  # [R]
    proc = jnp.where(scaled >= t[:, None], scaled, -jnp.inf)  # [R, V]
    # A greedy row's scaled logits are its masked ones (divided by 1): `_raw`'s argmax.
    argmaxes = jax.lax.cond(jnp.any(sa.constrained), lambda: argmax(scaled), lambda: greedy)
    tokens = jax.lax.cond(
        jnp.any(on),
        lambda: jnp.where(on, _draw(proc, sa, categorical).astype(jnp.int32), argmaxes),
        lambda: argmaxes,
    )
    processed = sa.mode >= PROCESSED
    shift = jnp.select(
        [sa.mode == 0, sa.mode == PROCESSED],
        [lse, jax.lax.cond(jnp.any(sa.mode == PROCESSED), lambda: row_stats(proc)[1], lambda: lse)],
        0.0,
    )

    def at_token(x):
        return jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0]

    chosen = jnp.where(processed, at_token(proc), at_token(logits)) - shift
    r, v = logits.shape
    top_lps, top_ids = jax.lax.cond(
        jnp.any(sa.want_top),
        lambda: _top(jnp.where(processed[:, None], proc, logits), shift),
        lambda: _no_top(r),
    )

    def kept():
        """The kept set: what the draw could return (finite processed entries), the argmax
        alone for a greedy row; rows that did not ask, none."""
        keep = jnp.where(on[:, None], proc > -jnp.inf, jnp.arange(v)[None, :] == tokens[:, None])
        keep &= sa.want_kept[:, None]
        return jnp.sum(keep, axis=-1, dtype=jnp.int32), _pack(keep)

    count, mask = jax.lax.cond(
        jnp.any(sa.want_kept), kept, lambda: (jnp.zeros(r, jnp.int32), jnp.zeros_like(sa.mask))
    )
    return Sampled(tokens, chosen, top_ids, top_lps, count, mask)


def sample(
    logits: jax.Array,
    sa: SamplingArrays,
    row_stats=argmax_logsumexp,
    *,
    keep_thresholds=reference_keep_thresholds,
    categorical=reference_categorical,
) -> Sampled:
    """logits [R, V] f32 -> each row's token, its log-prob, top entries and kept set (`Sampled`).
    `row_stats`, `keep_thresholds`, `categorical`: the Backend's (the jnp twins, or the C++ kernels of
    `cpu_sampling`; each row's on its own, so a row's token never depends on its batch)."""
    # log p = logit - logsumexp: one fused reduction, never a [R, V] log-prob array (writing
    # and re-reading a vocabulary-wide array per row is memory traffic the step does not need);
    # only a step with a row asking for processed logits or its kept set builds one.
    greedy, lse = row_stats(logits)
    return jax.lax.cond(
        jnp.any((sa.mode >= PROCESSED) | sa.want_kept),
        lambda: _processed(logits, sa, greedy, lse, row_stats, keep_thresholds, categorical),
        lambda: _raw(logits, sa, greedy, lse, keep_thresholds, categorical),
    )

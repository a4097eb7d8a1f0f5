"""jnp attention over the paged KV buffers: the CPU default and the kernels' oracle.

KV layout (one buffer per layer): `[num_pages, page_size, 2 * kv_heads, head_dim]`
with K and V interleaved on axis 2 (K of head h at 2h, V at 2h+1). The Pallas kernel's
layout folds the last two axes into one (`fold_pages`, the same bytes). Page 0 is the null page: padding slots point
there and its contents are never trusted (masked with `where`, so even NaN
there cannot leak into a result).

Every attention takes two static (per layer) keywords, HF's semantics: `window` (a query at
position i sees key j iff j <= i and i - j < window; the window counts the query itself) and
`softcap` (scores s = q.k * scale become softcap * tanh(s / softcap) before masking and softmax).
None is no window / no softcap, and then the computation is the one without them, op for op.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv(pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
    """Scatter a [B, C] block's new K/V into its pages.

    pages: [num_pages, page_size, 2*Hkv, hd], or the Pallas layout [num_pages, page_size,
    2*Hkv*hd] (the same bytes, `fold_pages`); k, v: [B, C, Hkv, hd]; slots: int32[B, C] flat
    slot `page * page_size + offset` of each token, computed on the host (padding tokens go to
    slot 0, in the null page, whose contents are never trusted). Run it where nothing else
    reads `pages` (the engine's separate donated write call), or ahead of a kernel that reads
    the result: then XLA updates in place.
    """
    b, c, hkv, hd = k.shape
    kv = jnp.stack([k, v], axis=3).reshape(b * c, *pages.shape[2:]).astype(pages.dtype)  # interleave K/V
    if pages.ndim == 3:
        # (page, offset) indices: no reshape of the lane-tiled TPU buffer to [num_pages*ps, lanes].
        ps, flat_slots = pages.shape[1], slots.reshape(-1)
        return pages.at[flat_slots // ps, flat_slots % ps].set(kv)
    flat = pages.reshape(-1, 2 * hkv, hd)
    return flat.at[slots.reshape(-1)].set(kv).reshape(pages.shape)


def fold_pages(pages: jax.Array) -> jax.Array:
    """[num_pages, ps, 2*Hkv, hd] -> the Pallas kernel's [num_pages, ps, 2*Hkv*hd] (a reshape)."""
    return pages.reshape(*pages.shape[:2], -1)


def in_window(mask: jax.Array, key_pos: jax.Array, q_pos: jax.Array, window: int | None) -> jax.Array:
    """`mask` and (broadcasting) key_pos inside the window of a query at q_pos; `mask` itself for None."""
    if window is None:
        return mask
    return mask & (q_pos - key_pos < window)


def cap(s: jax.Array, softcap: float | None) -> jax.Array:
    """Attention-logit softcapping of scaled scores (f32): softcap * tanh(s / softcap)."""
    if softcap is None:
        return s
    return softcap * jnp.tanh(s / softcap)


def check_window(window: int | None, softcap: float | None) -> None:
    """The static window / softcap a kernel is given: a positive int / a positive float, or None."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"attention window must be a positive int or None, not {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"attention softcap must be positive or None, not {softcap!r}")


def gather_kv(pages: jax.Array, block_tables: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, P] page ids -> K, V of shape [B, P*page_size, Hkv, hd]."""
    b, p = block_tables.shape
    _, ps, two_hkv, hd = pages.shape
    kv = pages[block_tables].reshape(b, p * ps, two_hkv // 2, 2, hd)
    return kv[..., 0, :], kv[..., 1, :]


def paged_attention(
    q: jax.Array,
    pages: jax.Array,
    block_tables: jax.Array,
    q_positions: jax.Array,
    kv_lens: jax.Array,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Causal attention of a [B, C] block of queries over each row's pages.

    q: [B, C, Hq, hd] (decode: C == 1; a prefill chunk: B == 1);
    block_tables: int32[B, P]; q_positions: int32[B, C] absolute positions;
    kv_lens: int32[B] tokens in the cache for the row, *including* this chunk.
    Key j is visible to a query at position p iff j <= p and j < kv_len (and p - j < window).
    Returns [B, C, Hq, hd] in q's dtype.
    """
    check_window(window, softcap)
    b, c, hq, hd = q.shape
    k, v = gather_kv(pages, block_tables)  # [B, L, Hkv, hd]
    hkv = k.shape[2]
    qg = q.reshape(b, c, hkv, hq // hkv, hd).astype(jnp.float32)
    s = jnp.einsum("bckgd,blkd->bkgcl", qg, k.astype(jnp.float32)) * scale  # [B,Hkv,G,C,L]
    s = cap(s, softcap)
    key_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    valid = (key_pos[None, None, :] <= q_positions[:, :, None]) & (
        key_pos[None, None, :] < kv_lens[:, None, None]
    )
    valid = in_window(valid, key_pos[None, None, :], q_positions[:, :, None], window)
    s = jnp.where(valid[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully masked (padding) rows
    p = jnp.exp(s - m)
    denom = jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    # Unused pages may hold anything (NaN included): zero them before p @ V. So may pages
    # before every query's window (a local layer's pages may be gone).
    key_ok = key_pos[None, :] < kv_lens[:, None]  # [B, L]
    if window is not None:
        first = jnp.min(q_positions, axis=1, keepdims=True) - window + 1  # [B, 1]
        key_ok = key_ok & (key_pos[None, :] >= first)
    v = jnp.where(key_ok[:, :, None, None], v.astype(jnp.float32), 0.0)
    o = jnp.einsum("bkgcl,blkd->bckgd", p / denom, v)
    return o.reshape(b, c, hq, hd).astype(q.dtype)


def prefill_attention(
    q: jax.Array,
    pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    page_ids: jax.Array,
    page_segs: jax.Array,
    page_cols: jax.Array,
    q_positions: jax.Array,
    kv_lens: jax.Array,
    chunk_starts: jax.Array,
    segments: jax.Array,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """A packed prefill: the same result as writing k_new/v_new into `pages` and calling
    `paged_attention` for each sequence, reading only the cache as it was before the write.

    Rows are blocks of C tokens of one sequence's chunk (several rows and several sequences
    per call). `segments[b]` names row b's sequence within the call (-1: a padding row);
    `chunk_starts[b]` is where that sequence's chunk starts and `kv_lens[b]` where it ends.

    Every query attends to one flat key set: the cached pages (`page_ids` [N], listed once per
    sequence with `page_segs` and `page_cols`, as in `decode_attention`) then this call's own
    K/V, masked to its own sequence, to positions before its chunk for cached keys, and
    causally for the chunk's. Listing a sequence's cached pages once (not once per row of its
    chunk) read 4x fewer bytes for a 64-token prompt over a 960-token cached prefix. Reading
    only the cache as it was keeps XLA:CPU from fusing the page write into the page read
    (which forced a full copy of every layer's buffer per step); the write comes after.
    """
    check_window(window, softcap)
    b, c, hq, hd = q.shape
    n, ps = page_ids.shape[0], pages.shape[1]
    hkv = k_new.shape[2]
    t = b * c
    qf = q.reshape(t, hkv, hq // hkv, hd).astype(jnp.float32)
    t_seg = jnp.repeat(segments, c)
    t_pos = q_positions.reshape(-1)
    t_real = t_pos < jnp.repeat(kv_lens, c)  # padding slots sit at or past their row's kv_len
    t_start = jnp.repeat(chunk_starts, c)
    kv = pages[page_ids].reshape(n * ps, hkv, 2, hd).astype(jnp.float32)
    key_seg = jnp.repeat(page_segs, ps)
    key_pos = (page_cols[:, None] * ps + jnp.arange(ps, dtype=jnp.int32)[None, :]).reshape(-1)
    old_ok = (key_seg[None, :] == t_seg[:, None]) & (key_pos[None, :] < t_start[:, None])  # [T, N*ps]
    new_ok = (t_seg[None, :] == t_seg[:, None]) & (t_pos[None, :] <= t_pos[:, None]) & t_real[None, :]
    old_ok = in_window(old_ok, key_pos[None, :], t_pos[:, None], window)
    new_ok = in_window(new_ok, t_pos[None, :], t_pos[:, None], window)
    s_old = jnp.einsum("tkgd,jkd->kgtj", qf, kv[:, :, 0]) * scale  # [Hkv, G, T, N*ps]
    s_new = jnp.einsum("tkgd,jkd->kgtj", qf, k_new.reshape(t, hkv, hd).astype(jnp.float32)) * scale
    s_old, s_new = cap(s_old, softcap), cap(s_new, softcap)
    s = jnp.concatenate([jnp.where(old_ok, s_old, -jnp.inf), jnp.where(new_ok, s_new, -jnp.inf)], axis=-1)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully masked (padding) rows
    p = jnp.exp(s - m)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    # Unused slots may hold anything (NaN included): zero V where no query may look.
    v_old = jnp.where(jnp.any(old_ok, axis=0)[:, None, None], kv[:, :, 1], 0.0)
    v_flat = jnp.where(t_real[:, None, None], v_new.reshape(t, hkv, hd).astype(jnp.float32), 0.0)
    l = n * ps
    o = jnp.einsum("kgtj,jkd->tkgd", p[..., :l], v_old) + jnp.einsum("kgtj,jkd->tkgd", p[..., l:], v_flat)
    return o.reshape(b, c, hq, hd).astype(q.dtype)


def decode_attention(
    q: jax.Array,
    pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    page_ids: jax.Array,
    page_rows: jax.Array,
    page_cols: jax.Array,
    chunk_starts: jax.Array,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Decode rows (C == 1) over the cache as it was before the step plus each row's new K/V.

    Reads only the pages rows really use: `page_ids` [N] lists them end to end, with
    `page_rows` (the row, or B for padding) and `page_cols` (the page's index in the row's
    table). A [B, P] table padded to the longest row made every row pay for it; on CPU,
    decode attention is bound by these reads (serving with mixed lengths read 3x less).
    q: [B, 1, Hq, hd]; k_new, v_new: [B, 1, Hkv, hd]; chunk_starts: [B] (keys < it are cached).

    Per-row softmax statistics are small dense reductions over a [B, N] row mask (XLA:CPU
    runs segment_max/segment_sum as serial scatters). The kv-head axis stays its own axis
    throughout, so under tensor parallelism every device works on its own heads with no
    collective (scoring every q head against every K/V row of a page, in the stored layout,
    saved a transpose copy on one device but all-gathered the pages across devices).
    """
    check_window(window, softcap)
    b, _, hq, hd = q.shape
    n, ps = page_ids.shape[0], pages.shape[1]
    hkv = k_new.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, hd).astype(jnp.float32)
    row = jnp.minimum(page_rows, b - 1)
    key_pos = page_cols[:, None] * ps + jnp.arange(ps, dtype=jnp.int32)[None, :]
    ok = (key_pos < chunk_starts[row][:, None]) & (page_rows < b)[:, None]  # [N, ps]
    # The row's query sits at chunk_starts (a decode row is a chunk of one); its own key is always in.
    ok = in_window(ok, key_pos, chunk_starts[row][:, None], window)
    # Unused slots may hold anything, NaN included: zero them as they are gathered.
    kv = jnp.where(ok[:, :, None, None], pages[page_ids].astype(jnp.float32), 0.0)
    kv = kv.reshape(n, ps, hkv, 2, hd)
    s = jnp.einsum("nkgd,nlkd->nkgl", qg[row], kv[..., 0, :]) * scale  # [N, Hkv, G, ps]
    s = jnp.where(ok[:, None, None, :], cap(s, softcap), -jnp.inf)
    s_new = jnp.sum(qg * k_new.reshape(b, hkv, 1, hd).astype(jnp.float32), axis=-1) * scale  # [B, Hkv, G]
    s_new = cap(s_new, softcap)
    mine = page_rows[None, :] == jnp.arange(b, dtype=page_rows.dtype)[:, None]  # [B, N]
    m_old = jnp.max(jnp.where(mine[:, :, None, None], jnp.max(s, axis=-1)[None], -jnp.inf), axis=1)
    m = jnp.maximum(m_old, s_new)
    p = jnp.exp(s - m[row][..., None])  # masked keys -> 0
    p_new = jnp.exp(s_new - m)
    mine = mine.astype(jnp.float32)
    denom = (mine @ jnp.sum(p, axis=-1).reshape(n, -1)).reshape(p_new.shape) + p_new
    o_pages = jnp.einsum("nkgl,nlkd->nkgd", p, kv[..., 1, :])  # [N, Hkv, G, hd]
    o = (mine @ o_pages.reshape(n, -1)).reshape(qg.shape)
    o = o + p_new[..., None] * v_new.reshape(b, hkv, 1, hd).astype(jnp.float32)
    return (o / denom[..., None]).reshape(b, 1, hq, hd).astype(q.dtype)


def dense_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
):
    """Plain causal attention for scoring/training. q: [B, L, Hq, hd]; k, v: [B, L, Hkv, hd]."""
    check_window(window, softcap)
    b, l_, hq, hd = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, l_, hkv, hq // hkv, hd).astype(jnp.float32)
    s = cap(jnp.einsum("bckgd,blkd->bkgcl", qg, k.astype(jnp.float32)) * scale, softcap)
    pos = jnp.arange(l_)
    causal = in_window(pos[None, :] <= pos[:, None], pos[None, :], pos[:, None], window)
    valid = causal[None] & (pos[None, None, :] < lengths[:, None, None])
    s = jnp.where(valid[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    o = jnp.einsum("bkgcl,blkd->bckgd", p, v.astype(jnp.float32))
    return o.reshape(b, l_, hq, hd).astype(q.dtype)


def argmax(x: jax.Array) -> jax.Array:
    """First index of each row's max, as jnp.argmax: two vector reductions. XLA:CPU runs
    argmax's (value, index) reduce as scalar code; a max and a min over an iota vectorise."""
    m = jnp.max(x, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    # A NaN row has no element equal to its max: clamp into range rather than return V.
    return jnp.min(jnp.where(x == m, iota, x.shape[-1] - 1), axis=-1)


def argmax_logsumexp(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's argmax (`argmax`) and logsumexp: what the sampler needs of every
    row. The jnp twin of `cpu_sampling.argmax_logsumexp`."""
    return argmax(logits), jax.nn.logsumexp(logits, axis=-1)


def categorical(scaled: jax.Array, u: jax.Array) -> jax.Array:
    """Each row's draw by the inverse CDF: the first entry whose running probability passes
    u x the row's total. scaled f32 [R, V] (logits / temperature, filtered entries -inf), u f32
    [R] in [0, 1) -> int32 [R]. The jnp twin of `cpu_sampling.categorical`: a row that never
    passes (rounding at u near 1) takes its last entry of non-zero probability, an all -inf
    row 0, a row with NaN V - 1."""
    v = scaled.shape[-1]
    m = jnp.max(scaled, axis=-1, keepdims=True)
    p = jnp.where(scaled == -jnp.inf, 0.0, jnp.exp(jnp.where(scaled == m, 0.0, scaled - m)))
    c = jnp.cumsum(p, axis=-1)
    # c never decreases, so the entries at or below the target come first: their count is the
    # index of the first entry past it, which has non-zero probability.
    passed = jnp.sum(c <= u[:, None] * c[:, -1:], axis=-1).astype(jnp.int32)
    iota = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, scaled.ndim - 1)
    last = jnp.max(jnp.where(p > 0, iota, 0), axis=-1)
    return jnp.where(jnp.isnan(m[:, 0]), v - 1, jnp.minimum(passed, last)).astype(jnp.int32)


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys with the f32 order (-0 as +0: a zero's ties are kept whatever its sign)."""
    b = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    return b ^ jnp.where(b >> 31 == 1, jnp.uint32(0xFFFFFFFF), jnp.uint32(0x80000000))


def _from_keys(k: jax.Array) -> jax.Array:
    b = k ^ jnp.where(k >> 31 == 1, jnp.uint32(0x80000000), jnp.uint32(0xFFFFFFFF))
    return jax.lax.bitcast_convert_type(b, jnp.float32)


def _least_key_below(keys: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """Each row's least key c with sum(weights[keys > c]) < target (its least key when every
    key qualifies), by bisection over the 32-bit key range: 32 masked sums over [R, V].
    keys uint32 [R, V]; weights [R, V] (or broadcastable); target [R]."""
    # Invariant: W(> lo) >= target (lo below every key: the whole row) and W(> hi) < target.
    lo = jnp.min(keys, axis=-1) - 1
    hi = jnp.max(keys, axis=-1)

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        above = jnp.sum(jnp.where(keys > mid[:, None], weights, 0), axis=-1)
        ok = above < target
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def keep_thresholds(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Each row's least kept value under its top-k, top-p and min-p filters (vLLM's): the
    entries >= it are kept; -inf keeps every entry. scaled f32 [R, V] (logits / temperature);
    top_k i32 [R] (<= 0 or >= V: off); top_p f32 [R] (>= 1: off); min_p f32 [R] (<= 0: off).

    Each filter keeps an upper set of the row's values, so their intersection is the upper set
    of the largest threshold. Top-k: the k-th largest value (ties kept). Top-p: the least value
    whose strictly larger entries hold less than top_p of the mass (the smallest set of largest
    entries reaching top_p, its last entry's ties kept). Min-p: max + log(min_p). No sort: the
    twin of `cpu_sampling.keep_thresholds`, and what the TPU programs run."""
    v = scaled.shape[-1]
    m = jnp.max(scaled, axis=-1)
    keys = _order_keys(scaled)
    no = jnp.full(m.shape, -jnp.inf, scaled.dtype)
    k_on, p_on = (top_k > 0) & (top_k < v), top_p < 1.0
    t_min_p = jnp.where(min_p > 0, m + jnp.log(jnp.where(min_p > 0, min_p, 1.0)), no)
    t_top_k = jax.lax.cond(
        jnp.any(k_on),
        lambda: jnp.where(k_on, _from_keys(_least_key_below(keys, jnp.int32(1), top_k)), no),
        lambda: no,
    )

    def top_p_threshold():
        e = jnp.exp(scaled - m[:, None])  # [R, V]
        target = top_p * jnp.sum(e, axis=-1)
        # A target that is not positive (top_p <= 0) keeps the max and its ties.
        target = jnp.where(target > 0, target, jnp.finfo(jnp.float32).tiny)
        return jnp.where(p_on, _from_keys(_least_key_below(keys, e, target)), no)

    t_top_p = jax.lax.cond(jnp.any(p_on), top_p_threshold, lambda: no)
    t = jnp.maximum(jnp.maximum(t_min_p, t_top_k), t_top_p)
    return jnp.where(m == -jnp.inf, no, t)  # an all -inf row: nothing to filter

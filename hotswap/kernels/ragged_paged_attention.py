"""Pallas paged attention over lane-folded KV pages: decode batches and prefill chunks.

Same semantics as `reference.paged_attention` (the oracle in tests), over the Pallas page layout
`[num_pages, page_size, 2*Hkv*hd]`: kv heads x (K|V) x head_dim folded into the minor (lane)
axis, lanes ordered (kv head h, K then V, d). It holds the same bytes in the same order as the
reference's `[num_pages, ps, 2*Hkv, hd]`; on TPU it is what lets the kernel read the cache in
place: the last two dims (ps, 2*Hkv*hd) tile as (8|16, 128) for any head_dim that is a multiple
of 64, where a `[.., 2*Hkv, 64]` minor dim is padded to 128 lanes and made XLA copy the whole
pool into the kernel's tiled layout around every call.

Grid `(B, kv-head blocks, query blocks)`, all parallel. Inside, a `fori_loop` with a dynamic
trip count runs the online-softmax reduction over kv blocks of `ppb` pages (`T = ppb * page_size`
keys each); a grid axis for it would cost a (no-op) grid step for every block past the real
length in every row of a bucketed batch.

- **KV is read page by page through the block table.** `pages` stays in HBM (`pl.ANY`); the
  kernel DMAs the `ppb` pages of kv block `ki` (ids from the scalar-prefetched table) into a
  double-buffered VMEM slot, starting block `ki+1` before computing on block `ki`. No gather
  ever materialises `[B, L, ...]`, and each page is one `[ps, 2*hpb*hd]` copy of the block's lanes.
  (Not one BlockSpec/index_map operand per page: Pallas' CPU interpreter then copies the whole
  pool every grid step, where pl.ANY + DMA copies only the pages asked for. The same DMA pattern as jax's own TPU paged-attention kernels.)
- **Pages past what a query block can see are never fetched.** `need[b, qi]` (scalar prefetch)
  is `min(kv_len, max q position in the block + 1)`; only `cdiv(need, ps)` pages are copied
  and the loop runs `cdiv(need, T)` times, so decode cost follows the real length, not the P
  bucket. Padding rows (kv_len 0) copy and compute nothing and write zeros.
- **GQA.** The wrapper lays queries out per kv head as `[B, Hkv, C*G, w]` (rows ordered
  (c, g)), so the G q heads of a kv head form one `[rows, w] x [w, T]` matmul.
- **Head slices stay lane-aligned.** With hd a multiple of 128 (split), K and V of a head are
  aligned `[T, hd]` lane slices and w = hd. Otherwise (hd = 64) the kernel never slices inside
  a 128-lane group: it takes the head's whole `[T, 2*hd]` (K|V) pair, q comes with a zero V half
  (w = 2*hd), so `q . pair` is `q . K`, and `p @ pair` holds `p @ V` in its V half, which the
  wrapper keeps. On the MXU a 64-deep contraction or a 64-wide output costs what 128 does.
- **Sliding window, softcap** (static, per layer; `reference` module doc). With a window, key j
  must also satisfy `p - j < window`; `lo[b, qi]` (scalar prefetch) is the first key any row of
  the query block can see, and the loop starts at its kv block and fetches no page wholly
  before it: a decode at 2,048 tokens with window 512 reads ~512 keys. Softcap is
  `softcap * tanh(s / softcap)` on the scaled scores before masking.
- **Masking.** key j is visible to row p iff `j <= p` and `j < kv_len`. Scores are masked with
  -inf (not a finite "mask value", which would average garbage into fully-masked rows) and V rows
  with `j >= need` are zeroed with `where`, so NaN in unused pages (or stale buffer slots)
  cannot leak into `p @ V`.

Alignment for Mosaic, by construction (last two block dims either equal the array's or are
multiples of (8, 128)):
- q / out `[B, Hkv, R_pad, w]` blocks `(., hpb, tq, w)`: `tq` is a multiple of 8 (16 for
  16-bit dtypes); the wrapper pads rows `C*G` up to a multiple of `tq` (padded rows get position
  -1: they see nothing and are sliced off). w is the full dim.
- row positions `[B, R_pad, 1]` blocks `(., tq, 1)`: 1 is the full dim.
- pages are not blocked (pl.ANY) and are pinned to HBM (`with_memory_space_constraint`); a page DMA reads lanes `[h*2*hpb*hd, (h+1)*2*hpb*hd)`, and
  the VMEM page buffer `[2, ppb, ps, 2*hpb*hd]` ends in `(ps, 2*hpb*hd)`: 2*hpb*hd is a multiple
  of 128 when hd is a multiple of 64 (`_heads_per_block` keeps it so), ps a multiple of 8/16.
- m / l scratch `[hpb, tq, 128]` (lane-replicated, as jax's TPU flash kernels do).
Other head dims run in interpret mode (CPU tests); the engine's Backend does not pick this kernel
for them on TPU. head_dim is never padded here: padding `pages` in the wrapper would copy the
whole cache every layer of every step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hotswap.kernels import reference

LANES = 128
MAX_ROWS = 256  # query rows (C*G) per block: bounds the q/acc/m/l blocks and [tq, T] tile in VMEM
KEYS_PER_STEP = 256  # target T = ppb * page_size keys per reduction step
MAX_BLOCK_LANES = 2048  # lanes (2*hpb*hd) of the kv heads one grid step reads: bounds the VMEM page buffer


def _cdiv(a, b):
    return (a + b - 1) // b


def _heads_per_block(hkv: int, hd: int) -> int:
    """kv heads per grid step: all of them when their lanes fit MAX_BLOCK_LANES, else the largest
    divisor whose 2*hpb*hd lanes do and are a multiple of 128 (a lane-aligned DMA and VMEM block)."""
    if 2 * hkv * hd <= MAX_BLOCK_LANES:
        return hkv
    for d in range(hkv - 1, 0, -1):
        if hkv % d == 0 and 2 * d * hd <= MAX_BLOCK_LANES and (2 * d * hd) % LANES == 0:
            return d
    return hkv


def _kernel(
    bt_ref,  # SMEM int32[B*P]: flattened block tables (clipped to valid page ids)
    need_ref,  # SMEM int32[B*nq]: keys each (row, query block) can see: min(kv_len, max pos + 1)
    lo_ref,  # SMEM int32[B*nq]: the first key any row of the block sees (0 without a window)
    q_ref,  # [hpb, tq, w]: w = hd (split) or 2*hd (q in the K half, zeros in the V half)
    pos_ref,  # [tq, 1] int32 absolute position per query row (-1 for padding rows)
    pages_hbm,  # [num_pages, ps, 2*Hkv*hd], left in HBM (pl.ANY)
    o_ref,  # [hpb, tq, w]
    buf,  # VMEM [2, ppb, ps, 2*hpb*hd]: double-buffered pages
    sem,  # DMA semaphores [2], one per buffer slot
    m_ref,  # [hpb, tq, 128] running max (lane-replicated)
    l_ref,  # [hpb, tq, 128] running sum
    acc_ref,  # [hpb, tq, w] unnormalised output
    *,
    p_cols: int,
    nq: int,
    hd: int,
    scale: float,
    window: int | None,
    softcap: float | None,
):
    b, h, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hpb, tq, _ = q_ref.shape
    _, ppb, ps, block_lanes = buf.shape
    t = ppb * ps  # keys per kv block
    split = hd % LANES == 0  # K and V halves are lane-aligned slices of the pair
    need = need_ref[b * nq + qi]
    # lax.div/rem, not // and %: these are non-negative, and jnp's floor semantics need `sign`,
    # which Mosaic lowers only with a TPU attached.
    steps = lax.div(need + t - 1, t)  # kv blocks to visit; 0 for padding rows
    n_pages = lax.div(need + ps - 1, ps)
    if window is None:
        lo, first, first_page = None, 0, 0
    else:  # kv blocks and pages wholly before the window are skipped
        lo = lo_ref[b * nq + qi]
        first, first_page = lax.div(lo, t), lax.div(lo, ps)

    def for_each_page(kb, slot, action):
        """Start or wait the DMA of every needed page of kv block `kb`. The same trip count both
        ways, so each started copy is waited exactly once; pages past `need` (or wholly before
        the window) are never fetched."""

        def body(j, carry):
            page = bt_ref[b * p_cols + kb * ppb + j]
            src = pages_hbm.at[page, :, pl.ds(h * block_lanes, block_lanes)]  # [ps, 2*hpb*hd]
            action(pltpu.make_async_copy(src, buf.at[slot, j], sem.at[slot]))
            return carry

        j0 = 0 if window is None else jnp.maximum(first_page - kb * ppb, 0)
        lax.fori_loop(j0, jnp.minimum(ppb, n_pages - kb * ppb), body, 0)

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(steps > first)
    def _():
        for_each_page(first, 0 if window is None else lax.rem(first, 2), lambda c: c.start())

    def kv_block(ki, carry):
        slot = lax.rem(ki, 2)

        @pl.when(ki + 1 < steps)
        def _prefetch():  # next block's pages stream in while this one computes
            for_each_page(ki + 1, 1 - slot, lambda c: c.start())

        for_each_page(ki, slot, lambda c: c.wait())
        key_pos = ki * t + lax.broadcasted_iota(jnp.int32, (1, t), 1)  # [1, T]
        # key < need is key < kv_len for every row of the block (need <= kv_len, and a visible
        # key is <= the row's position <= the block's max). It is also exactly the fetched range.
        visible = (key_pos <= pos_ref[...]) & (key_pos < need)  # [tq, T]
        v_pos = ki * t + lax.broadcasted_iota(jnp.int32, (t, 1), 0)  # [T, 1]
        v_ok = v_pos < need
        if window is not None:  # unfetched slots before the window may hold anything
            visible = visible & (pos_ref[...] - key_pos < window)
            v_ok = v_ok & (v_pos >= lo)
        for j in range(hpb):  # static: each kv head of the block, its G q heads together
            if split:  # [T, hd] each, lane-aligned
                k = buf[slot, :, :, pl.ds(2 * j * hd, hd)].reshape(t, hd).astype(jnp.float32)
                v = buf[slot, :, :, pl.ds((2 * j + 1) * hd, hd)].reshape(t, hd).astype(jnp.float32)
            else:  # the whole [T, 2*hd] pair for both: q's zero V half drops V from q.k
                k = v = buf[slot, :, :, pl.ds(2 * j * hd, 2 * hd)].reshape(t, 2 * hd).astype(jnp.float32)
            v = jnp.where(v_ok, v, 0.0)  # unused pages / unfetched slots may hold NaN; 0 * NaN = NaN
            q = q_ref[j].astype(jnp.float32)  # [tq, w]
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s = s * scale
            if softcap is not None:
                s = softcap * jnp.tanh(s / softcap)
            s = jnp.where(visible, s, -jnp.inf)  # [tq, T]
            m_prev = m_ref[j][:, :1]  # [tq, 1]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows that have seen nothing yet
            alpha = jnp.exp(m_prev - m_safe)
            p = jnp.exp(s - m_safe)  # masked -> exp(-inf) = 0
            l_next = alpha * l_ref[j][:, :1] + jnp.sum(p, axis=1, keepdims=True)
            pv = jnp.dot(p, v, preferred_element_type=jnp.float32)  # [tq, w]
            acc_ref[j] = alpha * acc_ref[j] + pv
            m_ref[j] = jnp.broadcast_to(m_next, (tq, LANES))
            l_ref[j] = jnp.broadcast_to(l_next, (tq, LANES))
        return carry

    # A dynamic trip count: no grid steps (or copies) at all for blocks past `need`.
    lax.fori_loop(first, steps, kv_block, 0)
    l = l_ref[...][:, :, :1]  # [hpb, tq, 1]
    o_ref[...] = (acc_ref[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)  # 0 for padding


@functools.partial(
    jax.jit,
    static_argnames=("scale", "interpret", "pages_per_block", "rows_per_block", "window", "softcap"),
)
def paged_attention(
    q: jax.Array,
    pages: jax.Array,
    block_tables: jax.Array,
    q_positions: jax.Array,
    kv_lens: jax.Array,
    *,
    scale: float,
    interpret: bool | None = None,
    pages_per_block: int | None = None,
    rows_per_block: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Causal attention of a [B, C] block of queries over each row's pages (see module doc),
    with `reference.paged_attention`'s static `window` and `softcap`.

    q: [B, C, Hq, hd]; pages: [num_pages, ps, 2*Hkv*hd] (lanes ordered (kv head, K|V, hd));
    block_tables: int32[B, P]; q_positions: int32[B, C]; kv_lens: int32[B].
    Returns [B, C, Hq, hd] in q's dtype.
    interpret=None: compile with Mosaic on TPU, interpret elsewhere (the kernel uses TPU-only
    scalar prefetch, which Triton / Mosaic-GPU do not lower). The engine's Backend passes it.
    """
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    reference.check_window(window, softcap)
    b, c, hq, hd = q.shape
    num_pages, ps, lanes = pages.shape
    hkv = lanes // (2 * hd)
    if lanes % (2 * hd) or hq % hkv:
        raise ValueError(
            f"q {q.shape} does not match pages {pages.shape} (need lanes = 2*Hkv*hd, Hq % Hkv == 0)"
        )
    p_cols = block_tables.shape[1]
    g = hq // hkv
    hpb = _heads_per_block(hkv, hd)
    ppb = min(pages_per_block or max(1, KEYS_PER_STEP // ps), p_cols)
    split = hd % LANES == 0
    w = hd if split else 2 * hd  # lanes of a q / out row (see _kernel)

    # Query rows per kv head, ordered (c, g): [B, Hkv, R_pad, w], R = C*G padded to tq.
    sub = 8 * max(1, 4 // q.dtype.itemsize)  # sublane tile: 8 rows for 32-bit, 16 for 16-bit
    r = c * g
    tq = min(rows_per_block or MAX_ROWS, _cdiv(r, sub) * sub)
    tq = _cdiv(tq, sub) * sub
    nq = _cdiv(r, tq)
    r_pad = nq * tq
    qr = q.reshape(b, c, hkv, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, hkv, r, hd)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, r_pad - r), (0, w - hd)))  # zero V half when not split
    row_pos = jnp.repeat(q_positions.astype(jnp.int32), g, axis=1)  # [B, R]
    row_pos = jnp.pad(row_pos, ((0, 0), (0, r_pad - r)), constant_values=-1)  # [B, R_pad]

    # Keys each query block can see: min(kv_len, last query position in the block + 1).
    lens = jnp.clip(kv_lens.astype(jnp.int32), 0, p_cols * ps)  # keys past P pages do not exist
    need = jnp.minimum(lens[:, None], row_pos.reshape(b, nq, tq).max(axis=2) + 1)  # [B, nq]
    need = jnp.maximum(need, 0).reshape(-1)
    if window is None:
        lo = jnp.zeros_like(need)
    else:  # the least window start of the block's real rows (padding rows, position -1, see nothing)
        starts = jnp.where(row_pos >= 0, row_pos - window + 1, jnp.iinfo(jnp.int32).max)
        lo = jnp.clip(starts.reshape(b, nq, tq).min(axis=2).reshape(-1), 0, need)
    tables = jnp.clip(block_tables.astype(jnp.int32), 0, num_pages - 1).reshape(-1)  # [B*P]

    q_spec = pl.BlockSpec((None, hpb, tq, w), lambda bi, hi, qi, *_: (bi, hi, qi, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, hkv // hpb, nq),
        in_specs=[
            q_spec,
            pl.BlockSpec((None, tq, 1), lambda bi, hi, qi, *_: (bi, qi, 0)),
            pl.BlockSpec(memory_space=pl.ANY),  # pages: copied page by page by the kernel
        ],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((2, ppb, ps, 2 * hpb * hd), pages.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((hpb, tq, LANES), jnp.float32),
            pltpu.VMEM((hpb, tq, LANES), jnp.float32),
            pltpu.VMEM((hpb, tq, w), jnp.float32),
        ],
    )
    keys = p_cols * ps if window is None else min(p_cols * ps, (_cdiv(window + c, ps) + 1) * ps)
    kv_bytes = b * nq * keys * lanes * pages.dtype.itemsize  # upper bound (P bucket, or the window)
    if not interpret:
        # The pool stays in HBM. Left to XLA, a layer's buffer small enough for VMEM (a 27B
        # model's ~19 MB a chip) is prefetched there whole for the KV write and this call and
        # evicted back after: two copies of the pool per layer, where the kernel reads a few pages.
        pages = pltpu.with_memory_space_constraint(pages, pltpu.HBM)
    out = pl.pallas_call(
        functools.partial(_kernel, p_cols=p_cols, nq=nq, hd=hd, scale=scale, window=window, softcap=softcap),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        cost_estimate=pl.CostEstimate(
            flops=4 * b * hkv * r_pad * keys * w,
            transcendentals=b * hkv * r_pad * keys,
            bytes_accessed=kv_bytes + 2 * qr.size * q.dtype.itemsize,
        ),
        interpret=interpret,
        name="hotswap_paged_attention",
    )(tables, need, lo, qr, row_pos[:, :, None], pages)
    out = out[:, :, :r, w - hd :].reshape(b, hkv, c, g, hd).transpose(0, 2, 1, 3, 4)  # V half
    return out.reshape(b, c, hq, hd)

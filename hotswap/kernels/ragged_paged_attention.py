"""Pallas paged attention over the interleaved KV pages: decode batches and prefill chunks.

Same signature and semantics as `reference.paged_attention` (the oracle in tests).

Grid `(B, kv-head blocks, query blocks)`, all parallel. Inside, a `fori_loop` with a dynamic
trip count runs the online-softmax reduction over kv blocks of `ppb` pages (`T = ppb * page_size`
keys each); a grid axis for it would cost a (no-op) grid step for every block past the real
length in every row of a bucketed batch.

- **KV is read page by page through the block table.** `pages` stays in HBM (`pl.ANY`); the
  kernel DMAs the `ppb` pages of kv block `ki` (ids from the scalar-prefetched table) into a
  double-buffered VMEM slot, starting block `ki+1` before computing on block `ki`. No gather
  ever materialises `[B, L, ...]`, and each page is one contiguous `[ps, 2*hpb, hd]` copy.
  (Not one BlockSpec/index_map operand per page: Pallas' CPU interpreter then copies the whole
  pool every grid step; a toy kernel took 5 s for 64 steps over a 268 MB input, 0.2 ms with
  pl.ANY + DMA. The same DMA pattern as jax's own TPU paged-attention kernels.)
- **Pages past what a query block can see are never fetched.** `need[b, qi]` (scalar prefetch)
  is `min(kv_len, max q position in the block + 1)`; only `cdiv(need, ps)` pages are copied
  and the loop runs `cdiv(need, T)` times, so decode cost follows the real length, not the P
  bucket. Padding rows (kv_len 0) copy and compute nothing and write zeros.
- **GQA.** The wrapper lays queries out per kv head as `[B, Hkv, C*G, hd]` (rows ordered
  (c, g)), so the G q heads of a kv head form one `[rows, hd] x [hd, T]` matmul.
- **Masking.** key j is visible to row p iff `j <= p` and `j < kv_len`. Scores are masked with
  -inf (not a finite "mask value", which would average garbage into fully-masked rows) and V rows
  with `j >= need` are zeroed with `where`, so NaN in unused pages (or stale buffer slots)
  cannot leak into `p @ V`.

Alignment for Mosaic, by construction (last two block dims either equal the array's or are
multiples of (8, 128)):
- q / out `[B, Hkv, R_pad, hd]` blocks `(., hpb, tq, hd)`: `tq` is a multiple of 8 (16 for
  16-bit dtypes); the wrapper pads rows `C*G` up to a multiple of `tq` (padded rows get position
  -1: they see nothing and are sliced off). hd is the full dim.
- row positions `[B, R_pad, 1]` blocks `(., tq, 1)`: 1 is the full dim.
- pages are not blocked (pl.ANY); the VMEM page buffer `[2, ppb, ps, 2*hpb, hd]` ends in
  `(2*hpb, hd)`: `2*hpb` is a multiple of 8 or the full `2*Hkv`, hd the full dim.
- m / l scratch `[hpb, tq, 128]` (lane-replicated, as jax's TPU flash kernels do).
head_dim is deliberately *not* padded to 128: padding `pages` in the wrapper would copy the whole
cache every layer of every step. A full-dim hd satisfies the block rule; if Mosaic ever needs a
128-multiple there, allocate the cache padded (engine/state.py), never pad it here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
MAX_ROWS = 256  # query rows (C*G) per block: bounds the q/acc/m/l blocks and [tq, T] tile in VMEM
KEYS_PER_STEP = 256  # target T = ppb * page_size keys per reduction step


def _cdiv(a, b):
    return (a + b - 1) // b


def _heads_per_block(hkv: int) -> int:
    """kv heads per grid step: all of them when the combined K/V axis is small, else a block whose
    2*hpb rows are a multiple of 8 (the TPU sublane tile)."""
    if 2 * hkv <= 16:
        return hkv
    for d in (8, 4):
        if hkv % d == 0:
            return d
    return hkv


def _kernel(
    bt_ref,  # SMEM int32[B*P]: flattened block tables (clipped to valid page ids)
    need_ref,  # SMEM int32[B*nq]: keys each (row, query block) can see: min(kv_len, max pos + 1)
    q_ref,  # [hpb, tq, hd]
    pos_ref,  # [tq, 1] int32 absolute position per query row (-1 for padding rows)
    pages_hbm,  # [num_pages, ps, 2*Hkv, hd], left in HBM (pl.ANY)
    o_ref,  # [hpb, tq, hd]
    buf,  # VMEM [2, ppb, ps, 2*hpb, hd]: double-buffered pages
    sem,  # DMA semaphores [2], one per buffer slot
    m_ref,  # [hpb, tq, 128] running max (lane-replicated)
    l_ref,  # [hpb, tq, 128] running sum
    acc_ref,  # [hpb, tq, hd] unnormalised output
    *,
    p_cols: int,
    nq: int,
    scale: float,
):
    b, h, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hpb, tq, hd = q_ref.shape
    _, ppb, ps, two_hpb, _ = buf.shape
    t = ppb * ps  # keys per kv block
    need = need_ref[b * nq + qi]
    # lax.div/rem, not // and %: these are non-negative, and jnp's floor semantics need `sign`,
    # which Mosaic lowers only with a TPU attached.
    steps = lax.div(need + t - 1, t)  # kv blocks to visit; 0 for padding rows
    n_pages = lax.div(need + ps - 1, ps)

    def for_each_page(kb, slot, action):
        """Start or wait the DMA of every needed page of kv block `kb`. The same trip count both
        ways, so each started copy is waited exactly once; pages past `need` are never fetched."""

        def body(j, carry):
            page = bt_ref[b * p_cols + kb * ppb + j]
            src = pages_hbm.at[page, :, pl.ds(h * two_hpb, two_hpb), :]  # [ps, 2*hpb, hd]
            action(pltpu.make_async_copy(src, buf.at[slot, j], sem.at[slot]))
            return carry

        lax.fori_loop(0, jnp.minimum(ppb, n_pages - kb * ppb), body, 0)

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(steps > 0)
    def _():
        for_each_page(0, 0, lambda c: c.start())

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
        v_ok = ki * t + lax.broadcasted_iota(jnp.int32, (t, 1), 0) < need  # [T, 1]
        for j in range(hpb):  # static: each kv head of the block, its G q heads together
            k = buf[slot, :, :, 2 * j, :].reshape(t, hd).astype(jnp.float32)  # [T, hd]
            v = buf[slot, :, :, 2 * j + 1, :].reshape(t, hd).astype(jnp.float32)
            v = jnp.where(v_ok, v, 0.0)  # unused pages / unfetched slots may hold NaN; 0 * NaN = NaN
            q = q_ref[j].astype(jnp.float32)  # [tq, hd]
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s = jnp.where(visible, s * scale, -jnp.inf)  # [tq, T]
            m_prev = m_ref[j][:, :1]  # [tq, 1]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows that have seen nothing yet
            alpha = jnp.exp(m_prev - m_safe)
            p = jnp.exp(s - m_safe)  # masked -> exp(-inf) = 0
            l_next = alpha * l_ref[j][:, :1] + jnp.sum(p, axis=1, keepdims=True)
            pv = jnp.dot(p, v, preferred_element_type=jnp.float32)  # [tq, hd]
            acc_ref[j] = alpha * acc_ref[j] + pv
            m_ref[j] = jnp.broadcast_to(m_next, (tq, LANES))
            l_ref[j] = jnp.broadcast_to(l_next, (tq, LANES))
        return carry

    # A dynamic trip count: no grid steps (or copies) at all for blocks past `need`.
    lax.fori_loop(0, steps, kv_block, 0)
    l = l_ref[...][:, :, :1]  # [hpb, tq, 1]
    o_ref[...] = (acc_ref[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)  # 0 for padding


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "pages_per_block", "rows_per_block"))
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
) -> jax.Array:
    """Causal attention of a [B, C] block of queries over each row's pages (see module doc).

    q: [B, C, Hq, hd]; pages: [num_pages, ps, 2*Hkv, hd]; block_tables: int32[B, P];
    q_positions: int32[B, C]; kv_lens: int32[B]. Returns [B, C, Hq, hd] in q's dtype.
    interpret=None: compile with Mosaic on TPU, interpret elsewhere (the kernel uses TPU-only
    scalar prefetch, which Triton / Mosaic-GPU do not lower).
    """
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    b, c, hq, hd = q.shape
    num_pages, ps, two_hkv, hd_k = pages.shape
    hkv = two_hkv // 2
    if hd_k != hd or two_hkv % 2 or hq % hkv:
        raise ValueError(f"q {q.shape} does not match pages {pages.shape} (need Hq % Hkv == 0, equal hd)")
    p_cols = block_tables.shape[1]
    g = hq // hkv
    hpb = _heads_per_block(hkv)
    ppb = min(pages_per_block or max(1, KEYS_PER_STEP // ps), p_cols)

    # Query rows per kv head, ordered (c, g): [B, Hkv, R_pad, hd], R = C*G padded to tq.
    sub = 8 * max(1, 4 // q.dtype.itemsize)  # sublane tile: 8 rows for 32-bit, 16 for 16-bit
    r = c * g
    tq = min(rows_per_block or MAX_ROWS, _cdiv(r, sub) * sub)
    tq = _cdiv(tq, sub) * sub
    nq = _cdiv(r, tq)
    r_pad = nq * tq
    qr = q.reshape(b, c, hkv, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, hkv, r, hd)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, r_pad - r), (0, 0)))
    row_pos = jnp.repeat(q_positions.astype(jnp.int32), g, axis=1)  # [B, R]
    row_pos = jnp.pad(row_pos, ((0, 0), (0, r_pad - r)), constant_values=-1)  # [B, R_pad]

    # Keys each query block can see: min(kv_len, last query position in the block + 1).
    lens = jnp.clip(kv_lens.astype(jnp.int32), 0, p_cols * ps)  # keys past P pages do not exist
    need = jnp.minimum(lens[:, None], row_pos.reshape(b, nq, tq).max(axis=2) + 1)  # [B, nq]
    need = jnp.maximum(need, 0).reshape(-1)
    tables = jnp.clip(block_tables.astype(jnp.int32), 0, num_pages - 1).reshape(-1)  # [B*P]

    q_spec = pl.BlockSpec((None, hpb, tq, hd), lambda bi, hi, qi, *_: (bi, hi, qi, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, hkv // hpb, nq),
        in_specs=[
            q_spec,
            pl.BlockSpec((None, tq, 1), lambda bi, hi, qi, *_: (bi, qi, 0)),
            pl.BlockSpec(memory_space=pl.ANY),  # pages: copied page by page by the kernel
        ],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((2, ppb, ps, 2 * hpb, hd), pages.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((hpb, tq, LANES), jnp.float32),
            pltpu.VMEM((hpb, tq, LANES), jnp.float32),
            pltpu.VMEM((hpb, tq, hd), jnp.float32),
        ],
    )
    kv_bytes = b * nq * p_cols * ps * two_hkv * hd * pages.dtype.itemsize  # upper bound (P bucket)
    out = pl.pallas_call(
        functools.partial(_kernel, p_cols=p_cols, nq=nq, scale=scale),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        cost_estimate=pl.CostEstimate(
            flops=4 * b * hkv * r_pad * p_cols * ps * hd,
            transcendentals=b * hkv * r_pad * p_cols * ps,
            bytes_accessed=kv_bytes + 2 * qr.size * q.dtype.itemsize,
        ),
        interpret=interpret,
        name="hotswap_paged_attention",
    )(tables, need, qr, row_pos[:, :, None], pages)
    out = out[:, :, :r].reshape(b, hkv, c, g, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, c, hq, hd)

"""Pallas paged attention over the interleaved KV pages: decode batches and prefill chunks.

Same signature and semantics as `reference.paged_attention` (the oracle in tests).

Grid `(B, kv-head blocks, query blocks, kv blocks)`; the last axis is the online-softmax
reduction over `ppb` pages (`T = ppb * page_size` keys) per step.

- **KV is read page by page through the block table.** The `pages` buffer is passed `ppb`
  times; operand j's index_map looks up page `ki * ppb + j` of the row in the scalar-prefetched
  block table, so each step DMAs `ppb` whole pages and no gather ever materialises `[B, L, ...]`.
- **Pages past what a query block can see are skipped.** `steps[b, qi]` (scalar prefetch) is
  the number of kv blocks holding keys `< min(kv_len, max q position in the block + 1)`. Later
  steps do no compute (`pl.when`), and their index_map repeats the last needed page, so the
  pipeline issues no copy either: decode cost follows the real length, not the P bucket.
- **GQA.** The wrapper lays queries out per kv head as `[B, Hkv, C*G, hd]` (rows ordered
  (c, g)), so the G q heads of a kv head form one `[rows, hd] x [hd, T]` matmul.
- **Masking.** key j is visible to row p iff `j <= p` and `j < kv_len`. Scores are masked with
  -inf (not a finite "mask value", which would average garbage into fully-masked rows) and V rows
  with `j >= kv_len` are zeroed with `where`, so NaN in unused pages cannot leak into `p @ V`.

Alignment for Mosaic, by construction (last two block dims either equal the array's or are
multiples of (8, 128)):
- q / out `[B, Hkv, R_pad, hd]` blocks `(., hpb, tq, hd)`: `tq` is a multiple of 8 (16 for
  16-bit dtypes); the wrapper pads rows `C*G` up to a multiple of `tq` (padded rows get position
  -1: they see nothing and are sliced off). hd is the full dim.
- row positions `[B, R_pad, 1]` blocks `(., tq, 1)`: 1 is the full dim.
- pages `[num_pages, ps, 2*Hkv, hd]` blocks `(., ps, 2*hpb, hd)`: `2*hpb` is a multiple of 8
  or the full `2*Hkv`; hd is the full dim.
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
MAX_ROWS = 512  # query rows (C*G) per block: bounds the [tq, T] score tile in VMEM
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
    lens_ref,  # SMEM int32[B]: kv lengths (clipped to P*page_size)
    steps_ref,  # SMEM int32[B*nq]: kv blocks needed per (row, query block)
    q_ref,  # [hpb, tq, hd]
    pos_ref,  # [tq, 1] int32 absolute position per query row (-1 for padding rows)
    *refs,  # ppb page refs [ps, 2*hpb, hd], out [hpb, tq, hd], scratch m, l [hpb, tq, 128], acc [hpb, tq, hd]
    ppb: int,
    nq: int,
    scale: float,
):
    page_refs, (o_ref, m_ref, l_ref, acc_ref) = refs[:ppb], refs[ppb:]
    b, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    hpb, tq, hd = q_ref.shape
    ps = page_refs[0].shape[0]
    t = ppb * ps

    @pl.when(ki == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(ki < steps_ref[b * nq + qi])
    def _step():
        kv_len = lens_ref[b]
        key_pos = ki * t + lax.broadcasted_iota(jnp.int32, (1, t), 1)  # [1, T]
        visible = (key_pos <= pos_ref[...]) & (key_pos < kv_len)  # [tq, T]
        v_ok = ki * t + lax.broadcasted_iota(jnp.int32, (t, 1), 0) < kv_len  # [T, 1]
        for j in range(hpb):  # static: each kv head of the block, its G q heads together
            k = jnp.concatenate([r[:, 2 * j, :] for r in page_refs], axis=0).astype(jnp.float32)  # [T, hd]
            v = jnp.concatenate([r[:, 2 * j + 1, :] for r in page_refs], axis=0).astype(jnp.float32)
            v = jnp.where(v_ok, v, 0.0)  # unused pages may hold NaN
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

    @pl.when(ki == pl.num_programs(3) - 1)
    def _finish():
        l = l_ref[...][:, :, :1]  # [hpb, tq, 1]
        o_ref[...] = (acc_ref[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)  # 0 for padding


@functools.partial(
    jax.jit, static_argnames=("scale", "interpret", "pages_per_block", "rows_per_block")
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
    t = ppb * ps
    nk = _cdiv(p_cols, ppb)

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

    # Keys each query block needs: min(kv_len, last visible position + 1) -> kv blocks (steps).
    lens = jnp.clip(kv_lens.astype(jnp.int32), 0, p_cols * ps)  # keys past P pages do not exist
    need = jnp.minimum(lens[:, None], row_pos.reshape(b, nq, tq).max(axis=2) + 1)  # [B, nq]
    steps = _cdiv(jnp.maximum(need, 0), t).astype(jnp.int32).reshape(-1)
    tables = jnp.clip(block_tables.astype(jnp.int32), 0, num_pages - 1).reshape(-1)  # [B*P]

    def page_map(j):
        def index_map(bi, hi, qi, ki, bt_ref, lens_ref, steps_ref):
            # Past the last needed block, repeat it: same block index -> the pipeline skips the copy.
            kb = jnp.maximum(jnp.minimum(ki, steps_ref[bi * nq + qi] - 1), 0)
            col = jnp.minimum(kb * ppb + j, p_cols - 1)
            return bt_ref[bi * p_cols + col], 0, hi, 0

        return index_map

    q_spec = pl.BlockSpec((None, hpb, tq, hd), lambda bi, hi, qi, ki, *_: (bi, hi, qi, 0))
    page_specs = [pl.BlockSpec((None, ps, 2 * hpb, hd), page_map(j)) for j in range(ppb)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, hkv // hpb, nq, nk),
        in_specs=[
            q_spec,
            pl.BlockSpec((None, tq, 1), lambda bi, hi, qi, ki, *_: (bi, qi, 0)),
            *page_specs,
        ],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((hpb, tq, LANES), jnp.float32),  # running max m
            pltpu.VMEM((hpb, tq, LANES), jnp.float32),  # running sum l
            pltpu.VMEM((hpb, tq, hd), jnp.float32),  # unnormalised output acc
        ],
    )
    kv_bytes = b * nq * p_cols * ps * two_hkv * hd * pages.dtype.itemsize  # upper bound (P bucket)
    out = pl.pallas_call(
        functools.partial(_kernel, ppb=ppb, nq=nq, scale=scale),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        cost_estimate=pl.CostEstimate(
            flops=4 * b * hkv * r_pad * p_cols * ps * hd,
            transcendentals=b * hkv * r_pad * p_cols * ps,
            bytes_accessed=kv_bytes + 2 * qr.size * q.dtype.itemsize,
        ),
        interpret=interpret,
        name="hotswap_paged_attention",
    )(tables, lens, steps, qr, row_pos[:, :, None], *([pages] * ppb))
    out = out[:, :, :r].reshape(b, hkv, c, g, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, c, hq, hd)

"""The CPU attention paths the engine runs, against write-then-read `reference.paged_attention`.

The C++ kernel (attention="cpu", the CPU default) has the same read-then-write semantics
and is checked against the same oracle, over the same NaN-filled pages, in f32 and bf16.

The engine's reference steps never read pages they are writing: a decode batch reads a flat
list of the pages each row uses (`decode_attention`), and a packed prefill reads the pages
cached before each chunk plus the step's own K/V (`prefill_attention`). Both are laid
out by the runner's own host code here, over pages where every slot no row may read is NaN.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hotswap.engine.pages import PagePool
from hotswap.engine.runner import Runner
from hotswap.engine.sampling import SamplingParams
from hotswap.engine.sequence import Sequence
from hotswap.engine_config import EngineConfig
from hotswap.kernels import reference
from hotswap.kernels.backend import Backend
from hotswap.programs.step import PREFILL_ROW

PS, HKV, G, HD, SCALE = 16, 2, 3, 32, 0.3
REFERENCE = Backend("reference", "cpu")  # the layout and page lists the runner builds for it


def _seq(i: int, length: int) -> Sequence:
    return Sequence(i, f"r{i}", 0, list(range(1, length + 1)), SamplingParams(), 0, i)


def _world(rng, ends: list[int], computed: list[int], hd: int = HD, ps: int = PS):
    """Pages holding `computed[i]` cached tokens per sequence (NaN everywhere else) and tables
    reaching `ends[i]` tokens, drawn from a shuffled pool. Returns (pages, seqs, tables by seq id)."""
    need = [-(-e // ps) for e in ends]
    num_pages = sum(need) + 4
    pool = rng.permutation(np.arange(1, num_pages)).tolist()
    pages = np.full((num_pages, ps, 2 * HKV, hd), np.nan, np.float32)
    seqs, tables = [], {}
    for i, (k, c) in enumerate(zip(need, computed, strict=True)):
        table, pool = pool[:k], pool[k:]
        for pos in range(c):
            pages[table[pos // ps], pos % ps] = rng.standard_normal((2 * HKV, hd))
        seq = _seq(i, ends[i])
        seq.num_computed = c
        seqs.append(seq)
        tables[seq.seq_id] = table
    return pages, seqs, tables


def _oracle(pages, seq, table, q, k, v, n):
    """Write the chunk's K/V into a copy of the pages, then plain paged attention for one sequence."""
    pages = pages.copy()
    start, ps = seq.num_computed, pages.shape[1]
    for j in range(n):
        pos = start + j
        slot = pages[table[pos // ps], pos % ps]
        slot[0::2], slot[1::2] = k[j], v[j]
    table = np.asarray(table, np.int32)[None]
    positions = np.arange(start, start + n, dtype=np.int32)[None]
    out = reference.paged_attention(
        jnp.asarray(q[None]),
        jnp.asarray(pages),
        table,
        positions,
        np.array([start + n], np.int32),
        scale=SCALE,
    )
    return np.asarray(out[0])


def test_decode_reads_each_rows_pages_only():
    rng = np.random.default_rng(0)
    cached = [0, 1, PS - 1, PS, PS + 1, 70, 5]  # 0: a one-token prompt's first sample
    pages, seqs, tables = _world(rng, [c + 1 for c in cached], cached)
    ecfg = EngineConfig(
        page_size=PS, num_pages=len(pages), max_model_len=128, max_num_seqs=8, attention="reference"
    )
    batch = Runner(None, ecfg, REFERENCE).decode_batch(seqs, PagePool.owning(len(pages), tables))
    b = batch.tokens.shape[0]
    q = rng.standard_normal((b, 1, HKV * G, HD)).astype(np.float32)
    k = rng.standard_normal((b, 1, HKV, HD)).astype(np.float32)
    v = rng.standard_normal((b, 1, HKV, HD)).astype(np.float32)
    out = reference.decode_attention(
        q,
        jnp.asarray(pages),
        k,
        v,
        batch.page_ids,
        batch.page_rows,
        batch.page_cols,
        batch.chunk_starts,
        scale=SCALE,
    )
    out = np.asarray(out)
    assert np.isfinite(out).all(), "NaN leaked from a page slot no row may read"
    for i, seq in enumerate(seqs):
        want = _oracle(pages, seq, tables[seq.seq_id], q[i], k[i], v[i], 1)
        np.testing.assert_allclose(out[i], want, atol=1e-5, rtol=0)


def test_packed_prefill_keeps_sequences_apart():
    """Four chunks in one call: fresh, continuing after 21 cached tokens, one of 1 token, and
    one of 40 tokens (3 rows) over 70 cached; each attends to its own cached keys and its own
    chunk only."""
    rng = np.random.default_rng(1)
    chunks = [(0, 37), (21, 16), (40, 1), (70, 40)]  # (cached, new)
    pages, seqs, tables = _world(rng, [c + n for c, n in chunks], [c for c, _ in chunks])
    ecfg = EngineConfig(
        page_size=PS,
        num_pages=len(pages),
        max_model_len=256,
        max_num_batched_tokens=128,
        attention="reference",
    )
    rows = [(s, n) for s, (_, n) in zip(seqs, chunks, strict=True)]
    batch = Runner(None, ecfg, REFERENCE).prefill_batch(rows, PagePool.owning(len(pages), tables))
    nb = batch.tokens.shape[0]
    assert batch.tokens.shape[1] == PREFILL_ROW and nb >= 3 + 1 + 1 + 3
    assert int((batch.page_rows < nb).sum()) == 2 + 3 + 5  # each sequence's cached pages listed once
    q = rng.standard_normal((nb, PREFILL_ROW, HKV * G, HD)).astype(np.float32)
    k = rng.standard_normal((nb, PREFILL_ROW, HKV, HD)).astype(np.float32)
    v = rng.standard_normal((nb, PREFILL_ROW, HKV, HD)).astype(np.float32)
    out = reference.prefill_attention(
        q,
        jnp.asarray(pages),
        k,
        v,
        batch.page_ids,
        batch.page_rows,
        batch.page_cols,
        batch.positions,
        batch.kv_lens,
        batch.chunk_starts,
        batch.segments,
        scale=SCALE,
    )
    out = np.asarray(out).reshape(nb * PREFILL_ROW, HKV * G, HD)
    flat = lambda a: a.reshape(nb * PREFILL_ROW, *a.shape[2:])  # noqa: E731
    for r, (seq, n) in enumerate(rows):
        first = int(batch.sample_idx[r]) - n + 1  # the chunk's first token in the flat layout
        sl = slice(first, first + n)
        want = _oracle(pages, seq, tables[seq.seq_id], flat(q)[sl], flat(k)[sl], flat(v)[sl], n)
        np.testing.assert_allclose(out[sl], want, atol=1e-5, rtol=0)


def _cpu_step(rows, tables, pages, ecfg, rng, decode: bool, dtype=np.float32, page_dtype=None, g: int = G):
    """The C++ kernel over a batch the runner lays out for attention="cpu" (block tables), as
    the engine calls it: it also writes the step's K/V into its aliased page output, which
    must equal the reference's write (`reference.write_kv`), bit for bit."""
    from hotswap.kernels import cpu_attention

    runner = Runner(None, dataclasses.replace(ecfg, attention="cpu"), Backend("cpu", "cpu"))
    batch = runner.ragged_batch(
        rows, PagePool.owning(len(pages), tables)
    )  # [T, 1]: decode rows are chunks of one token
    b, c = batch.tokens.shape
    assert batch.block_tables.shape[1] == ecfg.pages_per_seq  # one full-width table per shape
    hd = pages.shape[-1]
    q, k, v = (rng.standard_normal((b, c, h, hd)).astype(np.float32) for h in (HKV * g, HKV, HKV))
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    pages_in = jnp.asarray(pages, page_dtype or dtype)
    out, written = cpu_attention.paged_attention(
        cast(q),
        pages_in,
        cast(k),
        cast(v),
        batch.block_tables,
        batch.positions,
        batch.chunk_starts,
        batch.kv_lens,
        scale=SCALE,
        slots=batch.slots,
    )
    want = reference.write_kv(pages_in, cast(k), cast(v), jnp.asarray(batch.slots))
    same = (np.asarray(written) == np.asarray(want)) | (np.isnan(np.asarray(want, np.float32)))
    assert same.all(), "the kernel's K/V write differs from reference.write_kv"
    flat = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)).reshape(b * c, *a.shape[2:])  # noqa: E731
    return batch, flat(out), flat(q), flat(k), flat(v)


# head_dim 64 and 128 take the AVX-512 path where the CPU has it, others the plain loops;
# a 32-slot page folds its keys 16 at a time there.
SHAPES = [(np.float32, 32, PS), (np.float32, 64, PS), (np.float32, 128, PS), (np.float32, 64, 32)]
SHAPES += [(jnp.bfloat16, 32, PS), (jnp.bfloat16, 64, PS)]


@pytest.mark.parametrize("dtype,hd,ps", SHAPES)
def test_cpu_kernel_decode(dtype, hd, ps):
    rng = np.random.default_rng(2)
    cached = [0, 1, ps - 1, ps, ps + 1, 70, 5]
    pages, seqs, tables = _world(rng, [c + 1 for c in cached], cached, hd, ps)
    ecfg = EngineConfig(page_size=ps, num_pages=len(pages), max_model_len=128, max_num_seqs=8)
    batch, out, q, k, v = _cpu_step(
        [(s, 1) for s in seqs], tables, pages, ecfg, rng, decode=True, dtype=dtype
    )
    assert np.isfinite(out).all(), "NaN leaked from a page slot no row may read"
    assert not out[len(seqs) :].any(), "padding rows must come back as zeros"
    pages32 = np.asarray(jnp.asarray(pages, dtype).astype(jnp.float32))
    tol = 1e-5 if dtype == np.float32 else 2e-2
    for i, seq in enumerate(seqs):
        want = _oracle(pages32, seq, tables[seq.seq_id], q[i : i + 1], k[i : i + 1], v[i : i + 1], 1)
        np.testing.assert_allclose(out[i : i + 1], want, atol=tol, rtol=0)


# A ragged step ([T, 1], what the engine runs on this backend): chunks of many queries, of one
# (a decode row among them), after cached prefixes or none.
@pytest.mark.parametrize(
    "dtype,hd,ps",
    [(np.float32, 32, PS), (np.float32, 64, PS), (np.float32, 64, 32), (np.float32, 128, PS)]
    + [(jnp.bfloat16, 64, PS), (jnp.bfloat16, 128, 32)],
)
def test_cpu_kernel_packed_prefill(dtype, hd, ps):
    _check_ragged_step(dtype, hd, ps, G)


# The kernel folds up to 4 (head_dim 64) or 2 (128) q heads of a kv head at once: group sizes
# that fill those, leave a remainder, or are a single head (no GQA).
@pytest.mark.parametrize("hd,g", [(64, 1), (64, 5), (64, 7), (128, 4)])  # 1, odd, even, a 128-wide head
def test_cpu_kernel_any_number_of_q_heads_per_kv_head(hd, g):
    _check_ragged_step(np.float32, hd, PS, g)


def _check_ragged_step(dtype, hd, ps, g):
    """Chunks of many queries (runs of consecutive queries share each key block), of one, and
    a decode row, after cached prefixes or none: every query equals the per-sequence oracle."""
    rng = np.random.default_rng(3)
    chunks = [(0, 37), (21, 16), (40, 1), (70, 40), (5, 3)]
    pages, seqs, tables = _world(rng, [c + n for c, n in chunks], [c for c, _ in chunks], hd, ps)
    ecfg = EngineConfig(page_size=ps, num_pages=len(pages), max_model_len=256, max_num_batched_tokens=128)
    rows = [(s, n) for s, (_, n) in zip(seqs, chunks, strict=True)]
    batch, out, q, k, v = _cpu_step(rows, tables, pages, ecfg, rng, decode=False, dtype=dtype, g=g)
    assert np.isfinite(out).all()
    pages32 = np.asarray(jnp.asarray(pages, dtype).astype(jnp.float32))
    tol = 1e-5 if dtype == np.float32 else 2e-2
    real = np.zeros(len(out), bool)
    for r, (seq, n) in enumerate(rows):
        first = int(batch.sample_idx[r]) - n + 1
        sl = slice(first, first + n)
        real[sl] = True
        want = _oracle(pages32, seq, tables[seq.seq_id], q[sl], k[sl], v[sl], n)
        np.testing.assert_allclose(out[sl], want, atol=tol, rtol=0)
    assert not out[~real].any(), "padding slots must come back as zeros"


def test_cpu_kernel_writes_f32_activations_into_bf16_pages_as_xla_converts():
    """Rounding to the page dtype in the kernel's write is XLA's convert (nearest even)."""
    rng = np.random.default_rng(4)
    cached = [3, 17, 40]
    pages, seqs, tables = _world(rng, [c + 1 for c in cached], cached)
    ecfg = EngineConfig(page_size=PS, num_pages=len(pages), max_model_len=128, max_num_seqs=4)
    _cpu_step([(s, 1) for s in seqs], tables, pages, ecfg, rng, decode=True, page_dtype=jnp.bfloat16)


def test_cpu_kernel_rejects_a_slot_outside_the_cache():
    from hotswap.kernels import cpu_attention

    pages = np.zeros((4, PS, 2 * HKV, HD), np.float32)
    q = np.zeros((1, 1, HKV * G, HD), np.float32)
    kv = np.zeros((1, 1, HKV, HD), np.float32)
    with pytest.raises(Exception, match="slot lies outside the cache"):
        out = cpu_attention.paged_attention(
            q,
            pages,
            kv,
            kv,
            np.array([[1, 0]], np.int32),
            np.array([[5]]),
            np.array([5]),
            np.array([6]),
            scale=SCALE,
            slots=np.array([[4 * PS]], np.int32),
        )
        jax.block_until_ready(out)


def test_cpu_kernel_rejects_a_page_outside_the_cache():
    from hotswap.kernels import cpu_attention

    pages = np.zeros((4, PS, 2 * HKV, HD), np.float32)
    q = np.zeros((1, 1, HKV * G, HD), np.float32)
    kv = np.zeros((1, 1, HKV, HD), np.float32)
    table = np.array([[9, 0]], np.int32)  # page 9 of 4
    with pytest.raises(Exception, match="outside the cache"):
        out = cpu_attention.paged_attention(
            q, pages, kv, kv, table, np.array([[5]]), np.array([5]), np.array([6]), scale=SCALE
        )
        jax.block_until_ready(out)

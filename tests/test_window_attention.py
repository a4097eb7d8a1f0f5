"""Sliding-window attention and logit softcapping (static per layer) in every attention path,
against a dense numpy oracle (float64, HF's semantics: a query at i sees key j iff j <= i and
i - j < window; softcap * tanh(s / softcap) on the scaled scores).

Windows shorter than the context, smaller than a page and spanning page boundaries; prefix
chunks; decode rows and prefill chunks in one ragged step; permuted page tables; every slot no
query may read NaN, and for the C++ kernel the table entries of pages wholly before every
window point outside the cache (a read of one is an error): such pages are skipped, not masked.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hotswap.config import EngineConfig
from hotswap.engine.runner import Runner
from hotswap.engine.sampling import SamplingParams
from hotswap.engine.sequence import Sequence
from hotswap.kernels import ragged_paged_attention, reference
from hotswap.kernels.backend import Backend

PS, HKV, G, SCALE = 16, 2, 3, 0.3


def dense_oracle(k, v, q, positions, *, window, softcap, scale=SCALE):
    """k, v [L, Hkv, hd] (the sequence's keys by position); q [n, Hq, hd] at `positions`."""
    g = q.shape[1] // k.shape[1]
    out = np.zeros(q.shape)
    for i, p in enumerate(positions):
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(q.shape[1]):
            s = k[lo : p + 1, h // g].astype(np.float64) @ q[i, h].astype(np.float64) * scale
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ v[lo : p + 1, h // g]
    return out


@dataclasses.dataclass
class World:
    """Sequences with `cached` tokens in pages drawn from a shuffled pool (NaN in every slot that
    holds no token, and in cached slots wholly before the window of every query of the step), the
    step's new K/V and its queries."""

    pages: np.ndarray  # [num_pages, ps, 2*Hkv, hd]
    seqs: list[Sequence]
    tables: dict[int, list[int]]
    keys: list[np.ndarray]  # per sequence [cached + n, Hkv, hd]
    values: list[np.ndarray]
    dead: list[int]  # per sequence: table columns wholly before the window of its first query


def make_world(rng, chunks, *, hd, window, ps=PS):
    need = [-(-(c + n) // ps) for c, n in chunks]
    num_pages = sum(need) + 4
    pool = rng.permutation(np.arange(1, num_pages)).tolist()
    pages = np.full((num_pages, ps, 2 * HKV, hd), np.nan, np.float32)
    seqs, tables, keys, values, dead = [], {}, [], [], []
    for i, ((c, n), p) in enumerate(zip(chunks, need, strict=True)):
        table, pool = pool[:p], pool[p:]
        k = rng.standard_normal((c + n, HKV, hd)).astype(np.float32)
        v = rng.standard_normal((c + n, HKV, hd)).astype(np.float32)
        first = 0 if window is None else max(0, c - window + 1)  # the first key the chunk sees
        for pos in range(first, c):
            pages[table[pos // ps], pos % ps, 0::2] = k[pos]
            pages[table[pos // ps], pos % ps, 1::2] = v[pos]
        seq = Sequence(i, f"r{i}", 0, list(range(1, c + n + 1)), SamplingParams(), 0, i)
        seq.num_computed = c
        seqs.append(seq)
        tables[seq.seq_id] = table
        keys.append(k)
        values.append(v)
        dead.append(first // ps)
    return World(pages, seqs, tables, keys, values, dead)


def step_inputs(world, batch, rows, rng, g=G):
    """q, k_new, v_new laid out as the batch (flat [B*C]), with each chunk's K/V from the world."""
    b, c = batch.tokens.shape
    hd = world.pages.shape[-1]
    q = rng.standard_normal((b * c, HKV * g, hd)).astype(np.float32)
    k = np.zeros((b * c, HKV, hd), np.float32)
    v = np.zeros((b * c, HKV, hd), np.float32)
    firsts = []
    for r, (seq, n) in enumerate(rows):
        first = int(batch.sample_idx[r]) - n + 1
        k[first : first + n] = world.keys[r][seq.num_computed :]
        v[first : first + n] = world.values[r][seq.num_computed :]
        firsts.append(first)
    shape = lambda a: a.reshape(b, c, *a.shape[1:])  # noqa: E731
    return shape(q), shape(k), shape(v), firsts


def check_rows(out, q, world, rows, firsts, *, window, softcap, tol, zero_padding=False):
    out, q = out.reshape(-1, *out.shape[2:]), q.reshape(-1, *q.shape[2:])
    assert np.isfinite(out).all(), "NaN leaked from a slot no query may read"
    real = np.zeros(len(out), bool)
    for r, (seq, n) in enumerate(rows):
        sl = slice(firsts[r], firsts[r] + n)
        real[sl] = True
        positions = np.arange(seq.num_computed, seq.num_computed + n)
        want = dense_oracle(world.keys[r], world.values[r], q[sl], positions, window=window, softcap=softcap)
        np.testing.assert_allclose(out[sl], want, atol=tol, rtol=0)
    if zero_padding:  # the C++ kernel's promise (the jnp steps' padding rows are sliced off)
        assert not out[~real].any(), "padding queries must come back as zeros"


# (window, softcap): a window under a page, one spanning pages, one longer than any context.
WINDOWS = [(5, None), (23, 30.0), (None, 4.0), (300, None)]
# (cached, new): fresh, a prefix chunk, a decode row (chunk of one), lengths around a page.
CHUNKS = [(0, 37), (21, 16), (40, 1), (70, 40), (PS - 1, 1), (PS, 2), (0, 1)]


@pytest.mark.parametrize("window,softcap", WINDOWS)
def test_reference_prefill_and_decode(window, softcap):
    rng = np.random.default_rng(0)
    hd = 32
    world = make_world(rng, CHUNKS, hd=hd, window=window)
    ecfg = EngineConfig(
        page_size=PS, num_pages=len(world.pages), max_model_len=256, max_num_batched_tokens=256,
        max_num_seqs=8, attention="reference",
    )  # fmt: skip
    runner = Runner(None, ecfg, Backend("reference", "cpu"))
    pages = jnp.asarray(world.pages)
    kw = dict(scale=SCALE, window=window, softcap=softcap)
    rows = [(s, n) for s, (_, n) in zip(world.seqs, CHUNKS, strict=True)]
    batch = runner.prefill_batch(rows, world.tables)
    q, k, v, firsts = step_inputs(world, batch, rows, rng)
    out = reference.prefill_attention(
        q, pages, k, v, batch.page_ids, batch.page_rows, batch.page_cols, batch.positions,
        batch.kv_lens, batch.chunk_starts, batch.segments, **kw,
    )  # fmt: skip
    check_rows(np.asarray(out), q, world, rows, firsts, window=window, softcap=softcap, tol=1e-5)

    decode = [(s, n) for s, n in rows if n == 1]
    batch = runner.decode_batch([s for s, _ in decode], world.tables)
    sub = dataclasses.replace(world, keys=[], values=[])
    for s, _ in decode:
        sub.keys.append(world.keys[s.seq_id])
        sub.values.append(world.values[s.seq_id])
    q, k, v, firsts = step_inputs(sub, batch, decode, rng)
    out = reference.decode_attention(
        q, pages, k, v, batch.page_ids, batch.page_rows, batch.page_cols, batch.chunk_starts, **kw
    )
    check_rows(np.asarray(out), q, sub, decode, firsts, window=window, softcap=softcap, tol=1e-5)


@pytest.mark.parametrize("window,softcap", WINDOWS)
def test_reference_paged_and_dense(window, softcap):
    """The write-then-read oracle (`paged_attention`, Pallas' oracle) and the cache-free
    `dense_causal_attention` (scoring), padded rows included."""
    rng = np.random.default_rng(1)
    hd, c0, n = 32, 40, 24
    world = make_world(rng, [(c0, n)], hd=hd, window=window)
    table = world.tables[0]
    pages = world.pages.copy()
    for j in range(c0, c0 + n):  # the chunk written first, as Pallas does
        pages[table[j // PS], j % PS, 0::2] = world.keys[0][j]
        pages[table[j // PS], j % PS, 1::2] = world.values[0][j]
    q = rng.standard_normal((1, n, HKV * G, hd)).astype(np.float32)
    positions = np.arange(c0, c0 + n, dtype=np.int32)
    out = reference.paged_attention(
        q, pages, np.asarray([table], np.int32), positions[None], np.array([c0 + n], np.int32),
        scale=SCALE, window=window, softcap=softcap,
    )  # fmt: skip
    want = dense_oracle(world.keys[0], world.values[0], q[0], positions, window=window, softcap=softcap)
    np.testing.assert_allclose(np.asarray(out[0]), want, atol=1e-5, rtol=0)

    length = c0 + n
    kd = np.stack([world.keys[0], np.zeros_like(world.keys[0])])  # row 1: padding (length 0)
    vd = np.stack([world.values[0], np.zeros_like(world.values[0])])
    qd = rng.standard_normal((2, length, HKV * G, hd)).astype(np.float32)
    out = reference.dense_causal_attention(
        qd, kd, vd, np.array([length - 3, 0]), scale=SCALE, window=window, softcap=softcap
    )
    want = dense_oracle(
        kd[0], vd[0], qd[0, : length - 3], np.arange(length - 3), window=window, softcap=softcap
    )
    np.testing.assert_allclose(np.asarray(out[0, : length - 3]), want, atol=1e-5, rtol=0)
    assert not np.asarray(out[1]).any()


def test_none_is_the_path_without_them():
    """window=None, softcap=None trace to the very program the paths had without the keywords."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 8, 4, 16)).astype(np.float32)
    k = rng.standard_normal((2, 8, 2, 16)).astype(np.float32)
    lengths = np.array([8, 5])

    def jaxpr(**kw):
        return str(
            jax.make_jaxpr(lambda *a: reference.dense_causal_attention(*a, scale=0.5, **kw))(q, k, k, lengths)
        )

    assert jaxpr() == jaxpr(window=None, softcap=None)
    assert jaxpr() != jaxpr(window=4)


def test_bad_window_or_softcap_is_refused():
    q = np.zeros((1, 2, 2, 8), np.float32)
    with pytest.raises(ValueError, match="window"):
        reference.dense_causal_attention(q, q, q, np.array([2]), scale=1.0, window=0)
    with pytest.raises(ValueError, match="softcap"):
        reference.dense_causal_attention(q, q, q, np.array([2]), scale=1.0, softcap=-1.0)


# ---- the Pallas kernel (interpreted) -------------------------------------------------------


@pytest.mark.parametrize(
    "window,softcap,hd,kw",
    [
        (5, None, 64, dict(pages_per_block=1)),  # a window under a page: only the last page or two
        (23, 30.0, 128, dict(pages_per_block=2, rows_per_block=16)),  # spans pages and kv blocks
        (None, 4.0, 64, {}),
        (40, 50.0, 256, dict(pages_per_block=1)),  # head_dim 256: split K/V lane slices
    ],
)
def test_pallas_matches_the_reference(window, softcap, hd, kw):
    """A decode batch (lengths 0, 1, ps-1, ps, ps+1, 70) and a prefill chunk over a cached prefix,
    pages before every query's window NaN (so a fetched-and-used one would poison the output)."""
    rng = np.random.default_rng(3)
    for lens, starts, c in [
        ([0, 1, PS - 1, PS, PS + 1, 70], [0, 0, PS - 2, PS - 1, PS, 69], 1),
        ([61], [37], 24),
    ]:
        p = -(-max(lens) // PS) + 1
        b = len(lens)
        num_pages = b * p + 3
        pages = rng.standard_normal((num_pages, PS, 2 * HKV, hd)).astype(np.float32)
        tables = rng.permutation(np.arange(1, num_pages))[: b * p].reshape(b, p).astype(np.int32)
        for i, (n, s0) in enumerate(zip(lens, starts, strict=True)):
            first = 0 if window is None else max(0, s0 - window + 1)
            pages[tables[i, : first // PS]] = np.nan  # wholly before every window of the row
            if n % PS:
                pages[tables[i, n // PS], n % PS :] = np.nan
            tables[i, -(-n // PS) :] = 0
        q = rng.standard_normal((b, c, HKV * G, hd)).astype(np.float32)
        pos = np.stack([np.arange(s, s + c) for s in starts]).astype(np.int32)
        args = (q, pages, tables, pos, np.asarray(lens, np.int32))
        ref = reference.paged_attention(*args, scale=SCALE, window=window, softcap=softcap)
        out = ragged_paged_attention.paged_attention(
            q, reference.fold_pages(jnp.asarray(pages)), *args[2:], scale=SCALE, window=window,
            softcap=softcap, **kw,
        )  # fmt: skip
        assert bool(jnp.isfinite(out).all()), "NaN leaked from a page before the window"
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=3e-5, rtol=0)

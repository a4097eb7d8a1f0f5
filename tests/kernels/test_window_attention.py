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
from helpers import soak

from hotswap.engine.pages import PagePool
from hotswap.engine.runner import Runner
from hotswap.engine.sampling import SamplingParams
from hotswap.engine.sequence import Sequence
from hotswap.engine_config import EngineConfig
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
    queries: list[np.ndarray]  # per sequence [cached + n, Hq, hd]


def make_world(rng, chunks, *, hd, window, ps=PS, g=G):
    need = [-(-(c + n) // ps) for c, n in chunks]
    num_pages = sum(need) + 4
    pool = rng.permutation(np.arange(1, num_pages)).tolist()
    pages = np.full((num_pages, ps, 2 * HKV, hd), np.nan, np.float32)
    seqs, tables, keys, values, queries = [], {}, [], [], []
    for i, ((c, n), p) in enumerate(zip(chunks, need, strict=True)):
        table, pool = pool[:p], pool[p:]
        k = rng.standard_normal((c + n, HKV, hd)).astype(np.float32)
        v = rng.standard_normal((c + n, HKV, hd)).astype(np.float32)
        queries.append(rng.standard_normal((c + n, HKV * g, hd)).astype(np.float32))
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
    return World(pages, seqs, tables, keys, values, queries)


def step_inputs(world, batch, rows):
    """q, k_new, v_new laid out as the batch (flat [B*C], padding zeros), each chunk's from the world."""
    b, c = batch.tokens.shape
    hd, hq = world.pages.shape[-1], world.queries[0].shape[1]
    q = np.zeros((b * c, hq, hd), np.float32)
    k = np.zeros((b * c, HKV, hd), np.float32)
    v = np.zeros((b * c, HKV, hd), np.float32)
    firsts = []
    for r, (seq, n) in enumerate(rows):
        first = int(batch.sample_idx[r]) - n + 1
        sl = slice(seq.num_computed, seq.num_computed + n)
        k[first : first + n], v[first : first + n] = world.keys[r][sl], world.values[r][sl]
        q[first : first + n] = world.queries[r][sl]
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
    batch = runner.prefill_batch(rows, PagePool.owning(len(world.pages), world.tables))
    q, k, v, firsts = step_inputs(world, batch, rows)
    out = reference.prefill_attention(
        q, pages, k, v, batch.page_ids, batch.page_rows, batch.page_cols, batch.positions,
        batch.kv_lens, batch.chunk_starts, batch.segments, **kw,
    )  # fmt: skip
    check_rows(np.asarray(out), q, world, rows, firsts, window=window, softcap=softcap, tol=1e-5)

    decode = [(s, n) for s, n in rows if n == 1]
    batch = runner.decode_batch([s for s, _ in decode], PagePool.owning(len(world.pages), world.tables))
    sub = dataclasses.replace(world, keys=[], values=[], queries=[])
    for s, _ in decode:
        sub.keys.append(world.keys[s.seq_id])
        sub.values.append(world.values[s.seq_id])
        sub.queries.append(world.queries[s.seq_id])
    q, k, v, firsts = step_inputs(sub, batch, decode)
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


def _pallas_case(rng, lens, starts, c, hd, window):
    """Random pages, permuted tables, NaN in every slot past a row's kv_len and in every page
    wholly before all of its row's windows (a page fetched and used would poison the output)."""
    p = -(-max(lens) // PS) + 1
    b = len(lens)
    num_pages = b * p + 3
    pages = rng.standard_normal((num_pages, PS, 2 * HKV, hd)).astype(np.float32)
    tables = rng.permutation(np.arange(1, num_pages))[: b * p].reshape(b, p).astype(np.int32)
    for i, (n, s0) in enumerate(zip(lens, starts, strict=True)):
        first = 0 if window is None else max(0, s0 - window + 1)
        pages[tables[i, : first // PS]] = np.nan
        if n % PS:
            pages[tables[i, n // PS], n % PS :] = np.nan
        tables[i, -(-n // PS) :] = 0
    q = rng.standard_normal((b, c, HKV * G, hd)).astype(np.float32)
    pos = np.stack([np.arange(s, s + c) for s in starts]).astype(np.int32)
    return q, pages, tables, pos, np.asarray(lens, np.int32)


def _check_pallas(args, window, softcap, **kw):
    q, pages, *rest = args
    ref = reference.paged_attention(*args, scale=SCALE, window=window, softcap=softcap)
    out = ragged_paged_attention.paged_attention(
        q, reference.fold_pages(jnp.asarray(pages)), *rest, scale=SCALE, window=window, softcap=softcap, **kw
    )
    assert bool(jnp.isfinite(out).all()), "NaN leaked from a page before the window"
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=3e-5, rtol=0)


@pytest.mark.parametrize(
    "window,softcap,hd,kw",
    [
        (5, None, 64, dict(pages_per_block=1)),  # a window under a page: only the last page or two
        (None, 4.0, 128, dict(pages_per_block=2, rows_per_block=16)),  # softcap alone
        (40, 50.0, 256, dict(pages_per_block=1)),  # head_dim 256; the window spans pages and kv blocks
    ],
)
def test_pallas_matches_the_reference(window, softcap, hd, kw):
    """A decode batch (lengths 0, 1, ps+1, 70) and a prefill chunk over a cached prefix."""
    rng = np.random.default_rng(3)
    _check_pallas(_pallas_case(rng, [0, 1, PS + 1, 70], [0, 0, PS, 69], 1, hd, window), window, softcap, **kw)
    _check_pallas(_pallas_case(rng, [61], [37], 24, hd, window), window, softcap, **kw)


def test_pallas_window_dma_protocol_under_tpu_interpreter():
    """TPU interpret mode lands a DMA's data only at its wait, fills scratch with NaN, raises on
    out-of-bounds reads and checks races: the window's first block starting in either buffer slot,
    and its first pages left unfetched, show up here if the start/wait ranges disagree."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
    from jax.experimental.pallas import tpu as pltpu

    rng = np.random.default_rng(6)
    args = _pallas_case(rng, [70, 0, 17, 50], [69, 0, 16, 49], 1, 64, 21)
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    _check_pallas(args, 21, None, pages_per_block=2, interpret=params)
    assert not tpu_interpret.races.races_found


# ---- the C++ kernel -----------------------------------------------------------------------


def cpu_step(world, rows, *, window, softcap, dtype=np.float32, fixed=False, pages=None):
    """The C++ kernel over a ragged step the runner lays out for attention="cpu", with the table
    entries of every page wholly before a row's first window replaced by ids outside the cache
    (the kernel refuses to read one, so passing shows those pages are skipped). Returns
    (out [T, Hq, hd] f32, q, the written pages, firsts)."""
    from hotswap.kernels import cpu_attention

    pages = world.pages if pages is None else pages
    ps = pages.shape[1]
    ecfg = EngineConfig(
        page_size=ps,
        num_pages=len(pages),
        max_model_len=min(256, (len(pages) - 1) * ps),
        max_num_batched_tokens=256,
        max_num_seqs=8,
    )
    tables = {}
    for seq, _ in rows:
        table = list(world.tables[seq.seq_id])
        first = 0 if window is None else max(0, seq.num_computed - window + 1)
        table[: first // ps] = [len(pages) + 1000] * (first // ps)
        tables[seq.seq_id] = table
    batch = Runner(None, ecfg, Backend("cpu", "cpu")).ragged_batch(
        rows, PagePool.owning(len(pages) + 1001, tables)
    )
    q, k, v, firsts = step_inputs(world, batch, rows)
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    out, written = cpu_attention.paged_attention(
        cast(q), jnp.asarray(pages), cast(k), cast(v), batch.block_tables, batch.positions,
        batch.chunk_starts, batch.kv_lens, scale=SCALE, slots=batch.slots, fixed=fixed, window=window,
        softcap=softcap,
    )  # fmt: skip
    out = np.asarray(out.astype(jnp.float32))
    return out.reshape(-1, *out.shape[2:]), q, written, firsts


def _rounded(world, dtype):
    """The world with its K/V (pages and oracle keys) as `dtype` holds them."""
    r = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))  # noqa: E731
    return dataclasses.replace(
        world,
        pages=r(world.pages),
        keys=[r(k) for k in world.keys],
        values=[r(v) for v in world.values],
        queries=[r(q) for q in world.queries],
    )


# f32 and bf16, head_dim 32 / 64 / 128 (the AVX-512 path where the CPU has it) / 256, pages of
# 16 and 8 (a fixed 16-key block then spans two pages), the default and the fixed-order kernel.
@pytest.mark.parametrize(
    "dtype,hd,ps,fixed",
    [
        (np.float32, 32, PS, False),
        (np.float32, 64, PS, True),
        (np.float32, 128, 8, False),
        (np.float32, 256, 8, True),
        (jnp.bfloat16, 256, PS, False),
        (jnp.bfloat16, 64, 8, True),
    ],
)
@pytest.mark.parametrize("window,softcap", [(5, None), (23, 30.0), (None, 4.0)])
def test_cpu_kernel_ragged_step(dtype, hd, ps, fixed, window, softcap):
    """Prefill chunks, prefix chunks and decode rows in one ragged step, each query against the
    dense oracle; padding queries come back as zeros."""
    rng = np.random.default_rng(4)
    world = make_world(rng, CHUNKS, hd=hd, window=window, ps=ps)
    if dtype != np.float32:
        world = _rounded(world, dtype)
    rows = [(s, n) for s, (_, n) in zip(world.seqs, CHUNKS, strict=True)]
    pages = jnp.asarray(world.pages, dtype)
    out, q, _, firsts = cpu_step(
        world, rows, window=window, softcap=softcap, dtype=dtype, fixed=fixed, pages=pages
    )
    tol = 1e-5 if dtype == np.float32 else 2e-2
    q = q.reshape(len(out), 1, *q.shape[2:])
    check_rows(
        out.reshape(q.shape),
        q,
        world,
        rows,
        firsts,
        window=window,
        softcap=softcap,
        tol=tol,
        zero_padding=True,
    )


def test_cpu_fixed_order_is_the_same_bits_in_any_chunking():
    """Deterministic mode with a window spanning pages and a softcap: the positions of a
    45-token sequence come out the same bits from one chunk, from chunks of 30 + 14 + a decode
    step (pages before the window gone from the table), and from `Backend.causal_attention`."""
    rng = np.random.default_rng(5)
    hd, n, window, softcap = 64, 45, 20, 30.0
    world = make_world(rng, [(0, n)], hd=hd, window=window)
    seq = world.seqs[0]
    full, _, _, firsts = cpu_step(world, [(seq, n)], window=window, softcap=softcap, fixed=True)
    full = full[firsts[0] : firsts[0] + n]
    pieces, pages = [], jnp.asarray(world.pages)
    for start, m in [(0, 30), (30, 14), (44, 1)]:
        seq.num_computed = start
        out, _, pages, firsts = cpu_step(
            world, [(seq, m)], window=window, softcap=softcap, fixed=True, pages=pages
        )
        pieces.append(out[firsts[0] : firsts[0] + m])
    np.testing.assert_array_equal(np.concatenate(pieces), full)
    want = dense_oracle(
        world.keys[0], world.values[0], world.queries[0], np.arange(n), window=window, softcap=softcap
    )
    np.testing.assert_allclose(full, want, atol=1e-5, rtol=0)
    dense = Backend("cpu", "cpu", deterministic=True).causal_attention(
        world.queries[0][None], world.keys[0][None], world.values[0][None], jnp.array([n]), SCALE,
        window=window, softcap=softcap,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(dense[0]), full)


# ---- TPU (compiled here, on CPU, with libtpu) ----------------------------------------------


@pytest.mark.parametrize("c,p", [(1, 128), (256, 64)])
def test_pallas_lowers_for_tpu_with_window_softcap_and_head_dim_256(c, p):
    """Mosaic lowering enforces the (8, 128) block rule that interpret mode skips: head_dim 256
    (K and V lane-aligned slices) with a window and a softcap, a decode batch and a prefill row."""
    from functools import partial

    b, hq, hkv, hd = (8, 16, 8, 256) if c == 1 else (1, 16, 8, 256)
    sds = jax.ShapeDtypeStruct
    avals = (
        sds((b, c, hq, hd), jnp.bfloat16),
        sds((b * p + 1, PS, 2 * hkv * hd), jnp.bfloat16),
        sds((b, p), jnp.int32),
        sds((b, c), jnp.int32),
        sds((b,), jnp.int32),
    )
    kernel = partial(
        ragged_paged_attention.paged_attention, scale=SCALE, interpret=False, window=512, softcap=50.0
    )
    assert "tpu_custom_call" in jax.jit(kernel).trace(*avals).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.slow
def test_aot_compiles_head_dim_256_in_place(tmp_path):
    """`hotswap aot` for a head_dim-256 model (Gemma's head size; 8 kv heads, two layers) on one
    v5e chip: one Pallas call per layer reading the bf16 pages in place (no copy of the pool)."""
    import json

    from hotswap.checkpoint.create import load_preset
    from hotswap.programs import tpu_slice

    cfg = {**load_preset("llama-3.2-1b"), "num_hidden_layers": 2, "head_dim": 256, "num_attention_heads": 16}
    cfg.update(vocab_size=4096, hidden_size=1024, intermediate_size=2048)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    acfg = tpu_slice.AotConfig(topology="v5e:1x1", max_model_len=2048, max_num_seqs=16, buckets="decode")
    report = tpu_slice.compile_for(str(tmp_path), acfg)
    (step,) = [s for s in report["steps"] if s["name"].startswith("decode")]
    kv = report["kv_cache_bytes_per_chip"]
    assert report["attention"] == "pallas" and report["fits"], report
    assert step["pallas_calls"] == 2 and step["alias_bytes"] >= kv, step
    assert step["temp_bytes"] < 0.05 * kv, (step["temp_bytes"] / kv, step)


# ---- the engine's paths on a Gemma 2 checkpoint (windows and both softcaps) -----------------


@soak  # each path compiles its own steps (Pallas interpreted): tens of minutes on 2 cores
@pytest.mark.parametrize(
    "kw", [dict(attention="reference"), dict(deterministic=True), dict(attention="pallas")],
    ids=["reference", "deterministic", "pallas"],
)  # fmt: skip
def test_engine_paths_agree_on_gemma2(tmp_path, kw):
    """`LLM.generate` (chunked prefill past the window of 16, decode) through each attention path
    equals the default C++ kernel's (itself checked against HF in test_gemma.py): greedy tokens
    equal, log-probs within 1e-4."""
    from gemma_checkpoints import seeded_checkpoint

    from hotswap import LLM

    model_dir = seeded_checkpoint(tmp_path, "gemma2")
    common = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, page_size=8, warmup=False)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 40, 70)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = [
        [o.outputs[0] for o in LLM(model_dir, **common, **extra).generate(prompts, sp, use_tqdm=False)]
        for extra in ({}, kw)
    ]
    for base, other in zip(*outs, strict=True):
        assert list(other.token_ids) == list(base.token_ids)
        np.testing.assert_allclose(other.logprobs, base.logprobs, atol=1e-4, rtol=0)

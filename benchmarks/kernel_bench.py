"""Paged-attention kernels: time per call and fraction of the memory-bandwidth roofline.

    python benchmarks/kernel_bench.py [--interpret] [--dtype float32|bfloat16] [--shapes decode,prefill,window]

Runs unchanged on TPU / GPU / CPU; on CPU it also times the C++ kernel (`attention="cpu"`). Shapes use the bench-100m attention dims (4 kv heads, 12 q
heads, head_dim 64, page 16): decode batches 1/8/32 at context 512/2048 and one 256-token prefill
chunk over a 1024-token context. Block tables are random permutations of the page pool (as a
long-running server's are). The roofline fraction is the KV bytes the call must read
(`sum(kv_len) * 2 * Hkv * hd * itemsize`) / time / a bandwidth probed in this run with a large
array copy (read + write). Prints a table and one JSON line. KV that fits in cache (small CPU
shapes) can beat the DRAM probe, so fractions above 100% mean "cache-resident", not an error.
On CPU / GPU the Pallas kernel runs in interpret mode (it uses TPU scalar prefetch), so its
numbers there measure the interpreter, not the kernel.

`--shapes group`: decode rows sampled from one prompt (a GRPO rollout's n = 8): groups of 8 rows
that share a 192-token prompt's pages, each with 64..512 tokens of its own, one group and four; the
same rows with private copies of the prompt pages ("copies"). The C++ kernel reads a shared page once
for its group: the KV bytes of both layouts and the time ratio, per implementation.

`--shapes window`: decode at batch 32 x 2,048 tokens with a sliding window of 512 and without
one (Gemma's local layers), the KV bytes each reads (the kernels skip pages wholly before the
window; the jnp reference reads and masks them) and the time ratio, per implementation.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.kernels import cpu_attention, cpu_build, ragged_paged_attention, reference

HKV, HQ, HD, PS = 4, 12, 64, 16  # bench-100m attention dims
DECODE = [(b, ctx) for ctx in (512, 2048) for b in (1, 8, 32)]
PREFILL = [(256, 1024)]  # (chunk, context including the chunk)
WINDOW = (32, 2048, 512)  # (batch, context, window) of the window comparison
# Shared-prefix decode: groups of GROUP_ROWS rows, each group the samples of one GROUP_PROMPT-token
# prompt (its pages shared, as `PagePool.share` does for n > 1) plus GROUP_OWN generated tokens.
GROUP_ROWS, GROUP_PROMPT = 8, 192
GROUP_OWN = [64 * (i + 1) for i in range(GROUP_ROWS)]  # 64 .. 512
GROUPS = (1, 4)  # groups per step: 8 and 32 rows


def keys_read(ctx: int, window: int | None, impl: str) -> int:
    """Keys a decode row at the end of `ctx` tokens reads: the kernels start at the page holding
    its window's first key; the jnp reference reads every page and masks."""
    if window is None or impl == "reference":
        return ctx
    return ctx - max(0, ctx - window) // PS * PS


def timeit(fn, *args, min_time: float = 0.5, max_iters: int = 50, stat=np.median) -> float:
    """Seconds per call (median by default) after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(stat(times))


def probe_bandwidth(nbytes: int = 256 << 20, calls: int = 12) -> float:
    """Bytes/s of a large elementwise copy (each byte read once and written once); best of many
    calls, so a busy machine lowers it less (the roofline should be the attainable peak). The
    input is donated, so the copy writes over it: a fresh 256 MB output per call measured the
    kernel's page faults (2.7 GB/s on XLA:CPU here), not the memory."""
    step = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    x = jax.block_until_ready(step(jnp.ones((nbytes // 4,), jnp.float32)))
    best = math.inf
    for _ in range(calls):
        t0 = time.perf_counter()
        x = jax.block_until_ready(step(x))
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def make_inputs(rng, b: int, c: int, ctx: int, dtype):
    """Pages for `b` rows of `ctx` tokens (row i's last c tokens are the queries)."""
    p = math.ceil(ctx / PS)
    num_pages = b * p + 1  # page 0: the null page
    pages = rng.standard_normal((num_pages, PS, 2 * HKV, HD), np.float32)
    tables = rng.permutation(np.arange(1, num_pages)).reshape(b, p).astype(np.int32)
    q = rng.standard_normal((b, c, HQ, HD), np.float32)
    pos = np.broadcast_to(np.arange(ctx - c, ctx, dtype=np.int32), (b, c))
    lens = np.full((b,), ctx, np.int32)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(pages, dtype),
        jnp.asarray(tables),
        jnp.asarray(pos),
        jnp.asarray(lens),
    )


def make_group_inputs(rng, groups: int, shared: bool, dtype):
    """`groups` x GROUP_ROWS decode rows: each group's rows hold the same GROUP_PROMPT-token prompt
    pages (the same page ids when `shared`, private copies otherwise), then GROUP_OWN tokens each.
    Returns (q, pages, tables, positions, lens) as `make_inputs` does (lens include the query)."""
    prompt_pages = GROUP_PROMPT // PS
    lens = np.array([GROUP_PROMPT + own for _ in range(groups) for own in GROUP_OWN], np.int32)
    need = [math.ceil(n / PS) for n in lens]
    p = max(need)
    num_pages = 1 + sum(need) - (prompt_pages * (GROUP_ROWS - 1) * groups if shared else 0)
    ids = iter(rng.permutation(np.arange(1, num_pages)).tolist())
    tables = np.zeros((len(lens), p), np.int32)
    for g in range(groups):
        prompt = [next(ids) for _ in range(prompt_pages)] if shared else []
        for r in range(GROUP_ROWS):
            row = g * GROUP_ROWS + r
            head = prompt if shared else [next(ids) for _ in range(prompt_pages)]
            tables[row, : need[row]] = head + [next(ids) for _ in range(need[row] - prompt_pages)]
    pages = rng.standard_normal((num_pages, PS, 2 * HKV, HD), np.float32)
    q = rng.standard_normal((len(lens), 1, HQ, HD), np.float32)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(pages, dtype),
        jnp.asarray(tables),
        jnp.asarray(lens[:, None] - 1),
        jnp.asarray(lens),
    )


def group_kv_bytes(groups: int, shared: bool, impl: str, itemsize: int) -> int:
    """KV bytes a decode step over `make_group_inputs` reads: the C++ kernel reads a group's shared
    prompt pages once; every other layout or implementation reads each row's keys itself."""
    keys = groups * sum(GROUP_PROMPT + own for own in GROUP_OWN)
    if shared and impl == "cpu":
        keys -= groups * (GROUP_ROWS - 1) * GROUP_PROMPT
    return keys * 2 * HKV * HD * itemsize


def cpu_paged_attention(q, pages, tables, pos, lens, *, scale, window=None):
    """The C++ CPU kernel behind `reference.paged_attention`'s signature: the last C tokens of
    each row stand for the step's own K/V (zeros here: their values do not change the time)."""
    kv_new = jnp.zeros((*q.shape[:2], HKV, HD), q.dtype)
    return cpu_attention.paged_attention(
        q, pages, kv_new, kv_new, tables, pos, lens - q.shape[1], lens, scale=scale, window=window
    )


def window_ratios(rows: list[dict]) -> dict:
    """Per implementation: (time, KV bytes) without a window / with one, at the WINDOW shape."""
    b, ctx, _ = WINDOW
    at = {(r["impl"], r["window"]): r for r in rows if r["B"] == b and r["ctx"] == ctx and r["C"] == 1}
    out = {}
    for (impl, window), r in at.items():
        full = at.get((impl, None))
        if window is not None and full is not None:
            out[impl] = dict(speedup=full["ms"] / r["ms"], bytes_ratio=full["kv_bytes"] / r["kv_bytes"])
    return out


def group_ratios(rows: list[dict]) -> dict:
    """Per implementation and group count: (time, KV bytes) of private copies / shared pages."""
    at = {(r["impl"], r["B"], r["kind"]): r for r in rows if r["kind"] in ("group", "copies")}
    out = {}
    for (impl, b, kind), r in at.items():
        copies = at.get((impl, b, "copies"))
        if kind == "group" and copies is not None:
            out[f"{impl} B={b}"] = dict(
                speedup=copies["ms"] / r["ms"], bytes_ratio=copies["kv_bytes"] / r["kv_bytes"]
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--interpret", action="store_true", help="force Pallas interpret mode (default on non-TPU)"
    )
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (accelerator default)")
    ap.add_argument("--shapes", default="decode,prefill")
    ap.add_argument("--pages-per-block", type=int, default=None)
    ap.add_argument("--impls", default="reference,pallas,cpu", help="which implementations to time")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds of timed calls per measurement")
    args = ap.parse_args()

    backend = jax.default_backend()
    dtype = jnp.dtype(args.dtype or ("float32" if backend == "cpu" else "bfloat16"))
    interpret = True if args.interpret else None
    scale = 1.0 / math.sqrt(HD)
    impls = {
        "reference": partial(reference.paged_attention, scale=scale),
        "pallas": partial(
            ragged_paged_attention.paged_attention,
            scale=scale,
            interpret=interpret,
            pages_per_block=args.pages_per_block,
        ),
    }
    if backend == "cpu" and cpu_build.available():
        impls["cpu"] = partial(cpu_paged_attention, scale=scale)
    impls = {name: fn for name, fn in impls.items() if name in args.impls.split(",")}
    bw = probe_bandwidth()
    shapes = []
    if "decode" in args.shapes:
        shapes += [("decode", b, 1, ctx, None) for b, ctx in DECODE]
    if "prefill" in args.shapes:
        shapes += [("prefill", 1, c, ctx, None) for c, ctx in PREFILL]
    if "window" in args.shapes:
        b, ctx, w = WINDOW
        shapes += [("decode", b, 1, ctx, None), ("window", b, 1, ctx, w)]
    if "group" in args.shapes:
        ctx = GROUP_PROMPT + max(GROUP_OWN)
        shapes += [(kind, g * GROUP_ROWS, 1, ctx, None) for g in GROUPS for kind in ("group", "copies")]

    rng = np.random.default_rng(0)
    rows = []
    print(
        f"backend={backend} device={jax.devices()[0].device_kind} dtype={dtype.name} bw={bw / 1e9:.1f} GB/s"
    )
    print(
        f"{'kind':8} {'B':>3} {'C':>4} {'ctx':>5} {'window':>6} {'impl':10} {'ms/call':>10} {'KV MB':>8} "
        f"{'GB/s':>8} {'roofline':>9}"
    )
    for kind, b, c, ctx, window in shapes:
        if kind in ("group", "copies"):
            inputs = make_group_inputs(rng, b // GROUP_ROWS, kind == "group", dtype)
        else:
            inputs = make_inputs(rng, b, c, ctx, dtype)
        for name, impl in impls.items():
            fn = jax.jit(partial(impl, window=window)) if window else jax.jit(impl)
            # Only the tokens each row really has (and, for a decode row, sees).
            kv_bytes = b * keys_read(ctx, window, name) * 2 * HKV * HD * dtype.itemsize
            if kind in ("group", "copies"):
                kv_bytes = group_kv_bytes(b // GROUP_ROWS, kind == "group", name, dtype.itemsize)
            q, pages, *rest = inputs
            if name == "pallas":  # the kernel's lane-folded layout, made once outside the timed call
                pages = jax.block_until_ready(reference.fold_pages(pages))
            t = timeit(fn, q, pages, *rest, min_time=args.min_time)
            row = dict(kind=kind, B=b, C=c, ctx=ctx, window=window, impl=name, ms=t * 1e3, kv_bytes=kv_bytes)
            row["gbps"] = kv_bytes / t / 1e9
            row["roofline"] = kv_bytes / t / bw
            rows.append(row)
            print(
                f"{kind:8} {b:>3} {c:>4} {ctx:>5} {window or '-':>6} {name:10} {row['ms']:>10.3f} "
                f"{kv_bytes / 1e6:>8.1f} {row['gbps']:>8.2f} {row['roofline']:>9.1%}"
            )
    ratios = window_ratios(rows)
    for name, r in ratios.items():
        b, ctx, w = WINDOW
        print(
            f"window {w} vs none at B={b} ctx={ctx}, {name}: {r['speedup']:.2f}x faster, "
            f"{r['bytes_ratio']:.2f}x fewer KV bytes"
        )
    groups = group_ratios(rows)
    for key, r in groups.items():
        print(
            f"{GROUP_ROWS} rows sharing a {GROUP_PROMPT}-token prompt (own tokens {min(GROUP_OWN)}-"
            f"{max(GROUP_OWN)}) vs private copies, {key}: {r['bytes_ratio']:.2f}x fewer KV bytes, "
            f"{r['speedup']:.2f}x faster"
        )
    summary = dict(
        backend=backend,
        device=jax.devices()[0].device_kind,
        dtype=dtype.name,
        interpret=bool(args.interpret or backend != "tpu"),
        bandwidth_gbps=bw / 1e9,
        dims=dict(kv_heads=HKV, q_heads=HQ, head_dim=HD, page_size=PS),
        results=rows,
        window_ratios=ratios,
        group_ratios=groups,
    )
    from hotswap.kernels.cpu_target import host

    print(json.dumps({"cpu": host().describe(), **summary}))  # the CPU each figure is from


if __name__ == "__main__":
    main()

"""Paged-attention kernels: time per call and fraction of the memory-bandwidth roofline.

    python benchmarks/kernel_bench.py [--interpret] [--dtype float32|bfloat16] [--shapes decode,prefill]

Runs unchanged on TPU / GPU / CPU; on CPU it also times the C++ kernel (`attention="cpu"`). Shapes use the bench-100m attention dims (4 kv heads, 12 q
heads, head_dim 64, page 16): decode batches 1/8/32 at context 512/2048 and one 256-token prefill
chunk over a 1024-token context. Block tables are random permutations of the page pool (as a
long-running server's are). The roofline fraction is the KV bytes the call must read
(`sum(kv_len) * 2 * Hkv * hd * itemsize`) / time / a bandwidth probed in this run with a large
array copy (read + write). Prints a table and one JSON line. KV that fits in cache (small CPU
shapes) can beat the DRAM probe, so fractions above 100% mean "cache-resident", not an error.
On CPU / GPU the Pallas kernel runs in interpret mode (it uses TPU scalar prefetch), so its
numbers there measure the interpreter, not the kernel.
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


def timeit(fn, *args, min_time: float = 0.5, max_iters: int = 50, stat=np.median) -> float:
    """Seconds per call (median by default) after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(stat(times))


def probe_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s of a large elementwise copy (each byte read once and written once); best of many
    calls, so a busy machine lowers it less (the roofline should be the attainable peak)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    t = timeit(jax.jit(lambda x: x + 1.0), x, min_time=1.0, stat=np.min)
    return 2 * nbytes / t


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


def cpu_paged_attention(q, pages, tables, pos, lens, *, scale):
    """The C++ CPU kernel behind `reference.paged_attention`'s signature: the last C tokens of
    each row stand for the step's own K/V (zeros here: their values do not change the time)."""
    kv_new = jnp.zeros((*q.shape[:2], HKV, HD), q.dtype)
    return cpu_attention.paged_attention(
        q, pages, kv_new, kv_new, tables, pos, lens - q.shape[1], lens, scale=scale
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--interpret", action="store_true", help="force Pallas interpret mode (default on non-TPU)"
    )
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (accelerator default)")
    ap.add_argument("--shapes", default="decode,prefill")
    ap.add_argument("--pages-per-block", type=int, default=None)
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds of timed calls per measurement")
    args = ap.parse_args()

    backend = jax.default_backend()
    dtype = jnp.dtype(args.dtype or ("float32" if backend == "cpu" else "bfloat16"))
    interpret = True if args.interpret else None
    scale = 1.0 / math.sqrt(HD)
    impls = {
        "reference": jax.jit(partial(reference.paged_attention, scale=scale)),
        "pallas": jax.jit(
            partial(
                ragged_paged_attention.paged_attention,
                scale=scale,
                interpret=interpret,
                pages_per_block=args.pages_per_block,
            )
        ),
    }
    if backend == "cpu" and cpu_build.available():
        impls["cpu"] = jax.jit(partial(cpu_paged_attention, scale=scale))
    bw = probe_bandwidth()
    shapes = []
    if "decode" in args.shapes:
        shapes += [("decode", b, 1, ctx) for b, ctx in DECODE]
    if "prefill" in args.shapes:
        shapes += [("prefill", 1, c, ctx) for c, ctx in PREFILL]

    rng = np.random.default_rng(0)
    rows = []
    print(
        f"backend={backend} device={jax.devices()[0].device_kind} dtype={dtype.name} bw={bw / 1e9:.1f} GB/s"
    )
    print(f"{'kind':8} {'B':>3} {'C':>4} {'ctx':>5} {'impl':10} {'ms/call':>10} {'GB/s':>8} {'roofline':>9}")
    for kind, b, c, ctx in shapes:
        inputs = make_inputs(rng, b, c, ctx, dtype)
        kv_bytes = b * ctx * 2 * HKV * HD * dtype.itemsize  # only the tokens each row really has
        for name, fn in impls.items():
            q, pages, *rest = inputs
            if name == "pallas":  # the kernel's lane-folded layout, made once outside the timed call
                pages = jax.block_until_ready(reference.fold_pages(pages))
            t = timeit(fn, q, pages, *rest, min_time=args.min_time)
            row = dict(kind=kind, B=b, C=c, ctx=ctx, impl=name, ms=t * 1e3, gbps=kv_bytes / t / 1e9)
            row["roofline"] = kv_bytes / t / bw
            rows.append(row)
            print(
                f"{kind:8} {b:>3} {c:>4} {ctx:>5} {name:10} {row['ms']:>10.3f} "
                f"{row['gbps']:>8.2f} {row['roofline']:>9.1%}"
            )
    summary = dict(
        backend=backend,
        device=jax.devices()[0].device_kind,
        dtype=dtype.name,
        interpret=bool(args.interpret or backend != "tpu"),
        bandwidth_gbps=bw / 1e9,
        dims=dict(kv_heads=HKV, q_heads=HQ, head_dim=HD, page_size=PS),
        results=rows,
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

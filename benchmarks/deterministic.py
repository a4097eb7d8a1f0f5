"""Deterministic mode against the default, in one process: what batch invariance costs.

    python -m benchmarks.deterministic [MODEL_DIR] [--rounds 3] [--new-tokens 32]

Two engines on the same model (bench-100m by default, built once in the temporary directory),
the default and `deterministic=True`, timed in alternation round by round (this machine's speed
drifts by tens of percent within minutes, so only the same-round ratio means anything), best
round each:
  - decode: 16 sequences of 64-token prompts, greedy, tok/s from every sequence having its
    first token until all finish (`workloads.hotswap_decode`);
  - mix: 32 requests of 32-400 prompt tokens at max_num_seqs 16, so prefill chunks share steps
    with decode rows: generated tokens per second of the whole `generate`;
  - serving: `hotswap bench`'s serving mix (`workloads.serving_workload`: prompts 32-512,
    outputs 16-128, all submitted at once), output tokens per second.
Prints one JSON line; `ratio` is deterministic over default (the bar is >= 0.8).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.deterministic", description=__doc__)
    p.add_argument("model_dir", nargs="?")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--serving-requests", type=int, default=32)
    a = p.parse_args(argv)

    from benchmarks.workloads import hotswap_decode, serving_workload
    from hotswap import LLM, SamplingParams
    from hotswap.checkpoint.create import create_checkpoint

    model = a.model_dir or str(
        create_checkpoint(Path(tempfile.gettempdir()) / "hotswap-ab-100m", preset="bench-100m")
    )
    kw = dict(max_model_len=1088, max_num_seqs=16, max_num_batched_tokens=256)  # the serving mix fits
    engines = {"default": LLM(model, **kw), "deterministic": LLM(model, deterministic=True, **kw)}
    rng = np.random.default_rng(0)
    decode_prompts = [rng.integers(10, 700, 64).tolist() for _ in range(16)]
    mix_prompts = [rng.integers(10, 700, int(n)).tolist() for n in rng.integers(32, 400, 32)]
    mix_sp = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=a.new_tokens, ignore_eos=True)

    def mix(llm) -> float:
        llm.engine.reset_prefix_cache()
        t = time.perf_counter()
        out = llm.generate(mix_prompts, mix_sp, use_tqdm=False)
        return sum(len(r.outputs[0].token_ids) for r in out) / (time.perf_counter() - t)

    for llm in engines.values():  # compile what the timed runs use
        mix(llm)
    best = {name: {"decode_b16": 0.0, "mix": 0.0, "serving": 0.0} for name in engines}
    for _ in range(a.rounds):
        for name, llm in engines.items():
            b = best[name]
            b["decode_b16"] = max(b["decode_b16"], hotswap_decode(llm, decode_prompts, a.new_tokens, 1))
            b["mix"] = max(b["mix"], mix(llm))
            serving = serving_workload(llm, a.serving_requests, llm.engine.mcfg.vocab_size)
            b["serving"] = max(b["serving"], serving["throughput_tok_s"])
    ratio = {k: round(best["deterministic"][k] / best["default"][k], 3) for k in best["default"]}
    result = {
        "tok_s": {n: {k: round(v, 1) for k, v in b.items()} for n, b in best.items()},
        "ratio": ratio,
    }
    from hotswap.kernels.cpu_target import host

    print(json.dumps({"cpu": host().describe(), **result}))  # the CPU each figure is from
    return result


if __name__ == "__main__":
    main()

"""bf16 against f32 decode, same model, one process: what a bf16 checkpoint costs on CPU.

    python -m benchmarks.bf16_decode [MODEL_DIR] [--batches 1,16] [--prompt-len 64]
                                     [--new-tokens 32] [--rounds 3] [--prefill 512] [--int8]

Two engines on the same checkpoint, `dtype="float32"` and `dtype="bfloat16"`, decode the same
random prompts at each batch size, taking turns within each round (this machine's speed drifts
over minutes, so each is timed beside the other). A round's time runs from every row's first
token to the last (`workloads.decode_seconds`, prefill excluded); each engine's figure is its
best round. `bf16_vs_f32` is the figure to read. `--prefill N` (0: none) also times one prompt
of N tokens, `max_tokens=1`, in one step (`max_num_batched_tokens` is N), taking turns the same
way: the prompt-sized matmuls. `--int8` adds a third engine, the bf16 model with its matmul
weights served as int8 (`quantization="int8"`): `int8_vs_bf16`, and at batch 1 the int8 weight
bytes read per second against a large copy's rate measured in the same run. The model defaults to
the bench-100m preset, built once in the temporary directory.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.workloads import decode_seconds, random_prompts

DTYPES = ("float32", "bfloat16")
# The engines compared: each dtype, and with --int8 the bf16 model's matmul weights served as int8
# (`quantization="int8"`, one scale per column; activations and KV bf16).
ENGINES = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"}}
INT8 = {"int8": {"dtype": "bfloat16", "quantization": "int8"}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bf16_decode", description=__doc__)
    p.add_argument("model_dir", nargs="?")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefill", type=int, default=512, help="tokens of the timed prompt (0: none)")
    p.add_argument("--int8", action="store_true", help="also int8 weights (bf16 activations): int8_vs_bf16")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]

    from hotswap import LLM
    from hotswap.checkpoint.create import create_checkpoint

    model = a.model_dir or str(
        create_checkpoint(Path(tempfile.gettempdir()) / "hotswap-ab-100m", preset="bench-100m")
    )
    engines = {**ENGINES, **(INT8 if a.int8 else {})}
    llms = {
        d: LLM(
            model,
            **kw,
            max_model_len=max(a.prompt_len + a.new_tokens, a.prefill) + 64,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(256, a.prefill),
        )
        for d, kw in engines.items()
    }
    prompts = random_prompts(max(batches), a.prompt_len, llms["float32"].config.vocab_size)
    best: dict[tuple[int, str], float] = {}
    for b in batches:
        for llm in llms.values():  # warm-up: this batch size's programs compiled and run once
            decode_seconds(llm, prompts[:b], a.new_tokens)
        for _ in range(a.rounds):
            for d, llm in llms.items():
                t = decode_seconds(llm, prompts[:b], a.new_tokens)
                best[(b, d)] = min(best.get((b, d), float("inf")), t)
    steps = a.new_tokens - 1
    result = {
        f"batch_{b}": {
            "tok_s": {d: round(b * steps / best[(b, d)], 1) for d in engines},
            "bf16_vs_f32": round(best[(b, "float32")] / best[(b, "bfloat16")], 2),
            **({"int8_vs_bf16": round(best[(b, "bfloat16")] / best[(b, "int8")], 2)} if a.int8 else {}),
        }
        for b in batches
    }
    if a.int8 and 1 in batches:  # batch 1 reads every weight once a step: against DRAM
        from benchmarks.kernel_bench import probe_bandwidth
        from hotswap.weights.quantize import served_bytes

        params = llms["int8"].params  # a step reads all of it but the embedding table (a row a token)
        gb = (served_bytes(params) - served_bytes({"embed": params["embed"]})) / 1e9
        limit = probe_bandwidth() / 1e9  # a large copy's read + written bytes: the attainable DRAM rate
        result["batch_1"]["int8_weight_gb_s"] = round(gb * steps / best[(1, "int8")], 1)
        result["batch_1"]["dram_gb_s"] = round(limit, 1)
        result["batch_1"]["int8_of_dram_limit"] = round(gb * steps / best[(1, "int8")] / limit, 2)
    if a.prefill:
        prompt = random_prompts(1, a.prefill, llms["float32"].config.vocab_size, seed=1)
        times = {d: [] for d in engines}
        for r in range(a.rounds + 1):  # the first round compiles and warms up, untimed
            for d, llm in llms.items():
                t = prefill_seconds(llm, prompt)
                if r:
                    times[d].append(t)
        result[f"prefill_{a.prefill}"] = {
            "ms": {d: round(min(ts) * 1e3, 1) for d, ts in times.items()},
            "bf16_vs_f32": round(min(times["float32"]) / min(times["bfloat16"]), 2),
        }
    from hotswap.kernels.cpu_target import host

    print(json.dumps({"cpu": host().describe(), **result}))  # the CPU each figure is from
    return result


def prefill_seconds(llm, prompt: list[list[int]]) -> float:
    """Seconds to one token for the prompt, prefix cache emptied first (every token computed)."""
    from hotswap import SamplingParams

    llm.reset_prefix_cache()
    t = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()

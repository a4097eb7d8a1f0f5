"""What structured outputs cost: constrained against unconstrained decode in one process.

    python -m benchmarks.structured_decode [--batch 16] [--new-tokens 128] [--rounds 3]

On the default model (SmolLM2-135M-Instruct), a batch of `--batch` seeded temperature-1
samples runs unconstrained, with a JSON-schema constraint on every row, and half and half,
rounds interleaved (A-B-C, A-B-C, ...; the best of each is kept: this machine's speed
drifts). Every row generates exactly `--new-tokens` tokens (the schema asks for more items
than fit), so the three runs do the same work but for the masks. Also measured: the compile
of a schema never seen (llguidance, per schema, after the tokenizer is built once), and the
host time of a batch's mask fill.

Read: `constrained_vs_free` (>= 0.85 is the bar), `mixed_free_rows_vs_free` (the unconstrained
rows of a half-constrained batch against an all-unconstrained one: >= 0.95),
`new_schema_compile_ms` (<= 50).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

# Longer than any run: every constrained row generates all its tokens.
LONG = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 500}


def _schemas(k: int) -> list[dict]:
    """k distinct object schemas of a realistic size (nested, enums, bounds)."""
    return [
        {
            "type": "object",
            "properties": {
                f"field_{i}": {"type": "string", "maxLength": 20 + i},
                "kind": {"enum": [f"a{i}", f"b{i}", "c"]},
                "items": {"type": "array", "items": {"type": "integer", "minimum": i}, "maxItems": 5},
                "nested": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
            },
            "required": [f"field_{i}", "kind"],
        }
        for i in range(k)
    ]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured_decode", description=__doc__)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)

    from hotswap import LLM, SamplingParams, cli
    from hotswap.engine.structured import Grammars, StructuredOutputs, fill_masks
    from hotswap.programs.sampler import mask_words

    llm = LLM(cli.smollm2_gguf(), max_model_len=512, max_num_seqs=a.batch, max_num_batched_tokens=256)
    prompt = [{"role": "user", "content": "List some numbers as a JSON array."}]
    common = dict(max_tokens=a.new_tokens, temperature=1.0, ignore_eos=True)
    free = SamplingParams(seed=1, **common)
    json_rows = SamplingParams(seed=1, structured_outputs={"json": LONG}, **common)
    half = a.batch // 2
    runs = {
        "free": [free] * a.batch,
        "constrained": [json_rows] * a.batch,
        "mixed": [json_rows] * half + [free] * (a.batch - half),
    }
    best: dict[str, float] = {}
    for _ in range(a.rounds):
        for name, params in runs.items():
            t = time.perf_counter()
            outs = [llm.chat([prompt] * len(params), list(params), use_tqdm=False)]
            dt = time.perf_counter() - t
            n = sum(len(c.token_ids) for batch in outs for r in batch for c in r.outputs)
            assert n == a.batch * a.new_tokens, (name, n)
            best[name] = max(best.get(name, 0.0), n / dt)
    # The unconstrained rows of the mixed batch get the same share of its steps as the rows
    # of the all-free batch: their tok/s ratio is the batches' ratio.
    grammars = Grammars(llm.engine.tokenizer, llm.engine.mcfg.vocab_size, llm.engine.eos_ids)
    compile_ms = []
    for schema in _schemas(20):
        t = time.perf_counter()
        grammars.matcher(StructuredOutputs(json=schema))
        compile_ms.append((time.perf_counter() - t) * 1e3)
    matchers = [(grammars.matcher(StructuredOutputs(json=LONG)), i) for i in range(a.batch)]
    mask = np.zeros((a.batch, mask_words(llm.engine.mcfg.vocab_size)), np.int32)
    fills = []
    for _ in range(50):
        t = time.perf_counter()
        fill_masks(matchers, mask)
        fills.append((time.perf_counter() - t) * 1e3)
    result = {
        "batch": a.batch,
        "new_tokens": a.new_tokens,
        "tok_s": {k: round(v, 1) for k, v in best.items()},
        "constrained_vs_free": round(best["constrained"] / best["free"], 3),
        "mixed_free_rows_vs_free": round(best["mixed"] / best["free"], 3),
        "new_schema_compile_ms": {
            "median": round(statistics.median(compile_ms), 2),
            "max": round(max(compile_ms), 2),
        },
        "mask_fill_ms_per_step": round(statistics.median(fills), 3),
    }
    from hotswap.kernels.cpu_target import host

    print(json.dumps({"cpu": host().describe(), **result}))  # the CPU each figure is from
    return result


if __name__ == "__main__":
    main()

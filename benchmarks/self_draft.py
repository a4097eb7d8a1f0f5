"""Self-speculation on the default model: SmolLM2's first layers and its head as the draft
(speculative_config draft_model "self"), against plain decoding in the same run, at batch 1
and 16.

Batch 1 takes `speculative.compare`'s rotated turns over grounded and free prompts; batch 16
runs 16 prompts at once on each engine in turn (a plain engine and one per draft depth), the
time from the first step until every sample has finished. Greedy; whether every output
equals plain decoding's is reported. Prints a table and one JSON line starting with "cpu".

`python -m benchmarks.self_draft [--layers 4,8] [--k 3]`
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks import speculative
from benchmarks.speculative_prompts import FREE, GROUNDED

LAYERS, K = "4,8", 3
BATCH = 16
NEW_TOKENS = 96


def self_draft(layers: int, k: int) -> dict:
    return {"method": "draft_model", "model": "self", "draft_layers": layers, "num_speculative_tokens": k}


def batch(llm, prompts: list[list[int]], sp) -> dict:
    """Every prompt in flight at once: seconds until the last finishes, tokens, drafts."""
    engine = llm.engine
    llm.reset_prefix_cache()
    rids = [engine.add_request(None, ids, sp) for ids in prompts]
    seqs = [engine.admission.requests[rid].seqs[0] for rid in rids]
    t0 = time.perf_counter()
    while not all(s.is_finished for s in seqs):
        engine.step()
    took = time.perf_counter() - t0
    drafted, accepted = sum(s.spec_proposed for s in seqs), sum(s.spec_accepted for s in seqs)
    return {
        "s": took,
        "tokens": sum(len(s.output_ids) for s in seqs),
        "tok_s": sum(len(s.output_ids) for s in seqs) / took,
        "acceptance": accepted / drafted if drafted else 0.0,
        "outputs": [list(s.output_ids) for s in seqs],
    }


def run(layers: list[int], k: int) -> dict:
    from hotswap import LLM, SamplingParams
    from hotswap.cli.models import SMOLLM2_INSTALL, smollm2_gguf
    from hotswap.engine.chat import chat_prompt

    model = smollm2_gguf()
    if model is None:
        raise SystemExit(f"benchmarks.self_draft needs the SmolLM2 GGUF: {SMOLLM2_INSTALL}")
    engine = {"max_model_len": 1024, "max_num_seqs": BATCH}
    llms = {"plain": LLM(model, **engine)}
    for n in layers:
        llms[f"self{n}"] = LLM(model, **engine, speculative_config=self_draft(n, k))
    tok = llms["plain"].tokenizer
    ids = [
        chat_prompt(tok, [{"role": "user", "content": t}])[1] for t in [*GROUNDED.values(), *FREE.values()]
    ]
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    names = list(llms)
    for name in names:  # warm: each engine's decode, verification and draft steps
        speculative.decode(llms[name], ids[0], SamplingParams(temperature=0, max_tokens=8))
    one = speculative.compare(names, dict(enumerate(ids[:4] + ids[-2:])), sp, llms, repeats=1)
    result = {"model": model.name, "k": k, "new_tokens": NEW_TOKENS, "batch1": speculative.summarise(one)}
    prompts = (ids * -(-BATCH // len(ids)))[:BATCH]
    for name in names:  # warm at this batch size
        batch(llms[name], prompts[:4], SamplingParams(temperature=0, max_tokens=8))
    runs = {name: batch(llms[name], prompts, sp) for name in names}
    plain = runs["plain"]
    result[f"batch{BATCH}"] = {
        name: {
            "tok_s": r["tok_s"],
            "ratio": r["tok_s"] / plain["tok_s"],
            "acceptance": r["acceptance"],
            "equal_to_plain": r["outputs"] == plain["outputs"],
        }
        for name, r in runs.items()
    }
    _table(result)
    return result


def _table(result: dict) -> None:
    print(
        f"\n{'engine':<8} {'b1 tok/s':>9} {'b1 x':>6} {'b1 acc':>7} {'b16 tok/s':>10} {'b16 x':>6} {'b16 acc':>8}"
    )
    for name, one in result["batch1"].items():
        many = result[f"batch{BATCH}"][name]
        print(
            f"{name:<8} {one['tok_s']:>9.1f} {one['ratio_median']:>6.2f} {one['acceptance']:>7.2f} "
            f"{many['tok_s']:>10.1f} {many['ratio']:>6.2f} {many['acceptance']:>8.2f}"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default=LAYERS, help="draft depths, comma-separated")
    p.add_argument("--k", type=int, default=K, help="num_speculative_tokens")
    a = p.parse_args(argv)
    from hotswap.kernels.cpu_target import host

    result = run([int(x) for x in a.layers.split(",")], a.k)
    print(json.dumps({"cpu": host().describe(), **result}, default=str))


if __name__ == "__main__":
    main()

"""KV bytes one sequence holds, with the sliding-window layers' pool bounded by the window and
without it (`disable_hybrid_kv_cache_manager`), measured from the engine's page pool.

    python -m benchmarks.window_kv [--contexts 8192 32768] [--preset gemma-3-27b]

A seeded model with Gemma 3's layer pattern (5 sliding layers to 1 full, window 1,024, as
gemma-3-12b/27b) reads one prompt of each context length in 2,048-token chunks and decodes 16
tokens; after every step the pages the sequence holds are read from the pool: pages of the full
layers, and twins in the window pool. The page counts do not depend on the model's width, so
the bytes are given for `--preset`'s shape (its layers, kv heads, head_dim, bf16): full pages x
the full layers' bytes + window twins x the sliding layers' bytes, against every page x every
layer's bytes without the bound. The same tokens come out of both engines (checked).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

PAGE, CHUNK, GEN = 16, 2048, 16


def held(llm, prompt: list[int]) -> tuple[list[int], int, int]:
    """(tokens, most full-layer pages, most window twins) the sequence held at once."""
    from hotswap import SamplingParams

    engine = llm.engine
    sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(None, prompt, sp)
    full = twins = 0
    tokens = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                tokens = list(out.outputs[0].token_ids)
        st = engine.state
        usage = st.pool.usage(st.prefix)
        full, twins = max(full, usage["owned"]), max(twins, usage.get("window_held", 0))
    return tokens, full, twins


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--preset", default="gemma-3-27b")
    args = ap.parse_args()
    from hotswap import LLM
    from hotswap.checkpoint.create import create_checkpoint, load_preset
    from hotswap.model.config import ModelConfig
    from hotswap.programs import kv_sizing

    shape = ModelConfig.from_hf(load_preset(args.preset), dtype="bfloat16")
    local = kv_sizing.window_layers(shape)
    full_bytes = kv_sizing.page_bytes(shape, PAGE, layers=shape.num_layers - local)
    window_bytes = kv_sizing.page_bytes(shape, PAGE, layers=local)
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = create_checkpoint(
            Path(tmp) / "gemma3",
            preset="tiny",
            arch="gemma3",
            seed=0,
            overrides={
                "num_hidden_layers": 6,
                "sliding_window_pattern": 6,
                "sliding_window": 1024,
                "head_dim": 32,
                "max_position_embeddings": 65536,
            },
        )
        for ctx in args.contexts:
            prompt = rng.integers(0, 512, ctx).tolist()  # the tiny preset's vocabulary
            kw = dict(max_model_len=ctx + GEN, max_num_seqs=1, max_num_batched_tokens=CHUNK, page_size=PAGE)
            row = {"context": ctx, "preset": args.preset}
            outs = {}
            for name, disable in (("bounded", False), ("full", True)):
                llm = LLM(model, warmup=False, disable_hybrid_kv_cache_manager=disable, **kw)
                tokens, pages, twins = held(llm, prompt)
                outs[name] = tokens
                kv = (
                    pages * full_bytes + twins * window_bytes
                    if twins
                    else pages * (full_bytes + window_bytes)
                )
                row[name] = {
                    "full_layer_pages_held": pages,
                    "window_pages_held": twins,
                    "kv_bytes_per_seq": kv,
                    "allocated_bytes_this_model": llm.engine.state.kv.nbytes,
                }
                del llm
            row["same_tokens"] = outs["bounded"] == outs["full"]
            row["saved_fraction"] = round(
                1 - row["bounded"]["kv_bytes_per_seq"] / row["full"]["kv_bytes_per_seq"], 4
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"window_kv": rows}, indent=1))


if __name__ == "__main__":
    main()

"""The Pallas attention (interpret mode) under tensor parallelism on an 8-device fake CPU mesh,
run by tests/kernels/test_backend.py in a subprocess (the device count is fixed when jax starts).

Generates through `LLM.generate` at TP 1, 2, 4 and 8 with attention="pallas": a prompt long
enough to prefill in chunks, then the same prompt and one sharing its first pages (prefix hits).
Prints one JSON object on the last line of stdout.

usage: python tests/support/pallas_tp_worker.py TMPDIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax

from hotswap import LLM, SamplingParams
from hotswap.checkpoint.create import create_checkpoint

# 8 kv heads (one per device at TP 8), head_dim 16; every sharded dim divides by 8.
SHAPES = {"num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 128, "intermediate_size": 256}
# Chunks of 16 tokens (max_num_batched_tokens): the 30-token prompt prefills in two steps,
# the second over the first's pages; pages of 8, so round 2 hits 3 cached pages of it.
KW = dict(max_model_len=48, page_size=8, max_num_seqs=2, max_num_batched_tokens=16, warmup=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LONG = list(range(5, 35))
ROUNDS = [[LONG, [7, 8, 9]], [LONG, LONG[:24] + [300, 301]]]


def main(tmp: Path) -> dict:
    path = create_checkpoint(tmp / "m", preset="tiny", arch="llama", seed=0, overrides=SHAPES)
    res: dict = {"devices": jax.device_count(), "tp": {}, "timings": {}}
    for tp in (1, 2, 4, 8):
        t = time.monotonic()
        llm = LLM(path, attention="pallas", tensor_parallel_size=tp, **KW)
        rounds = []
        for prompts in ROUNDS:
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            rounds.append(
                [
                    {
                        "ids": o.outputs[0].token_ids,
                        "lps": o.outputs[0].logprobs,
                        "cached": o.num_cached_tokens,
                    }
                    for o in outs
                ]
            )
        kv = llm.state.kv.pages[0]
        res["tp"][tp] = {
            "rounds": rounds,
            "attention": llm.engine.backend.attention,
            "kv_spec": list(kv.sharding.spec) if hasattr(kv.sharding, "spec") else None,
            "kv_shard_shape": list(kv.addressable_shards[0].data.shape),
        }
        res["timings"][f"tp{tp}"] = round(time.monotonic() - t, 1)
    return res


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))

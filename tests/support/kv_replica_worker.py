"""Tensor parallelism over more devices than kv heads (each kv head replicated over tp / kv
heads devices) on an 8-device fake CPU mesh, run by tests/engine/test_kv_replicas.py in a subprocess
(the device count is fixed when jax starts).

A tiny Llama with 8 q heads and 2 kv heads generates at TP 1 and at the TP sizes in argv[3]
(e.g. "4,8": kv replicas 2 and 4),
with a prompt long enough to prefill in two chunks and a second round that hits its cached
pages. `attention` is argv[2]: "auto" (the jnp reference on a CPU mesh) or "pallas"
(interpreted, in shard_map). argv[4] (optional): the architecture, "llama" (default) or
"gemma2" (windows, softcaps, its own layer code). Prints one JSON object on the last line of
stdout.

usage: python tests/support/kv_replica_worker.py TMPDIR ATTENTION TP[,TP...] [ARCH]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax

from hotswap import LLM, SamplingParams
from hotswap.checkpoint.create import create_checkpoint

# 8 q heads, 2 kv heads (GQA groups of 4), head_dim 16.
SHAPES = {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 128, "intermediate_size": 256}
# Gemma 2: a window shorter than the long prompt on its sliding layers, both softcaps.
ARCH = {
    "llama": {},
    "gemma2": {"sliding_window": 16, "attn_logit_softcapping": 20.0, "final_logit_softcapping": 30.0},
}
# Chunks of 16 tokens: the 30-token prompt prefills in two steps, the second over the first's
# pages; pages of 8, so round 2 hits 3 cached pages of it.
KW = dict(max_model_len=48, page_size=8, max_num_seqs=2, max_num_batched_tokens=16, warmup=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
LONG = list(range(5, 35))
ROUNDS = [[LONG, [7, 8, 9]], [LONG, LONG[:24] + [300, 301]]]


def shard_info(x) -> dict:
    shards = x.addressable_shards
    return {
        "spec": [None if a is None else str(a) for a in x.sharding.spec]
        if hasattr(x.sharding, "spec")
        else None,
        "devices": len({s.device for s in shards}),
        "distinct": len({str(s.index) for s in shards}),
        "shard_shape": list(shards[0].data.shape),
    }


def main(tmp: Path, attention: str, sizes: list[int], arch: str = "llama") -> dict:
    path = create_checkpoint(tmp / "m", preset="tiny", arch=arch, seed=0, overrides={**SHAPES, **ARCH[arch]})
    res: dict = {"devices": jax.device_count(), "tp": {}, "timings": {}}
    for tp in (1, *sizes):
        t = time.monotonic()
        llm = LLM(path, attention=attention, tensor_parallel_size=tp, **KW)
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
        layer = llm.params["layers"][0]
        res["tp"][tp] = {
            "rounds": rounds,
            "attention": llm.engine.backend.attention,
            "kv_replicas": llm.engine.backend.kv_replicas,
            "kv": shard_info(llm.state.kv.pages[0]),
            "wk": shard_info(layer["wk"]),
            "wq": shard_info(layer["wq"]),
        }
        res["timings"][f"tp{tp}"] = round(time.monotonic() - t, 1)
    return res


if __name__ == "__main__":
    sizes = [int(t) for t in sys.argv[3].split(",")]
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2], sizes, *sys.argv[4:])))

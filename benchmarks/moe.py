"""Batch-1 decode of a seeded MoE against a dense model with the same active parameters, one run.

    python -m benchmarks.moe [--layers 8] [--tokens 64] [--repeats 3]

The MoE is Qwen3-MoE with 16 experts of F=1024, top-2; the dense model is Qwen3 with F=2048:
the same attention, embedding and head, and per token the same MLP matmul bytes (2 x 1024 =
2048 columns). A decode step of the MoE reads its two routed experts' weights only (on one CPU
device the C++ kernel reads their rows in place from the stacked weights,
`kernels/cpu_experts.py`); reading all 16 would make it ~8x slower in the MLP. Prints both tok/s
and their ratio (the target: >= 0.7). Both run in this process, interleaved, because this
machine's bandwidth drifts by tens of percent within minutes.

Per model also the bytes a step reads per token (`active_bytes_per_token`: every weight but the
embedding table, of which a step reads one row, and of each sparse layer's experts only the k
routed) and `fraction_of_limit`: those bytes at the measured tok/s over the memory bandwidth
probed in the same run, between the timed repeats (`limits.GemvProbe`: f32 matrices streamed
from DRAM through a matrix-vector product, the faster of XLA's and hotswap's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

BASE = {
    "hidden_size": 768,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "tie_word_embeddings": True,
}


def active_bytes_per_token(llm) -> int:
    """The weight bytes a batch-1 decode step reads: all but the embedding table (one row of it)
    and, of each sparse layer's stacked experts, the k of E routed."""
    import jax

    cfg, params = llm.config, llm.params
    total = sum(x.nbytes for x in jax.tree.leaves(params)) - params["embed"].nbytes
    experts = sum(
        leaf.nbytes for layer in params["layers"] for key, leaf in layer.items() if key.startswith("experts_")
    )
    unread = experts * (1 - cfg.num_experts_per_tok / cfg.num_experts) if experts else 0
    return int(total - unread)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from benchmarks.limits import GemvProbe
    from benchmarks.workloads import hotswap_decode
    from hotswap import LLM
    from hotswap.checkpoint.create import create_checkpoint

    root = Path(tempfile.gettempdir()) / "hotswap-bench-moe"
    shared = {**BASE, "num_hidden_layers": args.layers}
    models = {
        "dense F=2048": create_checkpoint(
            root / f"dense-{args.layers}",
            preset="tiny",
            arch="qwen3",
            overrides={**shared, "intermediate_size": 2048},
        ),
        "moe 16x1024 top-2": create_checkpoint(
            root / f"moe-{args.layers}",
            preset="tiny",
            arch="qwen3_moe",
            overrides={
                **shared,
                "intermediate_size": 2048,
                "num_experts": 16,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 1024,
            },
        ),
    }
    # warmup=False: the untimed first decode of `hotswap_decode` compiles the shapes it runs
    llms = {
        name: LLM(d, max_model_len=256, max_num_seqs=1, max_num_batched_tokens=64, warmup=False)
        for name, d in models.items()
    }
    active = {name: active_bytes_per_token(llm) for name, llm in llms.items()}
    gemv = GemvProbe()
    prompt = [np.random.default_rng(0).integers(10, 700, 32).tolist()]
    runs: dict[str, list[float]] = {name: [] for name in llms}
    probes: list[float] = []
    for _ in range(args.repeats):  # interleaved: drift hits both alike
        probes.append(gemv()["gemv_bytes_per_s"])
        for name, llm in llms.items():
            runs[name].append(hotswap_decode(llm, prompt, args.tokens, 1))
    probes.append(gemv()["gemv_bytes_per_s"])
    gemv.close()
    bandwidth = statistics.median(probes)
    tok_s = {name: float(np.median(v)) for name, v in runs.items()}
    dense, moe = tok_s["dense F=2048"], tok_s["moe 16x1024 top-2"]
    print(
        json.dumps(
            {
                "tok_s": tok_s,
                "runs": runs,
                "moe_over_dense": round(moe / dense, 3),
                "active_bytes_per_token": active,
                "gemv_gb_s": round(bandwidth / 1e9, 2),
                "gemv_gb_s_probes": [round(p / 1e9, 2) for p in probes],
                "fraction_of_limit": {
                    name: round(tok_s[name] * active[name] / bandwidth, 3) for name in llms
                },
            }
        )
    )


if __name__ == "__main__":
    main()

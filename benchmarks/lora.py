"""LoRA costs in one process, against the base model measured beside them.

    python -m benchmarks.lora [MODEL_DIR] [--prompt-len 64] [--new-tokens 48] [--rounds 3]

1. Serving by name: a batch of 16 sequences spread over 4 adapters of rank 16 (4 each), on an
   engine with `enable_lora` (max_loras 4, max_lora_rank 16), decodes against the same batch on
   the base model without LoRA (`decode_tok_s`, best round each; the two engines take turns in
   every round). Bar: `decode_vs_base` >= 0.8.
2. The RL sync, merged: a rank-64 adapter (every q/k/v/o, gate/up/down; its factors already on
   the device, as Tunix's trainer holds them) merged into the kept base, against a full update
   of the same params already on the engine's sharding (`sync_s`, best of `--rounds`). Bar:
   `merged_vs_full` <= 2.
3. The merge alone (`model/lora.merge` on the staged factors: the C++ kernel on one CPU device):
   its GFLOP (2·r per adapted weight element), its GFLOP/s, and XLA's f32 dot on a square
   product of the same GFLOP in the same run (`xla_matmul_gflop_s`: the rate this machine gives
   a matmul now), so `merge_vs_xla_matmul` is the merge's fraction of it.

The model defaults to the bench-100m preset, built once in the temporary directory; adapters
are random (seeded) PEFT-named tensors. One run prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import workloads

ADAPTERS, RANK, BATCH, SYNC_RANK = 4, 16, 16, 64


def adapter_tensors(llm, rank: int, seed: int, device: bool = False) -> dict:
    """PEFT-named A [r, in] / B [out, r] for every adaptable row, small random values."""
    import jax

    from hotswap.model import validate
    from hotswap.model.spec import is_spec, param_specs

    rng = np.random.default_rng(seed)
    out = {}
    for s in jax.tree.leaves(param_specs(llm.config), is_leaf=is_spec):
        if s.adaptable:
            a_shape, b_shape = validate.lora_shapes(s, "peft", rank)
            a_name, b_name = s.lora_names("peft")
            out[a_name] = (rng.standard_normal(a_shape) * 0.02).astype(np.float32)
            out[b_name] = (rng.standard_normal(b_shape) * 0.02).astype(np.float32)
    return {k: jax.device_put(v) for k, v in out.items()} if device else out


def decode_seconds(llm, prompts, new_tokens: int, names) -> float:
    """Seconds from every row's first token to the last (prefill excluded), greedy."""
    return workloads.decode_seconds(llm, prompts, new_tokens, lora_names=names)


def best_seconds(fn, rounds: int) -> float:
    """Best wall time of `fn()` (blocked until ready) over `rounds`, after one untimed call."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return min(times)


def merge_rates(llm, adapter: dict, rounds: int) -> dict:
    """The merge alone on the engine's base weights (the factors staged as an update stages
    them), against XLA's f32 dot on a square product of the same FLOP, in this run."""
    import jax
    import jax.numpy as jnp

    from hotswap.model import lora
    from hotswap.weights import place, plan, readers
    from hotswap.weights.options import UpdateOptions

    engine = llm.engine
    params = engine.state.base if engine.state.base is not None else engine.state.params
    options = UpdateOptions(lora_alpha=float(SYNC_RANK))
    checked = plan.plan(readers.read(adapter, engine.mcfg), engine.mcfg, engine.abstract, options=options)
    factors = place.factors(checked)
    flop = sum(2 * a.size * b.size // a.shape[-1] for a, b in factors.values())  # 2·r per W element
    weights = {n: lora._get(params, n) for n in factors}
    merge_s = best_seconds(lambda: lora.merge(params, factors), rounds)
    n = round((flop / 2) ** (1 / 3))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    dot = jax.jit(lambda x: x @ x)
    dot_s = best_seconds(lambda: dot(x), rounds)
    merge_rate, dot_rate = flop / merge_s / 1e9, 2 * n**3 / dot_s / 1e9
    return {
        "merge_kernel": lora.uses_kernel(weights, factors),
        "merge_gflop": round(flop / 1e9, 3),
        "merge_s": round(merge_s, 4),
        "merge_gflop_s": round(merge_rate, 1),
        "xla_matmul_n": n,
        "xla_matmul_gflop_s": round(dot_rate, 1),
        "merge_vs_xla_matmul": round(merge_rate / dot_rate, 3),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__)
    p.add_argument("model_dir", nargs="?")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from hotswap import LLM
    from hotswap.checkpoint.create import create_checkpoint

    model = a.model_dir or str(
        create_checkpoint(Path(tempfile.gettempdir()) / "hotswap-ab-100m", preset="bench-100m")
    )
    knobs = dict(
        max_model_len=a.prompt_len + a.new_tokens + 32, max_num_seqs=BATCH, max_num_batched_tokens=256
    )
    base = LLM(model, **knobs)
    served = LLM(model, enable_lora=True, max_loras=ADAPTERS, max_lora_rank=RANK, **knobs)
    for i in range(ADAPTERS):
        served.load_lora_adapter(f"lora{i}", adapter_tensors(served, RANK, seed=i), lora_alpha=2.0 * RANK)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 700, a.prompt_len).tolist() for _ in range(BATCH)]
    names = [f"lora{i % ADAPTERS}" for i in range(BATCH)]
    runs = {"base": (base, [None] * BATCH), "lora": (served, names)}
    for llm, ns in runs.values():  # warm-up: every shape run once
        decode_seconds(llm, prompts, a.new_tokens, ns)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(a.rounds):
        for k, (llm, ns) in runs.items():
            times[k].append(decode_seconds(llm, prompts, a.new_tokens, ns))
    tok_s = {k: BATCH * (a.new_tokens - 1) / min(t) for k, t in times.items()}

    # The RL sync on the base engine: merged rank-64 adapter vs a same-sharding full update.
    del served
    adapter = adapter_tensors(base, SYNC_RANK, seed=99, device=True)
    full = jax.tree.map(jnp.copy, base.engine.state.params)
    jax.block_until_ready(full)
    sync = {"merged": [], "full": []}
    for _ in range(a.rounds + 1):  # the first round compiles the merge and the checks
        t = time.perf_counter()
        base.update_weights(adapter, lora_alpha=float(SYNC_RANK))
        sync["merged"].append(time.perf_counter() - t)
        t = time.perf_counter()
        base.update_weights(full)
        sync["full"].append(time.perf_counter() - t)
    sync_s = {k: min(v[1:]) for k, v in sync.items()}
    merge = merge_rates(base, adapter, a.rounds)
    result = {
        "batch": BATCH,
        "adapters": ADAPTERS,
        "rank": RANK,
        "decode_tok_s": {k: round(v, 1) for k, v in tok_s.items()},
        "decode_vs_base": round(tok_s["lora"] / tok_s["base"], 3),
        "sync_rank": SYNC_RANK,
        "sync_s": {k: round(v, 4) for k, v in sync_s.items()},
        "merged_vs_full": round(sync_s["merged"] / sync_s["full"], 3),
        **merge,
    }
    from hotswap.kernels.cpu_target import host

    print(json.dumps({"cpu": host().describe(), **result}))  # the CPU each figure is from
    return result


if __name__ == "__main__":
    main()

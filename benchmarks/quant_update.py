"""What re-quantizing at every update costs: the same bf16 update into a bf16 engine and into
an int8 one (`quantization="int8"`), one process, taking turns.

    python -m benchmarks.quant_update [MODEL_DIR] [--rounds 3]

The update is the trainer's path: a tree of bf16 arrays already on the device (HF-named, as
`LLM.update_weights` takes a trainer's state), checked for NaN/Inf and placed; the int8 engine
then quantizes each matmul weight as it is placed. Each engine's figure is its fastest round
(`update_weights` returns once the new params are ready). The model defaults to the bench-100m
preset in bf16, built once in the temporary directory.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quant_update", description=__doc__)
    p.add_argument("model_dir", nargs="?")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from hotswap import LLM
    from hotswap.checkpoint import hf
    from hotswap.checkpoint.create import create_checkpoint
    from hotswap.kernels.cpu_target import host

    model = a.model_dir or str(
        create_checkpoint(Path(tempfile.gettempdir()) / "hotswap-ab-100m", preset="bench-100m")
    )
    engines = {
        "bf16": LLM(model, dtype="bfloat16", warmup=False, max_model_len=256, num_pages=64),
        "int8": LLM(
            model, dtype="bfloat16", quantization="int8", warmup=False, max_model_len=256, num_pages=64
        ),
    }
    update = {n: jnp.asarray(t, jnp.bfloat16) for n, t in hf.read_hf_tensors(model).items()}
    jax.block_until_ready(update)
    best = {name: float("inf") for name in engines}
    for r in range(a.rounds + 1):  # round 0 compiles the conversions: untimed
        for name, llm in engines.items():
            t = time.perf_counter()
            llm.update_weights(update)
            if r:
                best[name] = min(best[name], time.perf_counter() - t)
    result = {
        "cpu": host().describe(),
        "update_s": {n: round(s, 3) for n, s in best.items()},
        "int8_vs_bf16": round(best["int8"] / best["bf16"], 2),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

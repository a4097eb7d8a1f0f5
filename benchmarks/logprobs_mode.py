"""What asking for processed log-probs or the kept set costs the sampler: `sample` (the C++
kernels, as the CPU engine runs it) on [R, V] logits, every row sampling with top-p 0.95 at
temperature 0.8, in four variants: no row asks (raw log-probs: the ordinary step), one row asks
for `processed_logprobs`, every row does, and every row asks for `processed_logprobs` and its
kept set.

    python -m benchmarks.logprobs_mode [--rows 8 64] [--vocab 49152] [--calls 30]

Each variant is jitted, called in turns with the others (this machine's speed drifts), and
reported as its best call in ms (other processes only ever add time), with its ratio to the
ordinary step. Prints JSON, the CPU first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from hotswap import SamplingParams
from hotswap.kernels import cpu_sampling
from hotswap.programs.sampler import SamplingArrays, sample


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--calls", type=int, default=30)
    a = p.parse_args()
    fn = jax.jit(
        partial(
            sample,
            row_stats=cpu_sampling.argmax_logsumexp,
            keep_thresholds=cpu_sampling.keep_thresholds,
            categorical=cpu_sampling.categorical,
        )
    )
    out = {"cpu": _cpu(), "vocab": a.vocab, "rows": {}}
    for r in a.rows:
        x = jnp.asarray(np.random.default_rng(0).normal(0, 2, (r, a.vocab)), jnp.float32)
        sp = SamplingParams(temperature=0.8, top_p=0.95)
        sa = SamplingArrays.from_rows([(sp, i, 0) for i in range(r)], r, a.vocab)
        one = np.zeros(r, np.int32)
        one[0] = 2  # processed_logprobs
        variants = {
            "ordinary": sa,
            "one_row_processed": dataclasses.replace(sa, mode=one),
            "all_rows_processed": dataclasses.replace(sa, mode=np.full(r, 2, np.int32)),
            "all_rows_processed_and_kept": dataclasses.replace(
                sa, mode=np.full(r, 2, np.int32), want_kept=np.ones(r, bool)
            ),
        }
        best = dict.fromkeys(variants, float("inf"))
        for v in variants.values():
            jax.block_until_ready(fn(x, v))
        for _ in range(a.calls):
            for name, v in variants.items():
                t = time.perf_counter()
                jax.block_until_ready(fn(x, v))
                best[name] = min(best[name], time.perf_counter() - t)
        out["rows"][r] = {
            name: {"ms": round(1e3 * s, 3), "x_ordinary": round(s / best["ordinary"], 2)}
            for name, s in best.items()
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

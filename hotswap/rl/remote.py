"""`hotswap demo --via-http`: the same loop against a `hotswap serve` subprocess, over REST only.

Rollouts use `POST /v1/completions` (token-id prompts, `n`, `logprobs`); weights
go back as safetensors bytes in `POST /update_weights?policy=...`, the way a
trainer on another host would push them. Page provenance is not visible from
outside, so the stale-KV evidence here is: the step's first request reports
`cached_tokens == 0` right after an update, every token carries the version
that the update returned, and the trainer's recomputed log-probs match.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

from hotswap.rl.rollout import Rollout, Sample


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`hotswap serve MODEL_DIR` on a free loopback port, stopped (SIGTERM) on exit."""

    def __init__(self, model_dir: Path, log_path: Path, engine_args: dict[str, int], startup_s: float = 300):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "hotswap.cli", "serve", str(model_dir), "--port", str(self.port)]
        for k, v in engine_args.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        self.log_path = log_path
        self._log = open(log_path, "wb")  # closed in close()
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        self.proc = subprocess.Popen(
            cmd + ["--log-level", "warning"], stdout=self._log, stderr=self._log, env=env
        )
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"hotswap serve exited ({self.proc.returncode}):\n{self._log_tail()}")
            try:
                if self.request("GET", "/health").get("status") == "ok":
                    return
            except (urllib.error.URLError, ConnectionError, RuntimeError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(
                    f"hotswap serve was not healthy after {startup_s:.0f}s:\n{self._log_tail()}"
                )
            time.sleep(0.5)

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def request(
        self, method: str, path: str, body: bytes | None = None, ctype: str = "application/json"
    ) -> dict:
        req = urllib.request.Request(
            self.url + path, data=body, method=method, headers={"Content-Type": ctype}
        )
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(
                f"{method} {path}: HTTP {e.code}: {e.read().decode(errors='replace')}"
            ) from None

    def complete(self, prompts: list[list[int]], n: int, max_tokens: int) -> dict:
        # No seed: the server draws one per prompt from its own seeded generator, so the prompts
        # of a request do not share one random stream.
        body = {"prompt": prompts, "n": n, "max_tokens": max_tokens, "temperature": 1.0, "logprobs": 0}
        return self.request("POST", "/v1/completions", json.dumps({**body, "ignore_eos": True}).encode())

    def update_weights(self, safetensors: bytes, policy: str) -> int:
        out = self.request(
            "POST", f"/update_weights?policy={policy}", safetensors, "application/octet-stream"
        )
        return int(out["weights_version"])

    def weights_version(self) -> int:
        return int(self.request("GET", "/weights_version")["weights_version"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def token_map(tok, vocab_size: int) -> dict[str, list[int]]:
    """Token text (as /v1/completions reports it) -> every id with that text."""
    out: dict[str, list[int]] = defaultdict(list)
    for i in range(vocab_size):
        out[tok.decode([i], skip_special_tokens=False)].append(i)
    return dict(out)


def _samples(resp: dict, prompts: list[list[int]], group0: int, n: int, tmap) -> list[Sample]:
    out = []
    for ch in sorted(resp["choices"], key=lambda c: c["index"]):
        p = ch["index"] // n
        texts, lps = ch["logprobs"]["tokens"], ch["logprobs"]["token_logprobs"]
        cands = [tmap[t] for t in texts]
        versions = [resp["weights_version"]] * len(texts)
        for span in ch.get("weights_version_spans") or []:
            versions[span["start"] : span["end"]] = [span["version"]] * (span["end"] - span["start"])
        amb = [(k, c) for k, c in enumerate(cands) if len(c) > 1]
        out.append(Sample(group0 + p, list(prompts[p]), [c[0] for c in cands], list(lps), versions, amb))
    return out


def rollout_http(server: ServerProcess, tmap, prompts: list[list[int]], n: int, max_tokens: int) -> Rollout:
    """The first prompt alone (nothing may be cached right after an update), then the rest at once."""
    version, t0 = server.weights_version(), time.perf_counter()
    resps = [server.complete(prompts[:1], n, max_tokens)]
    if len(prompts) > 1:
        resps.append(server.complete(prompts[1:], n, max_tokens))
    samples = _samples(resps[0], prompts[:1], 0, n, tmap)
    if len(resps) > 1:
        samples += _samples(resps[1], prompts[1:], 1, n, tmap)
    usage = [r["usage"] for r in resps]
    return Rollout(
        samples=samples,
        version=version,
        prompt_tokens=sum(u["prompt_tokens"] for u in usage),
        cached_tokens=sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage),
        first_cached_tokens=usage[0]["prompt_tokens_details"]["cached_tokens"],
        stale_pages=0,  # not observable over HTTP; see the module docstring
        seconds=time.perf_counter() - t0,
    )

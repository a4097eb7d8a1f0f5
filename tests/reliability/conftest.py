"""Fixtures of the reliability suite: checkpoints, one shared server, in-process scoring oracles.

One server serves every module that can share it (start-up compiles the step buckets,
up to half a minute on 2 loaded cores) and stops after the package's last test, not at
the end of the whole session; modules whose scenario ends or reshapes a server (a small
queue, SIGTERM) start their own. Tests leave the shared server
awake and serving, and record every weights version they create in `versions`, so
that any test can re-score a response under the checkpoint of its reported version.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest
from helpers import KNOBS

from hotswap.checkpoint.create import create_checkpoint

from .relkit import ADMIN, ServerProc

# Main server: a 64-token context keeps buckets few (8 compiles); 256 pages leave most of the
# cache to the prefix index, and make a leak of the KV buffers (2 MiB each) visible in RSS.
MAIN_KNOBS = {
    **KNOBS,
    "max_model_len": 64,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 64,
    "num_pages": 256,
    "max_waiting": 2048,  # above any test's concurrency: 429s belong to the backpressure test alone
    "drain_timeout": 30,
}


class SharedServer:
    """The shared server plus what the tests know about it."""

    def __init__(self, proc: ServerProc, ckpts: dict[str, Path]):
        self.proc, self.base, self.ckpts = proc, proc.base, ckpts
        self.num_pages = MAIN_KNOBS["num_pages"]
        self.versions: dict[int, str] = {1: "seed0"}  # weights version -> checkpoint name

    def update(self, name: str, policy: str = "abort", **extra) -> httpx.Response:
        """Path update to a checkpoint under the weights root; records the version it made."""
        body = {"path": name, "policy": policy, **extra}
        r = httpx.post(f"{self.base}/update_weights", json=body, headers=ADMIN, timeout=120)
        if r.status_code == 200:
            self.versions[r.json()["weights_version"]] = name
        return r

    def version(self) -> int:
        return httpx.get(f"{self.base}/weights_version", headers=ADMIN, timeout=30).json()["weights_version"]

    def restore(self, name: str = "seed0") -> int:
        """Awake, serving `name` from an empty cache (whatever an earlier test left)."""
        r = httpx.post(f"{self.base}/wakeup", headers=ADMIN, timeout=120)
        assert r.status_code == 200, r.text
        r = self.update(name, policy="abort")
        assert r.status_code == 200, r.text
        return r.json()["weights_version"]


@pytest.fixture(scope="package")
def rel_ckpts(tmp_path_factory, weights_root) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reliability")
    weights = root / "weights"
    # The suite's pair, copied into a root of this package's own (tests add checkpoints to it):
    # a symlink would resolve outside the root, and a path update would refuse it.
    for name in ("seed0", "seed1"):
        shutil.copytree(weights_root / name, weights / name)
    ckpts = {
        "root": weights,
        "seed0": weights / "seed0",
        "seed1": weights / "seed1",
        "outside": create_checkpoint(root / "outside", seed=2),
    }
    os.symlink(ckpts["outside"], weights / "escape")  # a link inside the root pointing out of it
    return ckpts


@pytest.fixture(scope="package")
def main_server(rel_ckpts, tmp_path_factory):
    log = tmp_path_factory.mktemp("main-log") / "server.log"
    proc = ServerProc(rel_ckpts["seed0"], log, weights_root=rel_ckpts["root"], **MAIN_KNOBS)
    try:
        proc.wait_healthy()
        yield SharedServer(proc, rel_ckpts)
        assert proc.proc.poll() is None, f"the shared server died:\n{proc.log()[-3000:]}"
        assert "Traceback" not in proc.log(), proc.log()[-5000:]
    finally:
        proc.kill()


@pytest.fixture(scope="package")
def oracles(rel_ckpts):
    """In-process engines (no warm-up) that re-score tokens under a named checkpoint."""
    from hotswap.engine.llm import LLM

    cache: dict[str, LLM] = {}

    def get(name: str) -> LLM:
        if name not in cache:
            cache[name] = LLM(rel_ckpts[name], max_model_len=64, num_pages=16, warmup=False)
        return cache[name]

    return get

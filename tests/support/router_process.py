"""sglang-router (SGLang Model Gateway, the pip package's launcher) on a free loopback port, in
front of running servers: what RL fleets put before their SGLang replicas.

`RouterProcess(worker_urls, log_path, policy=...)` starts `python -m sglang_router.launch_router`
with its own Prometheus port (the default, 29000, is one per machine); `wait_ready(n)` polls
`/readiness` until n workers are healthy; `kill()` ends it. A context manager, killed on exit.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
from server_process import free_port


class RouterProcess:
    def __init__(
        self,
        worker_urls: list[str],
        log_path: Path,
        *,
        policy: str = "cache_aware",
        api_key: str | None = None,
    ):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        args = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls]
        args += ["--policy", policy, "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["--prometheus-port", str(free_port()), "--log-level", "warn"]
        if api_key is not None:  # checked by the router and passed on to the workers
            args += ["--api-key", api_key]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, workers: int, timeout_s: float = 60.0) -> None:
        """Until `/readiness` reports `workers` healthy workers; RuntimeError with the log if not."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                r = httpx.get(f"{self.base}/readiness", timeout=2)
                if r.status_code == 200 and r.json().get("healthy_workers") == workers:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"router not ready (exit {self.proc.poll()}):\n{self.log()[-3000:]}")
            time.sleep(0.25)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

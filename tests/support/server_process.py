"""A `hotswap serve` subprocess on a free loopback port, for the tests that need a real server.

`ServerProcess(flags, log_path)` starts `python -m hotswap.cli serve <flags> --port <free>`
with its output in `log_path`; `wait_healthy()` polls `/health`; `stop()` asks it to end
(SIGTERM) and kills it if it does not; `kill()` ends it at once. Used as a context manager,
it is killed on exit.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli_flags(**options) -> list[str]:
    """`max_model_len=128` -> `["--max-model-len", "128"]`, in the given order."""
    out = []
    for k, v in options.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


class ServerProcess:
    """`python -m hotswap.cli serve` with the given flags, on 127.0.0.1 (the default host)."""

    def __init__(self, flags: list[str], log_path: Path, *, env: dict[str, str] | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        args = [sys.executable, "-m", "hotswap.cli", "serve", *flags, "--port", str(self.port)]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"} if env is None else env
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout_s: float = 240.0) -> None:
        """Until `/health` answers 200; RuntimeError with the log's tail if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while not healthy(self.base):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy (exit {self.proc.poll()}):\n{self.log()[-3000:]}")
            time.sleep(0.25)

    def rss_kib(self) -> int:
        """Resident memory of the server process (on CPU, 'device' memory is host memory too)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (a graceful shutdown), then SIGKILL if it has not exited within `timeout_s`."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

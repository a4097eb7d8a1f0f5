"""One replica: a Ray actor that runs `hotswap serve` as its child process, on its placement
group's devices.

A child process rather than the server inside the actor: the platform and device flags
(JAX_PLATFORMS, the CPU device count, what Ray sets as CUDA_VISIBLE_DEVICES / TPU_VISIBLE_CHIPS)
must be in the environment before JAX loads, once per process; the server is exactly the
`hotswap serve` users run (its SIGTERM drain, its logs); and the actor stays a thin supervisor
that answers Ray (pid, alive, log tail) while the server is busy or has died. The fleet talks
to the server itself over HTTP (its URL), as the router does.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def child_env(kind: str, tp: int, keys: dict[str, str], base: dict[str, str]) -> dict[str, str]:
    """The server's environment: its keys (never on its command line, where `ps` shows them)
    and, on CPU, `tp` JAX CPU devices."""
    env = {**base, **keys}
    if kind == "CPU":
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(CPU_DEVICES_FLAG)]
        env["XLA_FLAGS"] = " ".join([*flags, f"{CPU_DEVICES_FLAG}={tp}"])
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ReplicaServer:
    """The actor's body (`ray.remote(ReplicaServer)` in driver.py, so this module imports no Ray)."""

    def __init__(self, flags: list[str], env: dict[str, str], log_path: str, host: str = "127.0.0.1"):
        self.flags, self.env, self.host = flags, env, host
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        """Start the server on a free port of `host`; its URL (the fleet waits for /health)."""
        port = _free_port(self.host)
        args = [sys.executable, "-m", "hotswap.cli", "serve", *self.flags]
        args += ["--host", self.host, "--port", str(port)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return f"http://{self.host}:{port}"

    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: the replica dies as a lost node's would (no drain)."""
        if self.alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (the server drains in-flight work), SIGKILL after `timeout_s`."""
        if not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


def node_host() -> str:
    """This node's address, for a replica other nodes' routers reach (a multi-node cluster)."""
    import ray

    return ray.util.get_node_ip_address()


__all__ = ["ReplicaServer", "child_env", "node_host"]

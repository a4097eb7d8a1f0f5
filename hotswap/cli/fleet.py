"""`hotswap fleet serve MODEL --replicas N`: N replicas on Ray, sglang-router in front, and the
fleet controller beside it (hotswap/fleet/).

Prints two URLs: the router's (generation, what clients use: OpenAI, SGLang `/generate`) and
the controller's (`POST /fleet/update_weights`, `GET /fleet`). The router is sglang-router
(SGLang Model Gateway, `pip install sglang-router`) with its `cache_aware` policy: a request
goes to the replica whose radix tree holds the longest prefix of it (load-balanced when loads
drift apart), which is what keeps multi-turn RL sessions' prefixes hit: ~92% prefix hits with
cache-aware routing against ~40% without session affinity (prime-rl 2822, NeMo-Gym 2570),
where round-robin or consistent hashing spreads a session over replicas that each recompute
it. `--router-policy` takes the router's others. A replica that dies is restarted, caught up
to the fleet's weights, and only then added back to the router.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from hotswap.args import EngineArgs

log = logging.getLogger("hotswap.fleet")
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
HEAL_EVERY_S = 5.0


def add_parser(sub) -> None:
    fleet = sub.add_parser(
        "fleet", help="data-parallel replicas on Ray behind sglang-router, one weights version"
    )
    fleet_sub = fleet.add_subparsers(dest="fleet_command", required=True)
    p = fleet_sub.add_parser("serve", help="start the replicas, the router and the fleet controller")
    p.add_argument(
        "model", help="what `hotswap serve` takes: an HF directory, a .gguf file, a Hub ID, 'tiny'"
    )
    p.add_argument("--replicas", type=int, default=1, help="data-parallel replicas (default 1)")
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: a local Ray)")
    p.add_argument(
        "--ray-num-cpus",
        type=int,
        default=None,
        help="a local Ray's logical CPUs (default: the machine's); on a host without accelerators "
        "a replica takes tensor_parallel_size of them",
    )
    p.add_argument("--host", default="127.0.0.1", help="the router's and the controller's address")
    p.add_argument("--port", type=int, default=30000, help="the router's port")
    p.add_argument("--controller-port", type=int, default=30001)
    p.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES)
    p.add_argument("--router-prometheus-port", type=int, default=29000, help="the router's metrics port")
    p.add_argument(
        "--api-key", default=os.environ.get("HOTSWAP_API_KEY"), help="generation (router, replicas)"
    )
    p.add_argument("--admin-key", default=os.environ.get("HOTSWAP_ADMIN_KEY"), help="fleet updates")
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--log-dir", default=None, help="the replicas' and the router's logs (default: a temp dir)"
    )
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    EngineArgs.add_cli_args(p, "serve", defaults=False)
    p.set_defaults(func=serve)


class Router:
    """sglang-router as a child process; workers added and removed as replicas join and leave."""

    def __init__(self, urls: list[str], args: argparse.Namespace, log_path: str):
        self.base = f"http://{args.host}:{args.port}"
        self.api_key = args.api_key
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls]
        cmd += ["--policy", args.router_policy, "--host", args.host, "--port", str(args.port)]
        cmd += ["--prometheus-port", str(args.router_prometheus_port), "--log-level", "warn"]
        env = dict(os.environ)
        if args.api_key:  # the router checks it and passes it on to the replicas
            cmd += ["--api-key", args.api_key]
        with open(log_path, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def _request(self, method: str, path: str, **kw):
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = httpx.request(method, self.base + path, headers=headers, timeout=30, **kw)
        except httpx.TransportError as e:
            log.warning("router: %s %s failed: %s", method, path, e)
            return None
        if not r.is_success:
            log.warning("router: %s %s answered %d: %s", method, path, r.status_code, r.text[:300])
            return None
        return r

    def add(self, url: str) -> None:
        """The router's worker API (sglang-router 0.3: `POST /workers {"url"}`)."""
        self._request("POST", "/workers", json={"url": url})

    def remove(self, url: str) -> None:
        """`DELETE /workers/{id}`, the id read from `GET /workers`."""
        listed = self._request("GET", "/workers")
        for w in listed.json().get("workers", []) if listed is not None else []:
            if w.get("url") == url:
                self._request("DELETE", f"/workers/{w.get('id') or w.get('worker_id')}")

    def wait_ready(self, workers: int, timeout_s: float = 120.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                r = httpx.get(f"{self.base}/readiness", timeout=2)
                if r.status_code == 200 and r.json().get("healthy_workers") == workers:
                    return
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.25)
        raise RuntimeError(
            f"sglang-router did not become ready with {workers} workers (exit {self.proc.poll()})"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def serve(args: argparse.Namespace) -> int:
    import tempfile

    import uvicorn

    from hotswap.cli.platform import pick_jax_platform
    from hotswap.fleet import Fleet
    from hotswap.fleet.controller_app import create_controller

    pick_jax_platform()  # the replicas inherit it: the CPU where there is no accelerator
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine_args = EngineArgs.given(args, "serve")
    tp = engine_args.pop("tensor_parallel_size", None) or 1
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="hotswap-fleet-")
    if args.address is None and args.ray_num_cpus is not None:
        import ray

        ray.init(num_cpus=args.ray_num_cpus, include_dashboard=False, log_to_driver=False)
    router: Router | None = None
    fleet = Fleet(
        args.model,
        replicas=args.replicas,
        tensor_parallel_size=tp,
        address=args.address,
        admin_key=args.admin_key,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        log_dir=log_dir,
        **engine_args,
    )
    try:
        router = Router(fleet.urls(), args, os.path.join(log_dir, "router.log"))
        router.wait_ready(len(fleet.urls()))
        fleet.on_join, fleet.on_leave = router.add, router.remove
        stop = threading.Event()

        def heal() -> None:  # a replica that died comes back at the fleet's version
            while not stop.wait(HEAL_EVERY_S):
                try:
                    fleet.heal()
                except Exception:
                    log.exception("restarting a replica failed; retrying in %.0f s", HEAL_EVERY_S)

        threading.Thread(target=heal, name="fleet-heal", daemon=True).start()
        print(f"router: {router.base}", flush=True)
        print(f"controller: http://{args.host}:{args.controller_port}", flush=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)  # uvicorn re-raises it after its shutdown
        config = uvicorn.Config(
            create_controller(fleet), host=args.host, port=args.controller_port, log_level=args.log_level
        )
        uvicorn.Server(config).run()
        stop.set()
    finally:
        fleet.on_join = fleet.on_leave = None  # the router goes first: nothing to tell it
        if router is not None:
            router.stop()
        fleet.shutdown()
    return 0

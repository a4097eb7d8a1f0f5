"""`Fleet`: N data-parallel replicas of one model on Ray, with one fleet-wide weights version.

    fleet = Fleet("ckpt/", replicas=3, tensor_parallel_size=1, weights_root="ckpts/",
                  admin_key="a", max_model_len=4096)
    fleet.urls()                                   # behind a router (hotswap fleet serve)
    fleet.update_weights("step-17", policy="drain")  # every replica at v+1, or none
    fleet.versions()                               # one row per replica
    fleet.shutdown()

Each replica is a Ray actor running `hotswap serve` (replica.py) in its own placement group
(placement.py). An update is the two-phase commit of commit.py. A replica that dies is out of
service (no URL in `urls()`) until `restart(i)`, which starts it, loads the fleet's current
weights (the last committed path, at the fleet's version) and only then puts it back: a
replica behind the router never serves an older version than the fleet's. Options such as
`max_version_lag` are engine options, the same on every replica, so they hold fleet-wide.
"""

from __future__ import annotations

import dataclasses
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from hotswap.errors import ReplicaFailed, ReplicaLost, RequestError
from hotswap.fleet import commit, placement, status
from hotswap.fleet.flags import serve_flags
from hotswap.fleet.replica import ReplicaServer, child_env

STARTUP_TIMEOUT_S = 600.0


@dataclasses.dataclass
class Replica:
    index: int
    actor: Any = None
    group: Any = None
    url: str | None = None
    in_service: bool = False  # healthy and at the fleet's version: in urls(), behind the router


class Fleet:
    def __init__(
        self,
        model: str,
        replicas: int = 1,
        tensor_parallel_size: int = 1,
        *,
        weights_root: str | None = None,
        admin_key: str | None = None,
        api_key: str | None = None,
        served_model_name: str | None = None,
        address: str | None = None,
        host: str = "127.0.0.1",
        log_dir: str | None = None,
        on_join: Callable[[str], None] | None = None,
        on_leave: Callable[[str], None] | None = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        **engine_args,
    ):
        """Start `replicas` replicas of `model` (what `hotswap serve` takes), each on
        `tensor_parallel_size` devices. `weights_root` bounds the paths updates read (required
        for `update_weights`); `address`: an existing Ray cluster (default: the connected one,
        else a local Ray). `on_join(url)` / `on_leave(url)`: a replica entered / left service
        (the CLI adds it to / removes it from the router). A fleet that does not fit the
        cluster is a FleetDoesNotFit before anything starts."""
        import ray

        flags = [model, *serve_flags(engine_args)]  # bad options: a TypeError here, nothing started
        if not ray.is_initialized():
            # Each replica's server writes its own log under log_dir; Ray's copies of its workers'
            # output (the idle workers' included) would only repeat what is there.
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        total, nodes = placement.cluster()
        self.need = placement.check_fits(replicas, tensor_parallel_size, total, nodes)
        flags += ["--tensor-parallel-size", str(tensor_parallel_size), "--log-level", "warning"]
        flags += ["--served-model-name", served_model_name or Path(model).name]
        if weights_root is not None:
            flags += ["--weights-root", str(weights_root)]
        keys = {"HOTSWAP_ADMIN_KEY": admin_key or "", "HOTSWAP_API_KEY": api_key or ""}
        self.flags, self.keys = flags, {k: v for k, v in keys.items() if v}
        self.admin_key, self.api_key, self.host = admin_key, api_key, host
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="hotswap-fleet-"))
        self.on_join, self.on_leave = on_join, on_leave
        self.startup_timeout_s = startup_timeout_s
        self.client = httpx.Client()
        self.replicas = [Replica(i) for i in range(replicas)]
        self.version: int | None = None  # the fleet's: every replica in service serves it
        self.source: str | None = None  # the last committed path
        # What a rejoining replica replays, in order: the last full update (path, version), then
        # each delta committed since (path, version, base_version); deltas only: since the start.
        self.catch_up: list[dict[str, Any]] = []
        self.last_commit: commit.Committed | None = None
        self._lock = threading.Lock()  # one update or rejoin at a time
        try:
            self._start_all()
        except BaseException:
            self.shutdown()
            raise

    # ---- replicas ----------------------------------------------------------------

    def _admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def _api(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _launch(self, r: Replica) -> None:
        import os

        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if r.group is None:
            r.group = placement.reserve(self.need, timeout_s=60.0)
        need = self.need
        options: dict[str, Any] = {
            "num_cpus": need.tp if need.kind == "CPU" else 1,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(r.group, placement_group_bundle_index=0),
        }
        if need.kind == "GPU":
            options["num_gpus"] = need.tp
        elif need.kind == "TPU":
            options["resources"] = {"TPU": need.tp}
        env = child_env(need.kind, need.tp, self.keys, dict(os.environ))
        log = str(self.log_dir / f"replica{r.index}.log")
        r.actor = ray.remote(ReplicaServer).options(**options).remote(self.flags, env, log, self.host)
        r.url = ray.get(r.actor.start.remote())

    def _wait_healthy(self, r: Replica) -> int:
        """Until the replica's /health answers 200; its weights version. ReplicaFailed (with
        its log's tail) if its process ends or it is not up in time."""
        import ray

        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                h = self.client.get(r.url + "/health", timeout=2)
                if h.status_code == 200:
                    return int(h.json()["weights_version"])
            except httpx.TransportError:
                pass
            if not ray.get(r.actor.alive.remote()) or time.monotonic() > deadline:
                tail = ray.get(r.actor.log_tail.remote())
                raise ReplicaFailed(f"replica {r.index} did not start:\n{tail}")
            time.sleep(0.25)

    def _start_all(self) -> None:
        for r in self.replicas:
            self._launch(r)
        versions = {r.index: self._wait_healthy(r) for r in self.replicas}
        if len(set(versions.values())) != 1:
            raise ReplicaFailed(f"replicas started at different weights versions: {versions}")
        self.version = next(iter(versions.values()))
        for r in self.replicas:
            self._join(r)

    def _join(self, r: Replica) -> None:
        r.in_service = True
        if self.on_join is not None:
            self.on_join(r.url)

    def _leave(self, r: Replica) -> None:
        if r.in_service and self.on_leave is not None:
            self.on_leave(r.url)
        r.in_service = False

    def urls(self) -> list[str]:
        """The replicas in service: healthy, at the fleet's version."""
        return [r.url for r in self.replicas if r.in_service]

    def versions(self) -> list[dict[str, Any]]:
        """One row per replica: index, url, in_service, its server's pid (on its node), and what
        the replica itself reports:
        healthy, weights_version, num_reqs, num_waiting_reqs, kv_tokens, kv_use."""
        rows = []
        for r in self.replicas:
            row = {"replica": r.index, "url": r.url, "in_service": r.in_service, "pid": self._pid(r)}
            rows.append({**row, **status.read(self.client, r.url, self._api())})
        return rows

    @staticmethod
    def _pid(r: Replica) -> int | None:
        import ray

        try:
            return None if r.actor is None else ray.get(r.actor.pid.remote(), timeout=10)
        except ray.exceptions.RayError:
            return None

    def kill(self, index: int) -> None:
        """Kill replica `index`'s server (SIGKILL, as a lost node): it leaves service."""
        import ray

        r = self.replicas[index]
        self._leave(r)
        ray.get(r.actor.kill.remote())

    def restart(self, index: int) -> int:
        """(Re)start replica `index` and catch it up: it loads the fleet's current weights at
        the fleet's version before it is back in service. Its version."""
        import ray

        r = self.replicas[index]
        self._leave(r)
        if r.actor is not None:
            try:
                ray.get(r.actor.kill.remote(), timeout=60)
                ray.kill(r.actor)
            except ray.exceptions.RayError:
                pass  # the actor died with its node: nothing of it is left to stop
            r.actor = None
        self._launch(r)
        started = self._wait_healthy(r)
        with self._lock:  # no fleet commit between the catch-up and the join
            if self.version is not None and started != self.version:
                first = self.catch_up[0] if self.catch_up else {}
                if not first or first.get("base_version", started) != started:
                    raise ReplicaFailed(
                        f"replica {index} started at version {started}, the fleet is at {self.version}, "
                        "and the fleet has no committed source that leads there from it"
                    )
                member = commit.Member(index, r.url)
                for step in self.catch_up:  # a full update, then the deltas on it, each checked
                    body = {"update_id": f"catch-up-{uuid.uuid4().hex}", "policy": "abort", **step}
                    commit.commit(self._client_admin(), [member], body)
            self._join(r)
            return self.version

    def heal(self) -> list[int]:
        """Restart (and catch up) every replica whose server process is gone or that left
        service (a commit it failed); their indexes. `hotswap fleet serve` calls this every few
        seconds."""
        gone = [r.index for r in self.replicas if not (r.in_service and self._alive(r))]
        for index in gone:
            self.restart(index)
        return gone

    @staticmethod
    def _alive(r: Replica) -> bool:
        """Its server process runs (asked of its actor: a busy server is slow to answer HTTP,
        not lost; one that hangs is found out by the commit's own timeouts)."""
        import ray

        try:
            return r.actor is not None and ray.get(r.actor.alive.remote(), timeout=30)
        except ray.exceptions.RayError:
            return False  # the actor itself died (its node did)

    def _client_admin(self) -> httpx.Client:
        return httpx.Client(headers=self._admin())

    # ---- the fleet-wide update ------------------------------------------------------

    def update_weights(self, path: str, policy: str = "drain", **options) -> commit.Committed:
        """Every replica in service to the weights at `path` (under `weights_root`) as version
        v+1, or none (commit.py). `policy`: drain / keep / recompute / abort, as on one engine;
        `options`: the rest of UpdateOptions (e.g. `drain_timeout_s`; `base_version`: `path`
        holds a delta, `hotswap.weights.delta`, which every replica refuses unless it serves
        that version, so none commits). A replica's refusal is
        raised as its typed error (WeightsMismatch for a shape error ...), a replica lost while
        staging as ReplicaLost; either way nothing commits and all keep serving v."""
        if not isinstance(path, str):
            raise RequestError(
                "a fleet update takes a path under weights_root (a rejoining replica loads the same path)"
            )
        if "version" in options:
            raise RequestError("a fleet update's version is the fleet's next version; do not pass one")
        with self._lock:
            members = self._live_members()
            body = {"update_id": uuid.uuid4().hex, "path": path, "policy": policy, **options}
            body["version"] = self.version + 1
            try:
                with self._client_admin() as client:
                    done = commit.commit(client, members, body)
            except ReplicaLost:
                self._live_members()  # the lost ones leave service; nothing committed anywhere
                raise
            for index in done.lost:
                self._leave(self.replicas[index])
            self.version, self.source, self.last_commit = done.version, path, done
            step = {"path": path, "version": done.version}
            if options.get("base_version") is not None:  # a delta: replayed on the chain it applies to
                self.catch_up.append({**step, "base_version": options["base_version"]})
            else:
                self.catch_up = [step]
            return done

    def _live_members(self) -> list[commit.Member]:
        """The replicas in service whose server process still runs; one that does not leaves
        service (it catches up when restarted) and the update goes on without it."""
        members = []
        for r in self.replicas:
            if r.in_service and self._alive(r):
                members.append(commit.Member(r.index, r.url))
            else:
                self._leave(r)
        if not members:
            raise ReplicaFailed("no replica is in service")
        return members

    # ---- shutdown ---------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every replica (SIGTERM: in-flight work drains) and release its placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for r in self.replicas:
            self._leave(r)
            if r.actor is not None:
                try:
                    ray.get(r.actor.stop.remote())
                    ray.kill(r.actor)
                except ray.exceptions.RayError:
                    pass  # the actor is already gone: so is its server
                r.actor = None
            if r.group is not None:
                remove_placement_group(r.group)
                r.group = None
        self.client.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

"""The fleet-wide commit: two phases over the replicas' admin routes (api/routes_fleet.py).

    pass 1  prepare  every replica in parallel: read, check, place the new weights; serving goes on
            -> any refusal or lost replica: abort on every replica, nothing commits, the error raised
    pass 2  commit   every replica in parallel: pause (the policy's mode), swap to v+1, stay paused
    barrier resume   only once all swapped: every replica resumes, serving v+1

So no replica serves v+1 while another still serves v: between the first swap and the last
resume, the swapped replicas hold new requests (their streams stay open) instead of answering
them. Pass 2 can fail only as a device or a process does; a replica that fails it is reported
lost (the fleet takes it out of service until it restarts and catches up), the others go on.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from hotswap.errors import HotswapError, ReplicaLost
from hotswap.fleet.remote_errors import raise_for

PREPARE_TIMEOUT_S = 600.0  # reading and placing a large checkpoint
COMMIT_TIMEOUT_S = 600.0  # a drain waits for the longest request in flight


@dataclasses.dataclass(frozen=True)
class Member:
    index: int
    url: str


@dataclasses.dataclass(frozen=True)
class Committed:
    """What a fleet commit did, timed at the fleet (seconds). `swap_skew_s`: first to last
    replica finishing its swap (its drain included: a replica with a longer request in flight
    swaps later, serving nothing new meanwhile); `flip_skew_s`: first to last replica resuming,
    the spread of the moments replicas start serving v+1 (the commit skew a client can see)."""

    version: int
    committed: list[int]
    lost: dict[int, str]
    prepare_s: float
    commit_s: float
    swap_skew_s: float
    flip_skew_s: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _post(client: httpx.Client, m: Member, path: str, body: dict, timeout_s: float) -> dict:
    where = f"replica {m.index} ({m.url})"
    try:
        r = client.post(m.url + path, json=body, timeout=timeout_s)
    except httpx.TransportError as e:
        raise ReplicaLost(f"{where} did not answer {path}: {type(e).__name__}: {e}") from None
    raise_for(r, where)
    return r.json()


def _each(members: list[Member], fn) -> list[tuple[Member, Any, BaseException | None, float]]:
    """fn(member) on every member at once: (member, result, error, monotonic time it ended)."""

    def run(m: Member):
        try:
            out = fn(m)
            return m, out, None, time.monotonic()
        except HotswapError as e:
            return m, None, e, time.monotonic()

    with ThreadPoolExecutor(max(1, len(members))) as pool:
        return list(pool.map(run, members))


def _spread(times: list[float]) -> float:
    return max(times) - min(times) if times else 0.0


def abort_all(client: httpx.Client, members: list[Member], update_id: str) -> None:
    """Drop `update_id` wherever it is staged; a replica that cannot answer has nothing staged
    that could ever commit (its process is gone, or it drops it when it restarts)."""
    _each(members, lambda m: _post(client, m, "/fleet/abort", {"update_id": update_id}, 60.0))


def commit(client: httpx.Client, members: list[Member], body: dict[str, Any]) -> Committed:
    """Run both passes for `body` (update_id, the source, its options with `version`)."""
    uid = body["update_id"]
    t0 = time.monotonic()
    prepared = _each(members, lambda m: _post(client, m, "/fleet/prepare", body, PREPARE_TIMEOUT_S))
    refused = [(m, e) for m, _, e, _ in prepared if e is not None]
    if refused:
        abort_all(client, members, uid)
        first = refused[0][1]
        if len(refused) > 1:  # every refusal is named; the first is raised as its own type
            others = "; ".join(str(e) for _, e in refused[1:])
            first.args = (f"{first} (also: {others})",)
        raise first
    t1 = time.monotonic()
    swapped = _each(
        members, lambda m: _post(client, m, "/fleet/commit", {"update_id": uid}, COMMIT_TIMEOUT_S)
    )
    ok = [(m, out, t) for m, out, e, t in swapped if e is None]
    lost = {m.index: str(e) for m, _, e, _ in swapped if e is not None}
    t2 = time.monotonic()
    resumed = _each([m for m, _, _ in ok], lambda m: _post(client, m, "/fleet/resume", {}, 60.0))
    lost.update({m.index: str(e) for m, _, e, _ in resumed if e is not None})
    if not ok:
        raise ReplicaLost(f"no replica committed fleet update {uid!r}: {lost}")
    versions = {out["weights_version"] for _, out, _ in ok}
    (version,) = versions  # every replica was asked for the same explicit version
    return Committed(
        version=version,
        committed=sorted(m.index for m, _, _ in ok if m.index not in lost),
        lost=lost,
        prepare_s=t1 - t0,
        commit_s=t2 - t1,
        swap_skew_s=_spread([t for _, _, t in ok]),
        flip_skew_s=_spread([t for _, _, e, t in resumed if e is None]),
    )

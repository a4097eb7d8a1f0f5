"""Device-to-device weight pushes between JAX processes (`jax.experimental.transfer`).

A trainer calls `publish(params)`: its params stay on its devices, a transfer server
in its process offers them once, and it gets back a `TransferRef(address, uuid)`,
small enough to send over HTTP (`POST /update_weights {"transfer": {...}}`) or to
pass to `LLM.update_weights`. The engine side is a row of the ingest pipeline's reader
table (`weights/readers.py`): `open_offer(ref, abstract)` connects to that address and reads
the manifest, the plan (`weights/plan.py`) checks it, and only then does `fetch` pull the
arrays straight into the engine's shardings, to be checked for NaN/Inf and placed as any
in-process params tree (`weights/place.py`).

What one publish offers, under three consecutive uuids (each can be pulled once):

    uuid     int32[2]        header: [MAGIC, manifest length in bytes]
    uuid+1   uint8[n]        manifest: JSON, per leaf its name, shape, dtype and shard slices
    uuid+2   the leaves      in the tree's flatten order, each as the trainer's shards

The manifest exists because JAX's pull needs the receiver to name every shape in
advance, and on a mismatch it fails with an opaque buffer error (or overruns); the
engine checks the manifest against its own spec first and names the tensor.

JAX's own `timeout` argument to `pull` is not honoured (a pull from an address nobody
serves, or of a uuid nobody published, waits forever), so the engine side connects
over TCP first (a closed port fails at once) and polls each pull's readiness up to
`TransferRef.timeout_s`. A pull that times out leaves its receive buffers pending:
the header is 8 bytes, so a wrong uuid costs nothing; a trainer that stalls (not
dies: a dead peer closes the socket and the pull fails at once) in the middle of
the data pull leaves one params-sized buffer until the process exits.

For an engine that runs in several processes, `publish(params, for_processes=N)` makes
one offer per engine process (at `uuid + 4 * p`), each with only that process's shards
(`process_offer`, `_open_shards`: the last section).

Transfer servers bind 127.0.0.1 unless told otherwise: anything that can reach
the port can offer or fetch arrays, and there is no authentication.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.errors import TransferError
from hotswap.model.spec import path_name

MAGIC = 0x48535754  # "HSWT"
DEFAULT_BIND = "127.0.0.1"
DEFAULT_TIMEOUT_S = 60.0

_servers: dict[tuple[int, str], Any] = {}
_servers_lock = threading.Lock()
# uuids are (random base + 4 * n): one publish takes three, and two processes publishing to the
# same engine do not collide (a transfer server is per process, so only the address must differ).
_uuids = itertools.count(int.from_bytes(os.urandom(5), "little") * 4, 4)
_uuids_lock = threading.Lock()  # a per-process publish needs N consecutive values
MAX_PROCESSES = 4096
# Bytes this process pulled as weights (not headers or manifests): what a test or a
# benchmark reads to see that each engine process pulled only its own shards.
stats = {"pulls": 0, "bytes": 0}


@dataclasses.dataclass(frozen=True)
class TransferRef:
    """Where a published params tree can be pulled from, and how long a pull may wait."""

    address: str
    uuid: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    processes: int = 1  # offers, one per engine process (`publish(for_processes=...)`)

    def __post_init__(self):
        host, _, port = self.address.rpartition(":") if isinstance(self.address, str) else ("", "", "")
        if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
            raise TransferError(f"transfer address must be 'host:port', got {self.address!r}")
        if isinstance(self.uuid, bool) or not isinstance(self.uuid, int) or not 0 <= self.uuid < 2**62:
            raise TransferError(f"transfer uuid must be an integer in [0, 2**62), got {self.uuid!r}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t <= 3600 and math.isfinite(t)):
            raise TransferError(f"transfer timeout_s must be in (0, 3600] seconds, got {t!r}")
        n = self.processes
        if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= MAX_PROCESSES:
            raise TransferError(f"transfer processes must be an integer in [1, {MAX_PROCESSES}], got {n!r}")

    def offer(self, process: int) -> TransferRef:
        """The one-offer ref of engine process `process`'s shards."""
        return dataclasses.replace(self, uuid=self.uuid + 4 * process, processes=1)

    @classmethod
    def from_json(cls, obj: Any) -> TransferRef:
        """From the `transfer` field of an update body: {"address", "uuid", "timeout_s"?, "processes"?}."""
        if not isinstance(obj, Mapping) or not {"address", "uuid"} <= obj.keys():
            raise TransferError('"transfer" must be an object {"address": "host:port", "uuid": N}')
        extra = sorted(set(obj) - {"address", "uuid", "timeout_s", "processes"})
        if extra:
            raise TransferError(f'"transfer" has unknown field(s): {", ".join(extra)}')
        return cls(
            obj["address"], obj["uuid"], obj.get("timeout_s", DEFAULT_TIMEOUT_S), obj.get("processes", 1)
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def server(bind: str = DEFAULT_BIND, client=None):
    """This process's transfer server on `bind` (a host; the port is picked), started once."""
    from jax.experimental import transfer

    client = client or jax.devices()[0].client
    key = (id(client), bind)
    with _servers_lock:
        if key not in _servers:
            host = f"[{bind}]" if ":" in bind else bind
            _servers[key] = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
        return _servers[key]


# --------------------------------------------------------------------------- trainer side


def _slices(index: tuple, shape: tuple[int, ...]) -> list[list[int]]:
    """A shard's index (a tuple of slices) as [[start, stop], ...] per dimension."""
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)]


def _header_and_manifest(manifest: dict) -> tuple[jax.Array, jax.Array]:
    blob = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
    return jnp.asarray(np.array([MAGIC, blob.size], np.int32)), jnp.asarray(blob)


def _flat(params: Any) -> tuple[list[str], list[jax.Array]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return [path_name(p) for p, _ in flat], [
        x if isinstance(x, jax.Array) else jnp.asarray(x) for _, x in flat
    ]


def offer_arrays(params: Any) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """A tree's leaves (on a device), header and manifest: what `publish` offers."""
    names, leaves = _flat(params)
    manifest = {
        "leaves": [
            {
                "name": name,
                "shape": list(x.shape),
                "dtype": np.dtype(x.dtype).name,
                "shards": [_slices(s.index, x.shape) for s in x.addressable_shards],
            }
            for name, x in zip(names, leaves, strict=True)
        ]
    }
    return (leaves, *_header_and_manifest(manifest))


def take_uuids(n: int = 1) -> int:
    """The first of `n` consecutive offer uuids (4 apart: each offer takes three)."""
    with _uuids_lock:
        first = next(_uuids)
        for _ in range(n - 1):
            next(_uuids)
    return first


def publish(
    params: Any, *, for_processes: int = 1, bind: str = DEFAULT_BIND, timeout_s: float = DEFAULT_TIMEOUT_S
) -> TransferRef:
    """Offer `params` (any pytree of arrays) for one pull; returns where to pull it from.

    Arrays stay where they are (host numpy leaves are put on the default device first);
    the transfer server keeps them alive until the engine has pulled them. With
    `for_processes=N`, one offer per engine process, each with that process's shards
    (see the module docstring for the layout).
    """
    srv = server(bind)
    if for_processes == 1:
        offers = [offer_arrays(params)]
    else:
        offers = [process_offer(params, p, for_processes) for p in range(for_processes)]
    ref = TransferRef(srv.address(), take_uuids(for_processes), timeout_s, for_processes)
    for p, (leaves, header, blob) in enumerate(offers):
        uuid = ref.uuid + 4 * p
        srv.await_pull(uuid, [header])
        srv.await_pull(uuid + 1, [blob])
        srv.await_pull(uuid + 2, leaves)
    return ref


# --------------------------------------------------------------------------- engine side


def _wait(arrays: list, ref: TransferRef, deadline: float, what: str) -> list:
    """Wait until `arrays` (a pull's results) are ready, or fail by the deadline.

    Polls `is_ready()` rather than blocking in a helper thread: a thread stuck in a pull
    that never completes would abort the interpreter at exit."""
    pause = 1e-4
    while not all(x.is_ready() for x in arrays):
        if time.monotonic() > deadline:
            raise TransferError(
                f"transfer {ref.address} uuid {ref.uuid}: no {what} within {ref.timeout_s:g} s (the uuid "
                "was never published or was already pulled, or the trainer stalled)"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    try:
        return jax.block_until_ready(arrays)
    except jax.errors.JaxRuntimeError as e:  # a closed connection, a size mismatch
        raise TransferError(
            f"transfer {ref.address} uuid {ref.uuid}: pulling the {what} failed: {e}"
        ) from None


def _reachable(ref: TransferRef, deadline: float) -> None:
    """A TCP connect first: JAX's connect() to a closed port neither fails nor times out."""
    host, _, port = ref.address.rpartition(":")
    try:
        socket.create_connection(
            (host.strip("[]"), int(port)), timeout=max(0.1, deadline - time.monotonic())
        ).close()
    except OSError as e:
        raise TransferError(f"transfer {ref.address} uuid {ref.uuid}: cannot connect: {e}") from None


def _receive_specs(leaves: list[dict], want: list[tuple[str, Any]], ref: TransferRef) -> list:
    """What to pull into: the engine's own specs when the trainer's shards are this process's
    shards of them (no copy after the pull); else, for a trainer whose leaves are whole
    arrays, one device here (`place.place_params` then reshards on the device)."""

    def own(spec) -> list:
        return [
            _slices(i, spec.shape) for i in spec.sharding.addressable_devices_indices_map(spec.shape).values()
        ]

    if all(leaf["shards"] == own(spec) for leaf, (_, spec) in zip(leaves, want, strict=True)):
        return [spec for _, spec in want]
    for leaf in leaves:
        if leaf["shards"] != [[[0, n] for n in leaf["shape"]]]:
            raise TransferError(
                f"transfer {ref.address} uuid {ref.uuid}: {leaf['name']} is published in "
                f"{len(leaf['shards'])} shards that are not this engine's; publish whole arrays "
                "(one device) or the engine's own layout"
            )
    dev = jax.sharding.SingleDeviceSharding(next(iter(want[0][1].sharding.addressable_devices)))
    return [jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=dev) for _, spec in want]


def _pull_manifest(conn, ref: TransferRef, deadline: float, dev) -> dict:
    """The header, then the manifest, of the offer at `ref.uuid`."""
    (header,) = _wait(
        conn.pull(ref.uuid, [jax.ShapeDtypeStruct((2,), jnp.int32, sharding=dev)]), ref, deadline, "header"
    )
    magic, size = (int(v) for v in np.asarray(header))
    if magic != MAGIC or not 0 < size < 1 << 30:
        raise TransferError(
            f"transfer {ref.address} uuid {ref.uuid}: not a hotswap.weights.transfer.publish() offer (bad header)"
        )
    (blob,) = _wait(
        conn.pull(ref.uuid + 1, [jax.ShapeDtypeStruct((size,), jnp.uint8, sharding=dev)]),
        ref,
        deadline,
        "manifest",
    )
    try:
        manifest = json.loads(np.asarray(blob).tobytes())
        manifest["leaves"]  # noqa: B018 (a KeyError is an unreadable manifest)
        return manifest
    except (ValueError, KeyError, TypeError) as e:
        raise TransferError(f"transfer {ref.address} uuid {ref.uuid}: unreadable manifest: {e}") from None


def _where(ref: TransferRef) -> str:
    return f"transfer {ref.address} uuid {ref.uuid}: "


def _pull_weights(conn, ref: TransferRef, specs: list, deadline: float) -> list:
    arrays = _wait(conn.pull(ref.uuid + 2, specs), ref, deadline, "weights")
    stats["pulls"] += 1
    stats["bytes"] += sum(x.nbytes for x in arrays)
    return arrays


def _first_device(want: list[tuple[str, Any]]):
    return jax.sharding.SingleDeviceSharding(min(want[0][1].sharding.addressable_devices, key=lambda d: d.id))


@dataclasses.dataclass(frozen=True)
class Offer:
    """An offer opened: its manifest read (`layout`, name -> (shape, dtype) in the sender's
    flatten order), no weight moved yet; `fetch(abstract)` moves them (`weights/place.py`, once
    `weights/plan.py` has checked the layout)."""

    where: str
    layout: dict[str, tuple[tuple[int, ...], str]]
    fetch: Callable[[Any], Any]


def _layout(leaves: list[dict]) -> dict[str, tuple[tuple[int, ...], str]]:
    try:
        return {e["name"]: (tuple(e["shape"]), e["dtype"]) for e in leaves}
    except (KeyError, TypeError) as e:
        raise TransferError(f"unreadable manifest entry: {e}") from None


def open_offer(ref: TransferRef, abstract: Any, *, bind: str = DEFAULT_BIND) -> Offer:
    """Connect to a published tree and read its manifest. A one-offer ref is pulled whole
    (`_fetch_whole`); a per-process one (`processes` > 1) by this process, its own shards
    (`_fetch_shards`). Raises TransferError (unreachable, timed out, peer gone); the weights,
    fetched later, return nothing partial."""
    if ref.processes != 1:
        if jax.process_count() == 1:
            raise TransferError(
                f"transfer {ref.address} uuid {ref.uuid}: published for {ref.processes} engine processes "
                "(publish(for_processes=...)); this engine runs in one process and pulls one offer"
            )
        return _open_shards(ref, abstract, jax.process_index(), bind)
    want = [(path_name(p), spec) for p, spec in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    deadline = time.monotonic() + ref.timeout_s
    try:
        _reachable(ref, deadline)
        conn = server(bind).connect(ref.address)
        leaves = _pull_manifest(conn, ref, deadline, _first_device(want))["leaves"]
    except jax.errors.JaxRuntimeError as e:  # connect() or pull() refusing before any wait
        raise TransferError(f"transfer {ref.address} uuid {ref.uuid}: {e}") from None

    def fetch(abstract: Any) -> Any:
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        want = [(path_name(p), spec) for p, spec in flat]
        try:
            arrays = _pull_weights(conn, ref, _receive_specs(leaves, want, ref), deadline)
        except jax.errors.JaxRuntimeError as e:
            raise TransferError(f"transfer {ref.address} uuid {ref.uuid}: {e}") from None
        return treedef.unflatten(arrays)

    return Offer(_where(ref), _layout(leaves), fetch)


# --------------------------------------------------------------------------- per-process offers
#
# For an engine that runs in several processes (`engine/multihost.py`) the trainer lays its
# params out the way the engine does (`sharding.engine_shardings` over N x L devices, where the
# engine has L devices per process): its devices, sorted by id, are split into N consecutive
# groups and group p's shards are process p's offer. Each process pulls its own offer
# (`_open_shards`) into single-device buffers and assembles the engine's global arrays from
# them; a shard whose slice is not one the process holds is refused by name before any weight
# moves. A per-process ref cannot be pulled by `pull` (a single-process engine), and a
# one-offer ref sent to several processes is pulled by process 0 and broadcast (the generic
# path). `engine/multihost_transfer.py` runs the pull on every process and agrees on the outcome.


def process_offer(params: Any, process: int, processes: int) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """Engine process `process`'s shards of `params` (single-device arrays), header and manifest.

    The devices holding `params`, sorted by id, split into `processes` consecutive groups:
    group p's shards, each leaf's in device order, are process p's."""
    names, leaves = _flat(params)
    devices = sorted({d for x in leaves for d in x.sharding.device_set}, key=lambda d: d.id)
    if len(devices) % processes:
        raise TransferError(
            f"publish(for_processes={processes}): the params are on {len(devices)} device(s), "
            "not a multiple; lay them out as the engine does over its processes' devices"
        )
    k = len(devices) // processes
    group = set(devices[process * k : (process + 1) * k])
    arrays, entries = [], []
    for name, x in zip(names, leaves, strict=True):
        shards = sorted((s for s in x.addressable_shards if s.device in group), key=lambda s: s.device.id)
        if not shards:
            raise TransferError(
                f"publish(for_processes={processes}): {name} has no shard for process {process}"
            )
        arrays += [s.data for s in shards]
        entries.append(
            {
                "name": name,
                "shape": list(x.shape),
                "dtype": np.dtype(x.dtype).name,
                "shards": [_slices(s.index, x.shape) for s in shards],
            }
        )
    manifest = {"leaves": entries, "process": process, "processes": processes}
    return (arrays, *_header_and_manifest(manifest))


def _shard_specs(leaves: list[dict], want: list[tuple[str, Any]], ref: TransferRef) -> tuple[list, list]:
    """Per offered shard, a single-device buffer on the local device that holds that slice
    of the engine's array; and per leaf, how many shards it has."""
    where = f"transfer {ref.address} uuid {ref.uuid}"
    specs, counts = [], []
    for leaf, (name, spec) in zip(leaves, want, strict=True):
        own = {
            d: _slices(i, spec.shape)
            for d, i in spec.sharding.addressable_devices_indices_map(spec.shape).items()
        }
        if len(leaf["shards"]) != len(own):
            raise TransferError(
                f"{where}: {name}: the offer has {len(leaf['shards'])} shard(s), this process holds "
                f"{len(own)}; publish the engine's layout"
            )
        for sl in leaf["shards"]:
            dev = next((d for d, s in own.items() if s == sl), None)
            if dev is None:
                raise TransferError(
                    f"{where}: {name}: shard {sl} is not one this process holds "
                    f"({sorted(own.values())}); publish the engine's layout"
                )
            del own[dev]
            shape = tuple(b - a for a, b in sl)
            specs.append(
                jax.ShapeDtypeStruct(shape, spec.dtype, sharding=jax.sharding.SingleDeviceSharding(dev))
            )
        counts.append(len(leaf["shards"]))
    return specs, counts


def _open_shards(ref: TransferRef, abstract: Any, process: int, bind: str) -> Offer:
    """Engine process `process`'s offer of a per-process publish. Only this process's shards
    move; each global array is assembled from them (`jax.make_array_from_single_device_arrays`:
    no copy, no collective)."""
    if ref.processes != jax.process_count() or not 0 <= process < ref.processes:
        raise TransferError(
            f"transfer {ref.address} uuid {ref.uuid}: published for {ref.processes} engine process(es), "
            f"this engine runs in {jax.process_count()}"
        )
    mine = ref.offer(process)
    want = [(path_name(p), spec) for p, spec in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    deadline = time.monotonic() + ref.timeout_s
    try:
        _reachable(mine, deadline)
        conn = server(bind).connect(mine.address)
        manifest = _pull_manifest(conn, mine, deadline, _first_device(want))
    except jax.errors.JaxRuntimeError as e:
        raise TransferError(f"transfer {mine.address} uuid {mine.uuid}: {e}") from None
    if manifest.get("process") != process or manifest.get("processes") != ref.processes:
        raise TransferError(
            f"transfer {mine.address} uuid {mine.uuid}: not process {process}'s offer of "
            f"{ref.processes} (the manifest says process {manifest.get('process')!r} of "
            f"{manifest.get('processes')!r})"
        )

    def fetch(abstract: Any) -> Any:
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        want = [(path_name(p), spec) for p, spec in flat]
        try:
            specs, counts = _shard_specs(manifest["leaves"], want, mine)
            arrays = iter(_pull_weights(conn, mine, specs, deadline))
        except jax.errors.JaxRuntimeError as e:
            raise TransferError(f"transfer {mine.address} uuid {mine.uuid}: {e}") from None
        return treedef.unflatten(
            [
                jax.make_array_from_single_device_arrays(
                    spec.shape, spec.sharding, [next(arrays) for _ in range(n)]
                )
                for (_, spec), n in zip(want, counts, strict=True)
            ]
        )

    return Offer(_where(mine), _layout(manifest["leaves"]), fetch)

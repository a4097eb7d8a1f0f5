"""Per-process transfer offers: each engine process of a multi-host engine pulls its own shards.

For an engine that runs in several processes (`engine/multihost.py`), a trainer calls
`transfer.publish(params, for_processes=N)`: one offer per engine process (header,
manifest and weights, as `transfer.py` describes, at `uuid + 4 * p` for process p),
each holding only the shards that process addresses, so no process pulls the whole
tree. The trainer lays its params out the
way the engine does (`sharding.engine_shardings` over N x L devices, where the
engine has L devices per process): its devices, sorted by id, are split into N
consecutive groups and group p's shards are process p's offer. Each process pulls
its own offer (`pull_shards`) into single-device buffers and assembles the engine's
global arrays from them; a shard whose slice is not one the process holds is refused
by name before any weight moves. A per-process ref cannot be pulled by `pull` (a
single-process engine), and a one-offer ref sent to several processes is pulled by
process 0 and broadcast (the generic path).

This module builds those offers (`process_offer`) and pulls one (`pull_shards`);
`engine/multihost_transfer.py` runs the pull on every process and agrees on the outcome.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from hotswap.errors import TransferError
from hotswap.model.spec import path_name
from hotswap.weights.transfer import (
    DEFAULT_BIND,
    TransferRef,
    _check_manifest,
    _first_device,
    _flat,
    _header_and_manifest,
    _pull_manifest,
    _pull_weights,
    _reachable,
    _slices,
    server,
)


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


def pull_shards(ref: TransferRef, abstract: Any, process: int, *, bind: str = DEFAULT_BIND) -> Any:
    """Engine process `process`'s offer of a per-process publish, as the engine's global arrays.

    Only this process's shards move; each global array is assembled from them
    (`jax.make_array_from_single_device_arrays`: no copy, no collective). Raises as `pull`.
    """
    if ref.processes != jax.process_count() or not 0 <= process < ref.processes:
        raise TransferError(
            f"transfer {ref.address} uuid {ref.uuid}: published for {ref.processes} engine process(es), "
            f"this engine runs in {jax.process_count()}"
        )
    mine = ref.offer(process)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    want = [(path_name(p), spec) for p, spec in flat]
    deadline = time.monotonic() + ref.timeout_s
    try:
        _reachable(mine, deadline)
        conn = server(bind).connect(mine.address)
        manifest = _pull_manifest(conn, mine, deadline, _first_device(want))
        if manifest.get("process") != process or manifest.get("processes") != ref.processes:
            raise TransferError(
                f"transfer {mine.address} uuid {mine.uuid}: not process {process}'s offer of "
                f"{ref.processes} (the manifest says process {manifest.get('process')!r} of "
                f"{manifest.get('processes')!r})"
            )
        _check_manifest(manifest["leaves"], want, mine)
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

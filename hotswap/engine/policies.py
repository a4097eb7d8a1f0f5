"""The in-flight policies of a weight update: what happens to requests already running.

One row per policy; the Engine reads the row's columns and never branches on a policy's name
(docs/en/weight_updates.md, "In-flight requests during an update").

| policy      | drains | refuses if busy | aborts | recomputes | keeps tables | marks mixed |
|-------------|--------|-----------------|--------|------------|--------------|-------------|
| `drain`     | yes    |                 |        |            |              |             |
| `abort`     |        |                 | yes    |            |              |             |
| `recompute` |        |                 |        | yes        |              |             |
| `keep`      |        |                 |        |            | yes          | yes         |
| `reject`    |        | yes             |        |            |              |             |

A drain that times out aborts what still runs. Under `keep`, running sequences whose oldest KV
lags more than `max_version_lag` versions are recomputed after the swap (`pausing.stale`).
"""

from __future__ import annotations

import dataclasses

from hotswap.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    # Hold new requests and step until started ones finish on the old weights, then swap.
    drains: bool = False
    # LifecycleConflict when any request is in flight or any page cached: nothing is touched.
    refuses_if_busy: bool = False
    # Started requests end at the swap, finish_reason "abort", with their partial output.
    aborts: bool = False
    # Running sequences are preempted (pages released, tokens kept) and re-prefilled on the new weights.
    recomputes: bool = False
    # Running sequences' block tables survive the swap; every other page is freed.
    keeps_tables: bool = False
    # Their KV mixes versions, so their tokens are labelled (`mixed_weights_kv`).
    marks_mixed: bool = False


DRAIN = Policy("drain", drains=True)
ABORT = Policy("abort", aborts=True)
RECOMPUTE = Policy("recompute", recomputes=True)
KEEP = Policy("keep", keeps_tables=True, marks_mixed=True)
REJECT = Policy("reject", refuses_if_busy=True)

POLICIES: dict[str, Policy] = {p.name: p for p in (DRAIN, ABORT, RECOMPUTE, KEEP, REJECT)}


def policy(name: str) -> Policy:
    """The row of update policy `name`; ConfigError for an unknown name."""
    if name not in POLICIES:
        raise ConfigError(f"unknown update policy {name!r}; use one of {tuple(POLICIES)}")
    return POLICIES[name]

"""A weight update from a per-process transfer offer, run on every engine process at once.

`transfer.publish(params, for_processes=N)` makes one offer per engine process;
the Driver broadcasts only the reference (`kind="transfer"`), and every process
runs `update` on it: each opens its own offer and pulls its shards (`transfer.open_offer`), then
all of them agree, then all of them stage and swap.

The agreement is what keeps a failure clean. A pull fails on one process only
(its offer was wrong, its peer stalled), and staging is collective (the
finiteness check is a jitted reduction over the global arrays), so a process
that went on alone would leave the others in a collective, or worse, swap on
some processes only. So every process reports its pull's outcome in one
`process_allgather` (a fixed-size buffer: ok, or the typed error's name and
message), and if any failed, every process raises the same error (the first
failing process's, naming it) and keeps the old version. After the agreement
the update is the ordinary `Engine.update_weights` on identical global arrays,
whose checks fail the same way everywhere.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
from jax.experimental import multihost_utils

from hotswap import errors
from hotswap.engine.engine import Engine
from hotswap.errors import HotswapError, TransferError
from hotswap.weights import place, plan, readers, transfer
from hotswap.weights.options import UpdateOptions

REPORT_BYTES = 1024  # one process's outcome: empty for ok, else JSON {"type", "message"}


def _encode(err: BaseException | None) -> np.ndarray:
    buf = np.zeros(REPORT_BYTES, np.uint8)
    if err is not None:
        kind = type(err).__name__ if isinstance(err, HotswapError) else "TransferError"
        message = str(err) if isinstance(err, HotswapError) else f"{type(err).__name__}: {err}"
        raw = json.dumps({"type": kind, "message": message[: REPORT_BYTES // 2]}).encode()[:REPORT_BYTES]
        buf[: len(raw)] = np.frombuffer(raw, np.uint8)
    return buf


def agree(err: BaseException | None) -> HotswapError | None:
    """Every process's outcome, gathered: the same error on every process if any failed."""
    rows = np.asarray(multihost_utils.process_allgather(_encode(err))).reshape(-1, REPORT_BYTES)
    failed = [(p, bytes(row).rstrip(b"\0")) for p, row in enumerate(rows) if row.any()]
    if not failed:
        return None
    p, raw = failed[0]
    try:
        report = json.loads(raw)
        cls = getattr(errors, report["type"], TransferError)
        message = report["message"]
    except (ValueError, KeyError, TypeError):  # a message cut mid-character: still a failure
        cls, message = TransferError, raw.decode(errors="replace")
    if not (isinstance(cls, type) and issubclass(cls, HotswapError)):
        cls = TransferError
    more = f" (and {len(failed) - 1} more process(es))" if len(failed) > 1 else ""
    return cls(f"process {p}: {message}{more}")


def update(engine: Engine, ref: transfer.TransferRef, options: UpdateOptions) -> int:
    """Open and check this process's offer, pull its shards, agree with the others, then swap;
    the same result everywhere."""
    checked, err = None, None
    options = dataclasses.replace(options, drain_timeout_s=math.inf)
    try:
        opened = readers.read(ref, engine.mcfg, abstract=engine.abstract)
        checked = plan.plan(opened, engine.mcfg, engine.abstract, options=options)
        checked = place.holding(checked, place.fetched(checked))
    except Exception as e:  # noqa: BLE001 (any failure must still reach the agreement)
        err = e
    failed = agree(err)
    if failed is not None:
        raise failed
    return engine.update_planned(checked)

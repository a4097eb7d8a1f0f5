"""Pause modes: what `Engine.pause(mode)` does to in-flight requests, and which in-flight policy
an update made during the pause applies.

A pause is request-side bookkeeping (the engine stops stepping; nothing in `EngineState`
changes by pausing), so it lives in the lifecycle controller (controller.py), not in the
state. The modes are SGLang's (`abort`, `retract`, `in_place`) and vLLM's (`abort`, `wait`,
`keep`):

| mode       | at pause                                         | an update while paused: its policy  |
|------------|--------------------------------------------------|-------------------------------------|
| `abort`    | every request ends now (finish_reason "abort")   | `abort` (nothing is in flight)      |
| `wait`     | new requests are held; started ones finish       | `recompute` (nothing is in flight)  |
| `retract`  | running sequences go back to the queue, KV freed | `recompute`: re-prefilled at resume |
| `in_place` | running sequences keep their pages               | `keep`: pages kept, labelled mixed  |
| `keep`     | the same as `in_place`                           | the same as `in_place`              |

One `PauseMode` row per mode says both; the controller reads the row, never the mode's name.

Requests sent during a pause are queued and start at `resume()`; streams stay open.
"""

from __future__ import annotations

import dataclasses

from hotswap.engine.policies import ABORT, KEEP, RECOMPUTE, Policy
from hotswap.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class PauseMode:
    name: str
    # The in-flight policy of an update made while paused in this mode (applied without a drain).
    update: Policy
    # At the pause: started requests finish first (new ones are held meanwhile).
    drains: bool = False
    # At the pause: every request, queued ones too, ends now (finish_reason "abort").
    aborts: bool = False
    # At the pause: running sequences go back to the queue, their KV freed.
    retracts: bool = False


PAUSE_MODES: dict[str, PauseMode] = {
    m.name: m
    for m in (
        PauseMode("abort", ABORT, aborts=True),
        PauseMode("wait", RECOMPUTE, drains=True),
        PauseMode("retract", RECOMPUTE, retracts=True),
        PauseMode("in_place", KEEP),
        PauseMode("keep", KEEP),
    )
}


def pause_mode(name: str) -> PauseMode:
    """The row of pause mode `name`; ConfigError for an unknown name."""
    if name not in PAUSE_MODES:
        raise ConfigError(f"unknown pause mode {name!r}; use one of {', '.join(PAUSE_MODES)}")
    return PAUSE_MODES[name]


def stale(running, version: int, max_lag: int | None) -> list:
    """Running sequences whose oldest KV is more than `max_lag` versions behind `version`."""
    if max_lag is None:
        return []
    return [s for s in running if s.kv_version is not None and version - s.kv_version > max_lag]

"""Pause modes: what `Engine.pause(mode)` does to in-flight requests, and which in-flight policy
an update made during the pause applies.

A pause is request-side bookkeeping (the engine stops stepping; nothing in `EngineState`
changes by pausing), so it lives in the Engine, not in the state. The modes are SGLang's
(`abort`, `retract`, `in_place`) and vLLM's (`abort`, `wait`, `keep`):

| mode       | at pause                                          | an update while paused |
|------------|---------------------------------------------------|------------------------|
| `abort`    | every request ends now (finish_reason "abort")    | nothing is in flight   |
| `wait`     | new requests are held; started ones finish        | nothing is in flight   |
| `retract`  | running sequences go back to the queue, KV freed  | they recompute on new weights at resume |
| `in_place` | running sequences keep their pages                | policy `keep`: pages kept, labelled mixed |
| `keep`     | the same as `in_place`                            | the same as `in_place` |

Requests sent during a pause are queued and start at `resume()`; streams stay open.
"""

from __future__ import annotations

from hotswap.errors import ConfigError

# mode -> the update policy an update applies while paused in that mode (without its own drain)
PAUSE_POLICY = {
    "abort": "abort",
    "wait": "recompute",
    "retract": "recompute",
    "in_place": "keep",
    "keep": "keep",
}
PAUSE_MODES = tuple(PAUSE_POLICY)


def check_mode(mode: str) -> str:
    if mode not in PAUSE_POLICY:
        raise ConfigError(f"unknown pause mode {mode!r}; use one of {', '.join(PAUSE_MODES)}")
    return mode


def stale(running, version: int, max_lag: int | None) -> list:
    """Running sequences whose oldest KV is more than `max_lag` versions behind `version`."""
    if max_lag is None:
        return []
    return [s for s in running if s.kv_version is not None and version - s.kv_version > max_lag]

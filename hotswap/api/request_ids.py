"""Request ids a client can abort by: which engine requests each id names while they run, and
which ids ended lately.

A client knows a request by the id it chose (vLLM's `X-Request-Id` header or `request_id` field,
SGLang's `rid`) or by the one it was answered with (the `id` of a completion, `cmpl-<base>`, or
a chat completion, `chatcmpl-<base>`). One HTTP request may run several engine requests (a
completion with several prompts runs `cmpl-<base>-<i>` for each), so an id names a set of them.

An id that names nothing is one of two things: a request that ended a moment ago (an abort racing
a request that just finished: answered 200, the id listed as finished) or one this server never
ran (a typo, another replica's id: 404). The last `REMEMBER_ENDED` ended ids tell them apart.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import uuid

from fastapi import Request

from hotswap.errors import RequestError

REMEMBER_ENDED = 1 << 16  # ids (a few dozen bytes each): more than an RL step oversamples


@dataclasses.dataclass(frozen=True)
class ClientId:
    """The id a request answers with is `<prefix>-<base>`; `chosen`: the client set `base`."""

    base: str
    chosen: bool

    def names(self, full: str) -> tuple[str, ...]:
        """What the client may abort by: the id it was answered with, and its own if it chose one."""
        return (full, self.base) if self.chosen else (full,)


def client_id(request: Request, field: str | None) -> ClientId:
    """vLLM's order: the `X-Request-Id` header, then the body's `request_id`, else a fresh id."""
    given = request.headers.get("x-request-id") or field
    return ClientId(given, True) if given else ClientId(uuid.uuid4().hex, False)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What a list of ids names now: engine request ids in flight (in order, once each), ids
    whose requests have all ended lately, and ids this server does not know."""

    running: list[str]
    finished: list[str]
    unknown: list[str]


class RequestIds:
    """The names of engine requests in flight. `started` before the engine queues a request,
    `ended` when it finishes (or was never queued); both from any thread."""

    def __init__(self, remember: int = REMEMBER_ENDED):
        self._lock = threading.Lock()
        self._live: dict[str, list[str]] = {}  # name -> engine request ids in flight
        self._names: dict[str, tuple[str, ...]] = {}  # engine request id -> its names
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._remember = remember
        # Engine requests an abort named between `started` and their admission: the loop aborts
        # each once the engine has it (EngineLoop.add_request).
        self._doomed: set[str] = set()

    def started(self, rid: str, names: tuple[str, ...]) -> None:
        """RequestError for an engine request id already in flight (a client's id used twice)."""
        names = tuple(dict.fromkeys((rid, *names)))
        with self._lock:
            if rid in self._names:
                raise RequestError(f"request id {rid!r} is already in use by a request in flight")
            self._names[rid] = names
            for n in names:
                self._live.setdefault(n, []).append(rid)
                self._ended.pop(n, None)

    def ended(self, rid: str) -> None:
        with self._lock:
            self._doomed.discard(rid)
            for n in self._names.pop(rid, ()):
                rids = self._live.get(n, [])
                if rid in rids:
                    rids.remove(rid)
                if not rids:
                    self._live.pop(n, None)
                    self._ended[n] = None
            while len(self._ended) > self._remember:
                self._ended.popitem(last=False)

    def resolve(self, names: list[str]) -> Resolved:
        running: dict[str, None] = {}
        finished, unknown = [], []
        with self._lock:
            for n in dict.fromkeys(names):
                if n in self._live:
                    running.update(dict.fromkeys(self._live[n]))
                elif n in self._ended:
                    finished.append(n)
                else:
                    unknown.append(n)
        return Resolved(list(running), finished, unknown)

    def doom(self, rid: str) -> None:
        """Abort `rid` as soon as the engine admits it (it is registered, not yet queued)."""
        with self._lock:
            if rid in self._names:
                self._doomed.add(rid)

    def take_doomed(self, rid: str) -> bool:
        with self._lock:
            if rid in self._doomed:
                self._doomed.discard(rid)
                return True
            return False

    def in_flight(self) -> list[str]:
        with self._lock:
            return list(self._names)

    def __len__(self) -> int:
        """Engine requests registered and not ended (0 when nothing leaks)."""
        with self._lock:
            return len(self._names)

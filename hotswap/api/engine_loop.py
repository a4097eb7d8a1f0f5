"""The bridge between asyncio handlers and the engine: one stepping thread, per-request callbacks.

`engine.step()` is blocking device work, so it runs in `EngineLoop`'s own thread,
which steps while there is work and otherwise sleeps on a `threading.Event`.
Outputs reach the event loop through the engine's per-request sink and
`loop.call_soon_threadsafe` into the handler's `asyncio.Queue`. Engine calls that
take the engine lock (add_request, lifecycle calls) run in worker threads, so a
long update never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import anyio
from fastapi import Request

from hotswap.api.http_errors import Forbidden, ModelNotFound, ShuttingDown, Unauthorized
from hotswap.api.request_ids import RequestIds
from hotswap.engine.engine import Engine
from hotswap.engine.outputs import RequestOutput
from hotswap.engine.sampling import SamplingParams
from hotswap.toolcalls import formats
from hotswap.toolcalls.formats import ToolFormat

log = logging.getLogger("hotswap.api")

# Consecutive failed steps after which in-flight requests are failed instead of retried
# (the engine recovers a failed step by recomputing, so one failure is usually transient).
MAX_STEP_FAILURES = 3
IDLE_WAIT_S = 0.5  # the event wakes the loop at once; the timeout only bounds a missed wake-up
STALL_WAIT_S = 0.005  # work exists but nothing could be scheduled (e.g. admission held by a drain)

OnOutput = Callable[[RequestOutput | BaseException], None]

# How a generation request (/v1/completions, /v1/chat/completions) ended; each ends in exactly one.
# rejected: refused before generating (4xx/503: bad input, 429, asleep, shutting down);
# aborted: a choice ended with finish_reason "abort" or the client went away; errored: 5xx or an
# in-band error event after the stream started.
OUTCOMES = ("completed", "aborted", "rejected", "errored")


class EngineLoop:
    """Calls `engine.step()` in a background thread while the engine has work."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._aborts: collections.deque[str] = collections.deque()
        self._callbacks: dict[str, OnOutput] = {}
        self._cb_lock = threading.Lock()
        self.ids = RequestIds()  # the names clients abort by (api/request_ids.py)
        self._thread = threading.Thread(target=self._run, name="hotswap-engine-loop", daemon=True)
        self.step_failures = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def notify(self) -> None:
        """New work (or a lifecycle change that may release held work)."""
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- requests (called from worker threads) ------------------------------

    def add_request(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        stream: bool,
        on_output: OnOutput,
        lora_name: str | None = None,
        names: tuple[str, ...] = (),
    ):
        """Queue in the engine; raises the engine's typed errors before anything is queued.
        `names`: the ids a client may abort it by, besides `rid` (api/request_ids.py)."""

        def sink(out: RequestOutput) -> None:
            if out.finished:
                with self._cb_lock:
                    self._callbacks.pop(out.request_id, None)
                self.ids.ended(out.request_id)
            on_output(out)

        self.ids.started(rid, names)  # first: refuses an id in flight before anything is replaced
        with self._cb_lock:
            self._callbacks[rid] = on_output
        try:
            self.engine.add_request(rid, prompt, params, sink=sink, stream=stream, lora_name=lora_name)
        except BaseException:
            with self._cb_lock:
                self._callbacks.pop(rid, None)
            self.ids.ended(rid)
            raise
        if self.ids.take_doomed(rid):  # aborted by id while it was being queued
            self.engine.abort(rid)
        self._wake.set()

    def abort(self, rid: str) -> None:
        """Non-blocking (safe from a cancelled handler): the loop thread aborts before its next step."""
        self._aborts.append(rid)
        self._wake.set()

    # ---- the thread ---------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            # Clear before checking for work: a request added after the check sets the
            # event again, so the wait below returns at once and nothing is missed.
            self._wake.clear()
            while self._aborts:
                engine.abort(self._aborts.popleft())
            if not engine.has_unfinished() or engine.is_paused:  # paused: requests wait, queued
                self._wake.wait(IDLE_WAIT_S)
                continue
            before = engine.stats["steps"]
            try:
                engine.step()
                self.step_failures = 0
            except Exception as e:  # the engine already recovered its state; decide whether to retry
                self.step_failures += 1
                log.exception("engine step failed (%d in a row)", self.step_failures)
                if self.step_failures >= MAX_STEP_FAILURES:
                    self._fail_all(e)
                continue
            if engine.stats["steps"] == before:
                self._wake.wait(STALL_WAIT_S)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cb_lock:
            callbacks, self._callbacks = self._callbacks, {}
        for rid, cb in callbacks.items():
            cb(exc)  # first, so the handler reports the error rather than the abort that follows
            self.engine.abort(rid)
            self.ids.ended(rid)
        self.step_failures = 0


@dataclasses.dataclass
class ServerContext:
    """Everything a route needs, stored on `app.state.ctx`."""

    engine: Engine
    loop: EngineLoop
    model_names: list[str]
    api_key: str | None = None
    admin_key: str | None = None
    shutting_down: bool = False
    weight_updates: int = 0
    started_at: float = dataclasses.field(default_factory=time.time)
    # Generation requests: received, and how they ended (total = sum(outcomes) + in flight).
    requests_total: int = 0
    outcomes: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    # SGLang / vLLM name weights versions with strings; hotswap's are ints (api/version_labels.py).
    version_labels: dict[int, str] = dataclasses.field(default_factory=dict)
    vllm_transfer: Any = None  # the vLLM four-phase update in progress (api/routes_vllm.py)
    # The family whose tool calls chat reads and writes (`--tool-call-parser`, else the template's).
    tool_format: ToolFormat = formats.SMOLLM2

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> str | None:
        """A request's `model`: the base (None) or a LoRA adapter loaded by name (its name)."""
        if name is None or name in self.model_names:
            return None
        adapters = [a.name for a in self.engine.lora_adapters()]
        if name in adapters:
            return name
        raise ModelNotFound(f"model {name!r} is not served here; available: {self.model_names + adapters}")

    def check_admitting(self) -> None:
        if self.shutting_down:
            raise ShuttingDown("the server is shutting down: in-flight requests finish, new ones are refused")

    async def run_sync(self, fn: Callable, *args, **kwargs):
        """Run a blocking engine call in a worker thread, then wake the loop (held work may resume)."""
        try:
            return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))
        finally:
            self.loop.notify()

    async def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        stream: bool,
        queue: asyncio.Queue,
        lora_name: str | None = None,
        rid: str | None = None,
        names: tuple[str, ...] = (),
    ) -> str:
        """Add one engine request whose outputs (or a fatal error) arrive on `queue`; `rid`: its
        engine id (default: a fresh one), `names`: other ids a client may abort it by."""
        aloop = asyncio.get_running_loop()

        def on_output(item: RequestOutput | BaseException) -> None:
            try:
                aloop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is closed: the client is gone anyway
                pass

        rid = rid or uuid.uuid4().hex
        await anyio.to_thread.run_sync(
            lambda: self.loop.add_request(rid, prompt, params, stream, on_output, lora_name, names)
        )
        return rid


def ctx_of(request: Request) -> ServerContext:
    return request.app.state.ctx


TALLY_KEY = "hotswap.tally"  # ASGI scope key of a generation request's Tally


class Tally:
    """One generation request's outcome. The handler names it; the server's tally middleware
    records it exactly once when the request's ASGI call ends (the first name set wins)."""

    __slots__ = ("outcome",)

    def __init__(self) -> None:
        self.outcome: str | None = None

    def settle(self, outcome: str) -> None:
        if self.outcome is None:
            self.outcome = outcome


def settle(request: Request, outcome: str) -> None:
    """Name how this generation request ended (a no-op outside the tally middleware)."""
    tally = request.scope.get(TALLY_KEY)
    if tally is not None:
        tally.settle(outcome)


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _key_ok(given: str | None, *keys: str | None) -> bool:
    # compare_digest: the time taken must not reveal how much of a key matched.
    return given is not None and any(k is not None and hmac.compare_digest(given, k) for k in keys)


def require_api_key(request: Request) -> None:
    """/v1/*: the api key (or the admin key) when one is configured."""
    ctx = ctx_of(request)
    if ctx.api_key is not None and not _key_ok(_bearer(request), ctx.api_key, ctx.admin_key):
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <api key>'")


def require_admin(request: Request) -> None:
    """Lifecycle routes: the admin key; without one configured, the api key guards them instead.

    401 for a missing or unknown key; 403 for the api key when an admin key is configured
    (the caller is known, it just may not change the engine).
    """
    ctx = ctx_of(request)
    key = ctx.admin_key if ctx.admin_key is not None else ctx.api_key
    given = _bearer(request)
    if key is None or _key_ok(given, key):
        return
    if _key_ok(given, ctx.api_key):
        raise Forbidden("the api key may not call lifecycle routes: send 'Authorization: Bearer <admin key>'")
    raise Unauthorized("missing or invalid admin key: send 'Authorization: Bearer <admin key>'")

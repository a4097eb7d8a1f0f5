"""How a generation request's outputs leave the server: one SSE stream and one collector, for
every dialect (`/v1/completions`, `/v1/chat/completions`, SGLang's `/generate`).

A stream ends with `data: [DONE]`; an error after the first byte (the status is sent by then)
is an in-band error event first, never a silent cut. `X-Accel-Buffering: no` keeps a reverse
proxy from holding back tokens. A client that goes away has its engine requests aborted: a
stream notices when its generator is closed, a plain response by polling the connection.
Each request's outcome (engine_loop.OUTCOMES) is named here, once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from hotswap.api.engine_loop import ServerContext, settle
from hotswap.api.http_errors import exception_body
from hotswap.engine.outputs import RequestOutput

DISCONNECT_POLL_S = 0.5  # how often a plain (non-streaming) handler checks that its client is still there
CLIENT_GONE = 499  # nginx's "client closed request": never seen by a client, only in access logs
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"

# One output from the engine -> the events it sends (none: nothing to send yet).
Render = Callable[[RequestOutput], Iterable[dict[str, Any]]]


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def outcome(outs: list[RequestOutput]) -> str:
    """The outcome of a request whose outputs all finished: 'aborted' if any choice was aborted."""
    aborted = any(c.finish_reason == "abort" for o in outs for c in o.outputs)
    return "aborted" if aborted else "completed"


async def collect(
    ctx: ServerContext, request: Request, queue: asyncio.Queue, rids: list[str]
) -> list[RequestOutput] | None:
    """Final outputs in `rids` order, or None if the client went away (its requests are aborted;
    answer `gone()`). Names the request's outcome."""
    final: dict[str, RequestOutput] = {}
    try:
        while len(final) < len(rids):
            try:
                item = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    settle(request, "aborted")
                    return None
                continue
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                final[item.request_id] = item
    finally:
        for rid in rids:
            if rid not in final:
                ctx.loop.abort(rid)
    outs = [final[r] for r in rids]
    settle(request, outcome(outs))
    return outs


def gone() -> Response:
    """The answer to a client that is no longer there (only the access log sees it)."""
    return Response(status_code=CLIENT_GONE)


async def events(
    ctx: ServerContext,
    request: Request,
    queue: asyncio.Queue,
    rids: list[str],
    render: Render,
    *,
    head: Iterable[dict[str, Any]] = (),
    tail: Callable[[list[RequestOutput]], Iterable[dict[str, Any]]] | None = None,
) -> AsyncIterator[str]:
    """SSE: `head`, then `render(output)` for each output of every request in `rids`, then
    `tail(final outputs)`, then [DONE]."""
    final: dict[str, RequestOutput] = {}
    try:
        for event in head:
            yield sse(event)
        while len(final) < len(rids):
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            for event in render(item):
                yield sse(event)
            if item.finished:
                final[item.request_id] = item
        outs = [final[r] for r in rids]
        for event in tail(outs) if tail is not None else ():
            yield sse(event)
        settle(request, outcome(outs))
    except Exception as e:  # after the first byte the status is sent: report in-band, then [DONE]
        settle(request, "errored")
        yield sse(exception_body(e)[1])
    finally:  # also runs on client disconnect (the generator is cancelled / closed)
        settle(request, "aborted")  # a no-op unless the stream was cut short
        for rid in rids:
            if rid not in final:
                ctx.loop.abort(rid)
    yield DONE


def stream(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)

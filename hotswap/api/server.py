"""FastAPI app factory: OpenAI routes, lifecycle routes, /health, /metrics.

    app = create_app(LLM(model_dir).engine, api_key="k", admin_key="a")
    uvicorn.run(app, host="127.0.0.1", port=8000)

The app owns an `EngineLoop` (started and stopped by the app's lifespan), the
only thread that steps the engine. All errors leave as OpenAI-style bodies via
the one table in `hotswap.api.http_errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pydantic
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hotswap.api import (
    management,
    routes_fleet,
    routes_lora,
    routes_openai,
    routes_sglang,
    routes_sglang_info,
    routes_vllm,
)
from hotswap.api.engine_loop import (
    OUTCOMES,
    TALLY_KEY,
    EngineLoop,
    ServerContext,
    Tally,
    ctx_of,
    require_admin,
    require_api_key,
)
from hotswap.api.http_errors import HotswapError, ShuttingDown, error_body, exception_body
from hotswap.engine.engine import Engine
from hotswap.toolcalls import formats

log = logging.getLogger("hotswap.api")

__all__ = ["EngineLoop", "ServerContext", "create_app"]


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic errors -> one readable message and the first offending field (OpenAI's `param`)."""
    parts, param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x not in ("body", "query")]
        field = ".".join(loc) or "body"
        param = param or field
        if e.get("type") == "extra_forbidden":
            parts.append(f"unknown field {field!r}")
        else:
            parts.append(f"{field}: {e.get('msg')}")
    return "; ".join(parts) or "invalid request", param


def _error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = exception_body(exc)
    if status == 500:
        log.error("unhandled error", exc_info=exc)
    return JSONResponse(body, status_code=status, headers=headers)


_HTTP_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


def _install_error_handlers(app: FastAPI) -> None:
    async def on_validation(
        _: Request, exc: RequestValidationError | pydantic.ValidationError
    ) -> JSONResponse:
        errors = exc.errors()
        message, param = _validation_message(list(errors))
        body = error_body(
            message, status=400, type_="invalid_request_error", code="invalid_request", param=param
        )
        return JSONResponse(body, status_code=400)

    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        return _error_response(exc)

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # The framework's own refusals (unknown route 404, wrong method 405, a body that is not
        # UTF-8 JSON 400) get the same OpenAI-style body as ours, not Starlette's {"detail": ...}.
        type_ = _HTTP_TYPES.get(exc.status_code, "invalid_request_error")
        body = error_body(str(exc.detail), status=exc.status_code, type_=type_)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(pydantic.ValidationError, on_validation)
    # HotswapError is handled in the exception middleware (expected, not logged as a crash);
    # anything else reaches the outermost handler, which answers 500 and logs the traceback.
    app.add_exception_handler(HotswapError, on_error)
    app.add_exception_handler(Exception, on_error)


def _metrics_text(ctx: ServerContext) -> str:
    """Prometheus text exposition (names follow vLLM's where one exists)."""
    e = ctx.engine
    rows = [
        ("num_requests_running", "gauge", "Sequences being generated.", e.num_running()),
        ("num_requests_waiting", "gauge", "Sequences waiting to be scheduled.", e.num_waiting()),
        ("prompt_tokens_total", "counter", "Prompt tokens received.", e.stats["prompt_tokens"]),
        ("generation_tokens_total", "counter", "Tokens generated.", e.stats["generated_tokens"]),
        (
            "prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            e.stats["cached_tokens"],
        ),
        ("engine_steps_total", "counter", "Engine steps run.", e.stats["steps"]),
        ("spec_decode_num_drafts_total", "counter", "Speculative drafts verified.", e.stats["spec_drafts"]),
        (
            "spec_decode_num_draft_tokens_total",
            "counter",
            "Speculative draft tokens verified.",
            e.stats["spec_draft_tokens"],
        ),
        (
            "spec_decode_num_accepted_tokens_total",
            "counter",
            "Speculative draft tokens the target accepted.",
            e.stats["spec_accepted_tokens"],
        ),
        ("weights_version", "gauge", "Version of the weights now serving.", e.weights_version),
        (
            "weight_updates_total",
            "counter",
            "Weight updates committed through this server.",
            ctx.weight_updates,
        ),
        ("is_sleeping", "gauge", "1 while any part of the engine sleeps.", int(e.is_sleeping)),
        ("requests_total", "counter", "Generation requests received.", ctx.requests_total),
    ]
    in_flight = ctx.requests_total - sum(ctx.outcomes.values())
    labelled = [
        (
            "request_outcomes_total",
            "counter",
            "Generation requests by how they ended; requests_total = their sum + in flight.",
            [(f'outcome="{k}"', ctx.outcomes[k]) for k in OUTCOMES],
        ),
        (
            "requests_in_flight",
            "gauge",
            "Generation requests received and not yet ended.",
            [("", in_flight)],
        ),
        (
            "kv_pages",
            "gauge",
            "KV pages (the null page excluded): owned by a sequence, cached in the prefix index, free.",
            [(f'state="{k}"', v) for k, v in _page_states(e).items()],
        ),
    ]
    lines = []
    for name, kind, help_, samples in [(n, k, h, [("", v)]) for n, k, h, v in rows] + labelled:
        lines += [f"# HELP hotswap_{name} {help_}", f"# TYPE hotswap_{name} {kind}"]
        lines += [f"hotswap_{name}{{{lab}}} {v}" if lab else f"hotswap_{name} {v}" for lab, v in samples]
    return "\n".join(lines) + "\n"


def _page_states(e: Engine) -> dict[str, int]:
    """Owned / cached / free page counts, read without the engine lock from one state value (a
    gauge may be a step stale, never torn)."""
    state = e.state
    return state.pool.usage(state.prefix)


def _open_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> JSONResponse:
        ctx = ctx_of(request)
        if ctx.shutting_down or not ctx.loop.alive:
            why = "shutting down" if ctx.shutting_down else "engine loop stopped"
            return JSONResponse({"status": why}, status_code=503)
        return JSONResponse(
            {
                "status": "ok",
                "weights_version": ctx.engine.weights_version,
                "is_sleeping": ctx.engine.is_sleeping,
            }
        )

    @router.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(_metrics_text(ctx_of(request)), media_type="text/plain; version=0.0.4")

    @router.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def models(request: Request) -> dict[str, Any]:
        ctx = ctx_of(request)
        e = ctx.engine
        data = [
            {
                "id": name,
                "object": "model",
                "created": int(ctx.started_at),
                "owned_by": "hotswap",
                "max_model_len": e.ecfg.max_model_len,
                "weights_version": e.weights_version,
            }
            for name in ctx.model_names
        ]
        data += [  # LoRA adapters served by name, as vLLM lists them (parent: the base model)
            {
                "id": a.name,
                "object": "model",
                "created": int(ctx.started_at),
                "owned_by": "hotswap",
                "root": a.source,
                "parent": ctx.model_name,
                "max_model_len": e.ecfg.max_model_len,
                "weights_version": e.weights_version,
                "lora_version": a.version,
            }
            for a in e.lora_adapters()
        ]
        return {"object": "list", "data": data}

    return router


GENERATION_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/generate",  # SGLang's
    *(routes_vllm.PREFIX + p for p in ("/v1/completions", "/v1/chat/completions")),
)


class _RequestTally:
    """Counts generation requests and records exactly one outcome for each (plain ASGI, so it
    sees every way a request ends: a handler's answer, an error status, a client hang-up)."""

    def __init__(self, app, ctx: ServerContext):
        self.app, self.ctx = app, ctx

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        tally = scope[TALLY_KEY] = Tally()
        status, hung_up = 0, False

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        async def receive_watch():
            nonlocal hung_up
            message = await receive()
            hung_up = hung_up or message["type"] == "http.disconnect"
            return message

        self.ctx.requests_total += 1
        try:
            await self.app(scope, receive_watch, send_status)
        except asyncio.CancelledError:  # the server is stopping or the client went away
            tally.settle("aborted")
            raise
        except BaseException:
            tally.settle("errored")
            raise
        finally:
            # The handler's own word first; then a client that hung up before its answer (even
            # if the framework then calls the half-read body a 400); else the status: 4xx/503
            # refused it, 5xx failed it, and a 2xx without an outcome is a stream cut short.
            if hung_up and status < 500:
                tally.settle("aborted")
            if status >= 500 and status != 503:
                tally.settle("errored")
            elif status >= 400:
                tally.settle("rejected")
            tally.settle("aborted")
            self.ctx.outcomes[tally.outcome] += 1


class _ShutdownGate:
    """Plain ASGI middleware (BaseHTTPMiddleware would wrap, and can break, streaming responses).

    Requests arriving on kept-alive connections after SIGTERM get a clear 503; uvicorn
    itself stops accepting new connections. /health reports the state too.
    """

    def __init__(self, app, ctx: ServerContext):
        self.app, self.ctx = app, ctx

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and self.ctx.shutting_down
            and scope["path"] not in ("/health", "/metrics")
        ):
            response = _error_response(ShuttingDown("the server is shutting down; retry on another replica"))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    admin_key: str | None = None,
    model_name: str | list[str] = "hotswap",
    weights_root: str | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The server for one engine. `weights_root` bounds `/update_weights {"path": ...}`
    (without it, path updates are refused); `model_name` may list several accepted names;
    `tool_call_parser` names the family of chat's tool calls (default: the chat template's)."""
    if weights_root is not None:
        engine.weights_root = weights_root
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    template = engine.tokenizer.chat_template if engine.tokenizer is not None else None
    ctx = ServerContext(
        engine=engine,
        loop=EngineLoop(engine),
        model_names=names,
        api_key=api_key,
        admin_key=admin_key,
        tool_format=formats.choose(tool_call_parser, template),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        ctx.loop.start()
        try:
            yield
        finally:
            ctx.loop.stop()

    app = FastAPI(title="hotswap", lifespan=lifespan)
    app.state.ctx = ctx

    app.add_middleware(_ShutdownGate, ctx=ctx)
    app.add_middleware(_RequestTally, ctx=ctx)  # outermost: also counts the gate's 503s
    _install_error_handlers(app)
    app.include_router(_open_routes())
    app.include_router(routes_openai.router)
    app.include_router(management.router)
    # RL controllers written for SGLang (its names are free here) and vLLM (under /vllm, where
    # the OpenAI routes are mounted again so one base URL serves generation and control).
    app.include_router(routes_sglang.router)
    # What a router reads of a replica (SGLang's /server_info, /get_load ...): the api key.
    app.include_router(routes_sglang_info.router, dependencies=[Depends(require_api_key)])
    app.include_router(routes_vllm.router)
    # vLLM's /tokenize, /detokenize (inference: the api key) and /abort_requests (admin) are
    # free names at the root, and under /vllm with the rest of vLLM's routes.
    app.include_router(routes_vllm.tokenization, dependencies=[Depends(require_api_key)])
    app.include_router(routes_vllm.aborts)
    app.include_router(routes_vllm.aborts, prefix=routes_vllm.PREFIX)
    app.include_router(routes_lora.router)
    # A fleet's two-phase commit (hotswap/fleet/): prepare / commit / resume / abort, admin key.
    app.include_router(routes_fleet.router)
    # The admin key there, as on every route outside /v1/: the api key opens /v1/* only.
    app.include_router(routes_openai.router, prefix=routes_vllm.PREFIX, dependencies=[Depends(require_admin)])
    app.include_router(
        routes_vllm.tokenization, prefix=routes_vllm.PREFIX, dependencies=[Depends(require_admin)]
    )
    return app

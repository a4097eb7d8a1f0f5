"""FastAPI app factory: OpenAI routes, lifecycle routes, /health, /metrics.

    app = create_app(LLM(model_dir).engine, api_key="k", admin_key="a")
    uvicorn.run(app, host="127.0.0.1", port=8000)

The app owns an `EngineLoop` (started and stopped by the app's lifespan), the
only thread that steps the engine. All errors leave as OpenAI-style bodies via
the one table in `hotswap.api.errors`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import pydantic
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse

from hotswap.api import management, routes_openai
from hotswap.api.engine_loop import EngineLoop, ServerContext, ctx_of, require_api_key
from hotswap.api.errors import HotswapError, ShuttingDown, error_body, exception_body
from hotswap.engine.engine import Engine

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
        ("weights_version", "gauge", "Version of the weights now serving.", e.weights_version),
        (
            "weight_updates_total",
            "counter",
            "Weight updates committed through this server.",
            ctx.weight_updates,
        ),
        ("is_sleeping", "gauge", "1 while any part of the engine sleeps.", int(e.is_sleeping)),
    ]
    lines = []
    for name, kind, help_, value in rows:
        lines += [
            f"# HELP hotswap_{name} {help_}",
            f"# TYPE hotswap_{name} {kind}",
            f"hotswap_{name} {value}",
        ]
    return "\n".join(lines) + "\n"


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
        return {"object": "list", "data": data}

    return router


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
) -> FastAPI:
    """The server for one engine. `weights_root` bounds `/update_weights {"path": ...}`
    (without it, path updates are refused); `model_name` may list several accepted names."""
    if weights_root is not None:
        engine.weights_root = weights_root
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    ctx = ServerContext(
        engine=engine, loop=EngineLoop(engine), model_names=names, api_key=api_key, admin_key=admin_key
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
    _install_error_handlers(app)
    app.include_router(_open_routes())
    app.include_router(routes_openai.router)
    app.include_router(management.router)
    return app

"""The fleet controller: a small FastAPI app beside the router (`hotswap fleet serve`).

The router (sglang-router, a Rust binary) routes generation; it has no notion of a weights
version. This app is where a trainer changes the fleet's weights and reads its state:

- `POST /fleet/update_weights {"path", "policy"?, <update options>}` (admin key): the two-phase
  fleet commit (commit.py); the answer is what it did (version, skews, lost replicas); a
  replica's refusal comes back with that replica's status and error code.
- `GET /fleet` (api or admin key): the fleet's version, its last commit, one row per replica.

Keys as on a replica (engine_loop.require_admin): no key or a wrong one 401, the api key 403.
"""

from __future__ import annotations

import hmac
from typing import Any

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from hotswap.api.http_errors import Forbidden, HotswapError, RequestError, Unauthorized, exception_body
from hotswap.fleet.driver import Fleet


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _is(given: str | None, key: str | None) -> bool:
    return given is not None and key is not None and hmac.compare_digest(given, key)


def create_controller(fleet: Fleet) -> FastAPI:
    app = FastAPI(title="hotswap fleet")

    def admin(request: Request) -> None:
        given = _bearer(request)
        if fleet.admin_key is None or _is(given, fleet.admin_key):
            return
        if _is(given, fleet.api_key):
            raise Forbidden("the api key may not update the fleet: send 'Authorization: Bearer <admin key>'")
        raise Unauthorized("missing or invalid admin key: send 'Authorization: Bearer <admin key>'")

    def reader(request: Request) -> None:
        if fleet.api_key is not None and _is(_bearer(request), fleet.api_key):
            return
        admin(request)

    @app.exception_handler(HotswapError)
    async def on_error(_: Request, exc: HotswapError) -> JSONResponse:
        status, body, headers = exception_body(exc)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.post("/fleet/update_weights", dependencies=[Depends(admin)])
    async def update_weights(request: Request) -> dict[str, Any]:
        try:
            data = await request.json()
        except ValueError:
            raise RequestError("the body must be a JSON object") from None
        if not isinstance(data, dict) or not isinstance(data.get("path"), str):
            raise RequestError(
                'the body needs "path": a checkpoint directory under the fleet\'s --weights-root'
            )
        options = {k: v for k, v in data.items() if k != "path"}
        done = await anyio.to_thread.run_sync(lambda: fleet.update_weights(data["path"], **options))
        return done.as_dict()

    @app.get("/fleet", dependencies=[Depends(reader)])
    async def state() -> dict[str, Any]:
        rows = await anyio.to_thread.run_sync(fleet.versions)
        last = fleet.last_commit.as_dict() if fleet.last_commit is not None else None
        return {
            "weights_version": fleet.version,
            "source": fleet.source,
            "last_commit": last,
            "replicas": rows,
        }

    return app

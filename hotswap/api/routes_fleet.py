"""A replica's side of the fleet-wide commit (hotswap/fleet/commit.py drives it): admin routes.

- `POST /fleet/prepare {"update_id", "path" | "transfer", <update options>}`: pass 1 of the
  update (read, check, place beside the serving weights) while serving goes on; the result is
  held under `update_id`, nothing serving changes. A bad source is refused here (its typed
  error, e.g. WeightsMismatch 400), so a fleet learns of it before any replica commits.
- `POST /fleet/commit {"update_id"}`: pause in the mode matching the update's policy (drain:
  `wait`, keep: `keep`, recompute: `retract`, abort: `abort`), swap, and stay paused, holding
  new requests, until `/fleet/resume`: the fleet resumes every replica only once all swapped,
  so none serves v+1 while another still serves v.
- `POST /fleet/resume`; `POST /fleet/abort {"update_id"}`: drop what was staged (nothing
  commits) and resume if this route paused.

One update is staged at a time: a second prepare under another id while one is held is a
LifecycleConflict (409); the same id again replaces it (a retried prepare).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Depends, Request

from hotswap.api import actions
from hotswap.api.engine_loop import ServerContext, ctx_of, require_admin
from hotswap.api.http_errors import LifecycleConflict, PayloadError, RequestError
from hotswap.weights import place

router = APIRouter(prefix="/fleet", dependencies=[Depends(require_admin)])

# The pause a fleet commit takes for each update policy: what that policy does to in-flight
# requests on one engine (policies.py), done before the swap, so that the replica then waits
# for the fleet's resume. `reject` has no such pause: a fleet refuses it (fleet/commit.py).
PAUSE_FOR_POLICY = {"drain": "wait", "keep": "keep", "recompute": "retract", "abort": "abort"}


@dataclasses.dataclass
class _Slot:
    update_id: str
    prepared: place.Prepared


def _slot(request: Request) -> _Slot | None:
    return getattr(request.app.state, "fleet_staged", None)


def _set_slot(request: Request, slot: _Slot | None) -> None:
    request.app.state.fleet_staged = slot


def _update_id(data: dict[str, Any]) -> str:
    uid = data.get("update_id")
    if not isinstance(uid, str) or not uid:
        raise RequestError('"update_id" (a non-empty string naming the fleet update) is required')
    return uid


@router.post("/prepare")
async def prepare(request: Request) -> dict[str, Any]:
    ctx = ctx_of(request)
    data = await actions.read_fields(request)
    uid = _update_id(data)
    held = _slot(request)
    if held is not None and held.update_id != uid:
        raise LifecycleConflict(
            f"fleet update {held.update_id!r} is staged here; commit or abort it before preparing {uid!r}"
        )
    named = [k for k in ("path", "transfer") if k in data]
    if len(named) != 1:
        raise PayloadError('fleet prepare needs exactly one of "path" (a directory) or "transfer"')
    (kind,) = named
    fields = actions.UpdateFields.model_validate(
        {k: v for k, v in data.items() if k not in ("update_id", kind)}
    )
    if fields.policy not in PAUSE_FOR_POLICY:
        raise RequestError(
            f"policy {fields.policy!r} cannot be committed fleet-wide; use one of {', '.join(PAUSE_FOR_POLICY)}"
        )
    source = actions.named_source(ctx, data, kind)
    prepared = await actions.prepare(ctx, source, fields.options())
    _set_slot(request, _Slot(uid, prepared))
    return {"prepared": uid, "weights_version": ctx.engine.weights_version}


def _held(request: Request, uid: str) -> _Slot:
    held = _slot(request)
    if held is None or held.update_id != uid:
        staged = "nothing" if held is None else repr(held.update_id)
        raise LifecycleConflict(f"fleet update {uid!r} is not staged here ({staged} is)")
    return held


@router.post("/commit")
async def commit(request: Request) -> dict[str, Any]:
    ctx = ctx_of(request)
    held = _held(request, _update_id(await actions.read_fields(request)))
    mode = PAUSE_FOR_POLICY[held.prepared.plan.options.policy]
    await ctx.run_sync(ctx.engine.pause, mode)
    request.app.state.fleet_paused = True  # resumed by /fleet/resume or /fleet/abort, not here
    _set_slot(request, None)  # committed or not (a device failure), it is not staged any more
    version = await actions.commit_prepared(ctx, held.prepared)
    return {"weights_version": version, "paused": mode}


async def _resume_if_paused(request: Request, ctx: ServerContext) -> bool:
    if not getattr(request.app.state, "fleet_paused", False):
        return False
    await actions.resume(ctx)
    request.app.state.fleet_paused = False
    return True


@router.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    ctx = ctx_of(request)
    resumed = await _resume_if_paused(request, ctx)
    return {"resumed": resumed, "weights_version": ctx.engine.weights_version}


@router.post("/abort")
async def abort(request: Request) -> dict[str, Any]:
    """Drop the staged update (any id, or the one named); idempotent: a replica that never got
    the prepare, or already dropped it, answers dropped=false."""
    ctx = ctx_of(request)
    data = await actions.read_fields(request)
    held = _slot(request)
    dropped = held is not None and data.get("update_id") in (None, held.update_id)
    if dropped:
        _set_slot(request, None)
    resumed = await _resume_if_paused(request, ctx)
    return {"dropped": dropped, "resumed": resumed, "weights_version": ctx.engine.weights_version}

"""hotswap's own lifecycle routes: sleep / wakeup / is_sleeping / reset_prefix_cache /
weights_version / update_weights, an adapter over api/actions.py.

They need the admin key when one is configured. The sequence a popular PyTorch engine
documents works unchanged: `/sleep?level=2` -> `/wakeup?tags=weights` -> `/update_weights`
(chunks, the last with `finished=true`) -> `/wakeup?tags=kv_cache`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from hotswap.api import actions
from hotswap.api.engine_loop import ServerContext, ctx_of, require_admin
from hotswap.api.http_errors import PayloadError, RequestError

router = APIRouter(dependencies=[Depends(require_admin)])


def _sleep_view(ctx: ServerContext) -> dict[str, Any]:
    asleep = sorted(ctx.engine.state.asleep)
    return {"is_sleeping": bool(asleep), "asleep": asleep, "weights_version": ctx.engine.weights_version}


@router.post("/sleep")
async def sleep(request: Request, level: int = 1, mode: str = "abort") -> dict[str, Any]:
    """Level 1: weights to host memory, KV dropped. Level 2: weights dropped too. mode=wait drains first."""
    ctx = ctx_of(request)
    await actions.sleep(ctx, level, mode)
    return {**_sleep_view(ctx), "level": level}


@router.post("/wakeup")
async def wakeup(request: Request, tags: list[str] | None = Query(None)) -> dict[str, Any]:
    """`?tags=weights&tags=kv_cache`; no tags wakes everything."""
    ctx = ctx_of(request)
    await actions.wakeup(ctx, tags)
    return _sleep_view(ctx)


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, Any]:
    return _sleep_view(ctx_of(request))


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict[str, Any]:
    ctx = ctx_of(request)
    await actions.reset_prefix_cache(ctx)
    return {"reset": True, "weights_version": ctx.engine.weights_version}


@router.get("/weights_version")
async def weights_version(request: Request) -> dict[str, Any]:
    return {"weights_version": ctx_of(request).engine.weights_version}


# --------------------------------------------------------------------------- /update_weights

SOURCES = ("path", "tensors", "transfer")  # a JSON body names exactly one


def _answer(result: int | actions.Staged, policy: str) -> dict[str, Any]:
    if isinstance(result, actions.Staged):
        return {"staged": result.count, "staged_bytes": result.nbytes, "update_id": result.update_id}
    return {"weights_version": result, "policy": policy}


@router.post("/update_weights")
async def update_weights(request: Request) -> dict[str, Any]:
    """Four body forms, the options (actions.UpdateFields) beside them or as query parameters:

    - JSON `{"path": ...}`: a checkpoint directory under --weights-root;
    - JSON `{"transfer": {"address", "uuid", "timeout_s", "processes"}}`: a tree another JAX
      process published with `hotswap.weights.transfer.publish`, pulled device to device;
    - JSON `{"tensors": [{name, dtype, shape, data (base64)}], "finished", "update_id"}`;
    - safetensors bytes (`application/octet-stream`), `finished` and `update_id` as query parameters;
    - JSON `{"path": ..., "draft": true}`: the draft checkpoint's weights instead (`_update_draft`).

    Pickle / torch.save bodies are refused (400) by their bytes, whatever the content type.
    """
    ctx = ctx_of(request)
    ctx.check_admitting()
    query = dict(request.query_params)
    body = await actions.read_update(request)
    if body.payload is not None:
        chunk = actions.ChunkFields.model_validate(query)
        result = await actions.update_chunk(
            ctx,
            body.payload,
            content_type=body.content_type,
            finished=chunk.finished,
            update_id=chunk.update_id,
            options=chunk.options(),
        )
        return _answer(result, chunk.policy)

    data = body.fields
    if "draft" in data or "draft" in query:
        return await _update_draft(ctx, data, query)
    named = [k for k in SOURCES if k in data]
    if len(named) != 1:
        raise PayloadError(
            'update_weights JSON needs exactly one of "path" (a directory), "tensors" (entries) or '
            '"transfer" (a hotswap.weights.transfer reference)'
        )
    (kind,) = named
    rest = {**query, **{k: v for k, v in data.items() if k != kind}}
    if kind == "tensors":
        chunk = actions.ChunkFields.model_validate(rest)
        entries = actions.tensor_entries(data, '"tensors" is required')
        result = await actions.update_chunk(
            ctx,
            entries,
            content_type=body.content_type,
            finished=chunk.finished,
            update_id=chunk.update_id,
            options=chunk.options(),
        )
        return _answer(result, chunk.policy)
    fields = actions.UpdateFields.model_validate(rest)
    source = actions.named_source(ctx, data, kind)
    return _answer(await actions.update(ctx, source, fields.options()), fields.policy)


async def _update_draft(ctx: ServerContext, data: dict, query: dict) -> dict[str, Any]:
    """`{"path": ..., "draft": true}` (or `"transfer"`): the source replaces the draft checkpoint
    (speculative_config `model: <path>`), as `Engine.update_draft_weights`; the answer is its
    new version. A draft update changes no token nor cache, so it takes no update options."""
    fields = {**query, **data}
    draft = fields.pop("draft")
    if draft is not True and str(draft).lower() not in ("1", "true"):
        raise RequestError(f'"draft" must be true to update the draft model, got {draft!r}')
    named = [k for k in ("path", "transfer") if k in fields]
    if len(named) != 1 or len(fields) != 1:
        raise PayloadError(
            'a draft update takes exactly one of "path" (a directory) or "transfer" beside "draft", '
            f"and no update options; got {sorted(fields)}"
        )
    version = await actions.update_draft(ctx, actions.named_source(ctx, fields, named[0]))
    return {"draft_version": version, "weights_version": ctx.engine.weights_version}


@router.delete("/update_weights")
async def abort_staged_update(request: Request) -> dict[str, Any]:
    """Drop a chunked update in progress (nothing staged is committed)."""
    return {"dropped": actions.drop_staged(ctx_of(request))}

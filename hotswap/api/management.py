"""Lifecycle routes: sleep / wakeup / is_sleeping / reset_prefix_cache / weights_version / update_weights.

They need the admin key when one is configured. Every engine call here takes the
engine lock (an update may drain for a while), so it runs in a worker thread and
the event loop keeps streaming tokens meanwhile. The sequence a popular PyTorch
engine documents works unchanged: `/sleep?level=2` -> `/wakeup?tags=weights` ->
`/update_weights` (chunks, the last with `finished=true`) -> `/wakeup?tags=kv_cache`.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict

from hotswap.api.engine_loop import ServerContext, ctx_of, require_admin
from hotswap.api.errors import PayloadError, PickleRefused, RequestError, WeightsPathNotAllowed
from hotswap.checkpoint.payload import sniff_refuse_pickle
from hotswap.engine import lifecycle

router = APIRouter(dependencies=[Depends(require_admin)])


def _sleep_view(ctx: ServerContext) -> dict[str, Any]:
    asleep = sorted(ctx.engine.state.asleep)
    return {"is_sleeping": bool(asleep), "asleep": asleep, "weights_version": ctx.engine.weights_version}


@router.post("/sleep")
async def sleep(request: Request, level: int = 1, mode: str = "abort") -> dict[str, Any]:
    """Level 1: weights to host memory, KV dropped. Level 2: weights dropped too. mode=wait drains first."""
    ctx = ctx_of(request)
    lifecycle.sleep_level(level, RequestError)  # refused before the engine thread is asked
    await ctx.run_sync(ctx.engine.sleep, level, mode)
    return {**_sleep_view(ctx), "level": level}


@router.post("/wakeup")
async def wakeup(request: Request, tags: list[str] | None = Query(None)) -> dict[str, Any]:
    """`?tags=weights&tags=kv_cache`; no tags wakes everything."""
    ctx = ctx_of(request)
    await ctx.run_sync(ctx.engine.wakeup, tags or None)
    return _sleep_view(ctx)


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, Any]:
    return _sleep_view(ctx_of(request))


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict[str, Any]:
    ctx = ctx_of(request)
    await ctx.run_sync(ctx.engine.reset_prefix_cache)
    return {"reset": True, "weights_version": ctx.engine.weights_version}


@router.get("/weights_version")
async def weights_version(request: Request) -> dict[str, Any]:
    return {"weights_version": ctx_of(request).engine.weights_version}


# --------------------------------------------------------------------------- /update_weights


class _UpdateOptions(BaseModel):
    """How to apply an update (query parameters, or JSON fields next to `path` / `tensors`)."""

    model_config = ConfigDict(extra="forbid")

    policy: str = "drain"
    version: int | None = None
    partial: bool = False
    drain_timeout_s: float | None = None
    # A LoRA adapter update (PEFT-named tensors) whose source does not state its alpha.
    lora_alpha: float | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"policy": self.policy, "version": self.version, "partial": self.partial}
        if self.drain_timeout_s is not None:
            kw["drain_timeout_s"] = self.drain_timeout_s
        if self.lora_alpha is not None:
            kw["lora_alpha"] = self.lora_alpha
        return kw


class _ChunkOptions(_UpdateOptions):
    finished: bool = True
    update_id: str | None = None


class _PathUpdate(_UpdateOptions):
    path: str


class _TensorsUpdate(_ChunkOptions):
    tensors: list[dict[str, Any]]


class _TransferUpdate(_UpdateOptions):
    transfer: dict[str, Any]  # a TransferRef: {"address", "uuid", "timeout_s"?, "processes"?}


async def _apply_chunk(ctx: ServerContext, payload, opts: _ChunkOptions, content_type: str) -> dict[str, Any]:
    """Stage a chunk (body bytes or the parsed `tensors` list; the engine decodes it, in the
    worker thread); on `finished`, commit every staged tensor as one update."""

    def run():
        return ctx.engine.update_weights_chunk(
            payload,
            finished=opts.finished,
            update_id=opts.update_id,
            content_type=content_type,
            **opts.engine_kwargs(),
        )

    version = await ctx.run_sync(run)
    if version is None:
        pending = ctx.engine.stager.pending
        return {
            "staged": pending["count"],
            "staged_bytes": pending["bytes"],
            "update_id": pending["update_id"],
        }
    ctx.weight_updates += 1
    return {"weights_version": version, "policy": opts.policy}


@router.post("/update_weights")
async def update_weights(request: Request) -> dict[str, Any]:
    """Four body forms:

    - JSON `{"path": ..., "policy", "version", "partial"}`: a checkpoint directory under --weights-root;
    - JSON `{"transfer": {"address", "uuid", "timeout_s", "processes"}, "policy", "version"}`: a tree another JAX
      process published with `hotswap.weights.transfer.publish`, pulled device to device;
    - JSON `{"tensors": [{name, dtype, shape, data (base64)}], "finished", "update_id", ...}`;
    - safetensors bytes (`application/octet-stream`) with the options as query parameters.

    Pickle / torch.save bodies are refused (400) by their bytes, whatever the content type.
    """
    ctx = ctx_of(request)
    ctx.check_admitting()
    content_type = request.headers.get("content-type", "application/octet-stream")
    query = dict(request.query_params)
    body = await request.body()
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        opts = _ChunkOptions.model_validate(query)
        return await _apply_chunk(ctx, body, opts, content_type)

    sniff_refuse_pickle(body)  # a pickle mislabelled as JSON still gets the clear refusal
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PayloadError(f"update_weights body is not valid JSON: {e}") from None
    except RecursionError:  # [[[[...]]]] thousands deep: json's C parser gives up
        raise PayloadError("update_weights body is JSON nested too deeply") from None
    if isinstance(data, dict) and "serialized_named_tensors" in data:
        # What other engines' update-from-tensor routes take: pickled (ForkingPickler) tensors.
        raise PickleRefused(
            '"serialized_named_tensors" holds pickled tensors, and pickles are never loaded; send '
            'JSON {"path": dir} or {"tensors": [{name, dtype, shape, data (base64)}]}, or safetensors '
            "bytes as application/octet-stream"
        )
    if not isinstance(data, dict) or sum(k in data for k in ("path", "tensors", "transfer")) != 1:
        raise PayloadError(
            'update_weights JSON needs exactly one of "path" (a directory), "tensors" (entries) or '
            '"transfer" (a hotswap.weights.transfer reference)'
        )
    if "transfer" in data:
        from hotswap.weights.transfer import TransferRef  # imports jax: only when this form is used

        xupd = _TransferUpdate.model_validate({**query, **data})
        ref = TransferRef.from_json(xupd.transfer)
        version = await ctx.run_sync(ctx.engine.update_weights, ref, **xupd.engine_kwargs())
        ctx.weight_updates += 1
        return {"weights_version": version, "policy": xupd.policy}
    if "path" in data:
        upd = _PathUpdate.model_validate({**query, **data})
        if ctx.engine.weights_root is None:
            raise WeightsPathNotAllowed(
                "updates from a path are disabled: start the server with --weights-root DIR"
            )
        version = await ctx.run_sync(ctx.engine.update_weights, upd.path, **upd.engine_kwargs())
        ctx.weight_updates += 1
        return {"weights_version": version, "policy": upd.policy}
    tupd = _TensorsUpdate.model_validate({**query, **data})
    opts = _ChunkOptions.model_validate(tupd.model_dump(exclude={"tensors"}))
    return await _apply_chunk(ctx, tupd.tensors, opts, content_type)


@router.delete("/update_weights")
async def abort_staged_update(request: Request) -> dict[str, Any]:
    """Drop a chunked update in progress (nothing staged is committed)."""
    ctx = ctx_of(request)
    dropped = ctx.engine.stager.pending["count"]
    ctx.engine.stager.abort()
    return {"dropped": dropped}

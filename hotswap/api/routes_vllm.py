"""vLLM-compatible RL routes under the `/vllm` prefix, with vLLM's names, bodies and shapes.

Why a prefix: four of vLLM's names (`/sleep`, `/is_sleeping`, `/reset_prefix_cache`,
`/update_weights`) are already hotswap's own routes with other semantics (hotswap's
`/update_weights` is one request carrying the weights; vLLM's is one chunk of a four-phase
update). A prefix keeps both sets whole, documented and tested, selectable per request;
a vLLM controller points its base URL at `http://host:port/vllm`, and the OpenAI routes are
mounted there too (`/vllm/v1/completions`), where each finished choice carries vLLM's
`weight_versions` spans (server.py mounts them; protocol.version_fields builds them).

The four-phase update: `/init_weight_transfer_engine` accepts only the `http` backend
(hotswap's safe payloads over this connection: JSON tensor entries or safetensors bytes);
NCCL, CUDA IPC and the others are refused with a 400 naming what exists. `/start_weight_update`
opens a staged update, each `/update_weights` stages one chunk, `/finish_weight_update`
commits them all at once (validate -> swap; nothing changes if anything is wrong).

Each route is an adapter over api/actions.py. A body whose bytes are a pickle gets 415, a
pickled `serialized_named_tensors` in `update_info` 400, and neither is ever unpickled.

Three of vLLM's names are free at the root too, and served there as well as under `/vllm`:
`/tokenize` and `/detokenize` (`tokenization`: inference routes, the api key at the root as on
`/v1/*`, the admin key under `/vllm`) and `/abort_requests` (`aborts`: the admin key).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import pydantic
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from hotswap.api import actions
from hotswap.api.engine_loop import ServerContext, ctx_of, require_admin
from hotswap.api.http_errors import LifecycleConflict, PickleBodyRefused, RequestError
from hotswap.api.protocol import DetokenizeRequest, TokenizeRequest
from hotswap.api.version_labels import VLLM_PREFIX, label
from hotswap.engine.chat import chat_prompt
from hotswap.toolcalls.choice import ToolChoice

PREFIX = VLLM_PREFIX
BACKENDS = {"http": "hotswap's safe payloads over HTTP: " + actions.SAFE_FORMATS}
PAUSE_MODES = ("abort", "wait", "keep")
REFUSED_BACKENDS = ("nccl", "ipc", "sparse_nccl", "sharded_rdt")

router = APIRouter(prefix=PREFIX, dependencies=[Depends(require_admin)])
tokenization = APIRouter()  # its key is set where it is mounted (server.py)
aborts = APIRouter(dependencies=[Depends(require_admin)])


@dataclasses.dataclass
class TransferState:
    """The four-phase update's host bookkeeping (one per server)."""

    backend: str | None = None
    update_id: str | None = None  # set between start_weight_update and finish_weight_update


def _transfer(ctx: ServerContext) -> TransferState:
    if ctx.vllm_transfer is None:
        ctx.vllm_transfer = TransferState()
    return ctx.vllm_transfer


# --------------------------------------------------------------------------- pause / resume


@router.post("/pause")
async def pause(
    request: Request, mode: str = Query("abort"), clear_cache: bool = Query(True)
) -> JSONResponse:
    """abort | wait | keep. `clear_cache` empties the prefix index; running sequences keep
    their pages (under `keep` they resume over their old KV, labelled mixed)."""
    await actions.pause(ctx_of(request), mode, PAUSE_MODES, clear_cache=clear_cache)
    return JSONResponse({"status": "paused"})


@router.post("/resume")
async def resume(request: Request) -> JSONResponse:
    await actions.resume(ctx_of(request))
    return JSONResponse({"status": "resumed"})


@router.get("/is_paused")
async def is_paused(request: Request) -> JSONResponse:
    return JSONResponse({"is_paused": ctx_of(request).engine.is_paused})


# --------------------------------------------------------------------------- sleep / wake_up


@router.post("/sleep")
async def sleep(request: Request, level: int = Query(1), mode: str = Query("abort")) -> Response:
    await actions.sleep(ctx_of(request), level, mode)
    return Response(status_code=200)


@router.post("/wake_up")
async def wake_up(request: Request, tags: list[str] | None = Query(None)) -> Response:
    await actions.wakeup(ctx_of(request), tags)
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> JSONResponse:
    return JSONResponse({"is_sleeping": ctx_of(request).engine.is_sleeping})


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> Response:
    await actions.reset_prefix_cache(ctx_of(request))
    return Response(status_code=200)


@router.get("/weight_info")
async def weight_info(request: Request) -> JSONResponse:
    ctx = ctx_of(request)
    return JSONResponse({"weight_version": label(ctx, ctx.engine.weights_version)})


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> JSONResponse:
    data = await actions.read_fields(request, pickle_error=PickleBodyRefused)
    if not isinstance(data.get("new_version"), str):
        raise RequestError('update_weight_version needs {"new_version": "<label>"}')
    actions.relabel(ctx_of(request), data["new_version"])
    return JSONResponse({"success": True, "new_version": data["new_version"]})


# --------------------------------------------------------------------------- four-phase update


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request) -> JSONResponse:
    ctx = ctx_of(request)
    data = await actions.read_fields(request, pickle_error=PickleBodyRefused)
    init_info = data.get("init_info")
    if not isinstance(init_info, dict):
        raise RequestError("Missing 'init_info' in request body")
    backend = str(init_info.get("backend", "http"))
    if backend not in BACKENDS:
        known = "; ".join(f"{k!r} ({v})" for k, v in BACKENDS.items())
        why = " (a GPU transport this engine does not have)" if backend in REFUSED_BACKENDS else ""
        raise RequestError(
            f"weight transfer backend {backend!r} is not available here{why}; available: {known}"
        )
    _transfer(ctx).backend = backend
    return JSONResponse({"message": "Weight transfer initialized"})


@router.post("/start_weight_update")
async def start_weight_update(request: Request) -> JSONResponse:
    ctx = ctx_of(request)
    t = _transfer(ctx)
    if t.backend is None:
        raise LifecycleConflict("call /vllm/init_weight_transfer_engine first")
    if t.update_id is not None:
        raise LifecycleConflict(
            "start_weight_update called while a weight update is already in progress. "
            "Call finish_weight_update first."
        )
    actions.drop_staged(ctx)  # a fresh staging area: nothing half-sent from before is committed
    t.update_id = f"vllm-{uuid.uuid4().hex}"
    return JSONResponse({"message": "Weight update started"})


def _open(ctx: ServerContext) -> str:
    t = _transfer(ctx)
    if t.update_id is None:
        raise LifecycleConflict("no weight update in progress: call /vllm/start_weight_update first")
    return t.update_id


@router.post("/update_weights")
async def update_weights(request: Request) -> JSONResponse:
    """One chunk: JSON `{"update_info": {"tensors": [entries]}}` or safetensors bytes."""
    ctx = ctx_of(request)
    # The body first: a pickle, or a pickled field, is refused whatever state the update is in.
    body = await actions.read_update(request, pickle_error=PickleBodyRefused)
    payload: Any = body.payload
    if payload is None:
        info = body.fields.get("update_info")
        if not isinstance(info, dict):
            raise RequestError("Missing 'update_info' in request body")
        payload = actions.tensor_entries(
            info,
            'the http backend takes update_info {"tensors": [{name, dtype, shape, data (base64)}]} '
            "(names/dtype_names/shapes describe an NCCL broadcast, which is not available here)",
        )
    uid = _open(ctx)
    await actions.update_chunk(ctx, payload, content_type=body.content_type, finished=False, update_id=uid)
    return JSONResponse({"message": "Weights updated"})


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> JSONResponse:
    """Commit every staged chunk as one update; `weight_version` labels the new version."""
    ctx = ctx_of(request)
    uid = _open(ctx)
    data = await actions.read_fields(request, pickle_error=PickleBodyRefused)
    try:
        await actions.update_chunk(ctx, {}, update_id=uid, label=data.get("weight_version"))
    finally:
        _transfer(ctx).update_id = None  # committed or refused: either way this update is over
        actions.drop_staged(ctx)
    return JSONResponse({"message": "Weight update finished"})


# --------------------------------------------------------------------------- abort


class _AbortRequests(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    request_ids: list[str] | None = None


@aborts.post("/abort_requests")
async def abort_requests(request: Request) -> JSONResponse:
    """vLLM's RL route: end the named requests (empty or missing `request_ids`: every one in
    flight) without pausing the engine; each answers with finish_reason "abort" and its
    partial output. An id never run here: 404; one that ended lately: listed in `finished`."""
    fields = await actions.read_fields(request, pickle_error=PickleBodyRefused)
    body = _AbortRequests.model_validate(fields)
    done = await actions.abort_requests(ctx_of(request), body.request_ids or None)
    return JSONResponse(
        {
            "status": "aborted",
            "aborted": len(done.request_ids),
            "request_ids": done.request_ids,
            "finished": done.finished,
        }
    )


# --------------------------------------------------------------------------- tokenize


def _tokenizer(ctx: ServerContext):
    tok = ctx.engine.tokenizer
    if tok is None:
        raise RequestError("this model has no tokenizer: send and read token ids")
    return tok


@tokenization.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    """A prompt's ids, or a conversation's as /v1/chat/completions renders it (the same
    template, tools and options): {count, max_model_len, tokens, token_strs}."""
    ctx = ctx_of(request)
    ctx.check_model(body.model)
    body.check()
    tok = _tokenizer(ctx)
    if body.messages is not None:
        text, ids = chat_prompt(
            tok,
            [m.model_dump(exclude_none=True) for m in body.messages],
            chat_template_kwargs=body.chat_template_kwargs,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=ToolChoice.of(body.tools, None, None).offered,
            tool_format=ctx.tool_format,
        )
        if body.add_special_tokens:  # on top of what the template placed (vLLM's option)
            ids = tok.encode(text, add_special_tokens=True)
    else:
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    strs = [tok.id_to_token(i) for i in ids] if body.return_token_strs else None
    return JSONResponse(
        {"count": len(ids), "max_model_len": ctx.engine.ecfg.max_model_len, "tokens": ids, "token_strs": strs}
    )


@tokenization.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    """Ids back to text, special tokens kept: {prompt}."""
    ctx = ctx_of(request)
    ctx.check_model(body.model)
    tok = _tokenizer(ctx)
    bad = [(i, t) for i, t in enumerate(body.tokens) if not 0 <= t < tok.vocab_size]
    if bad:
        i, t = bad[0]
        raise RequestError.of_field(
            f"tokens[{i}]", f"token id {t} is outside the vocabulary [0, {tok.vocab_size})"
        )
    return JSONResponse({"prompt": tok.decode(body.tokens, skip_special_tokens=False)})

"""SGLang-compatible RL routes, with SGLang's names, bodies and response shapes: an adapter
over api/actions.py (the actions) and api/streaming.py (`/generate`'s stream).

What AReaL and slime call on an SGLang server, mapped onto hotswap's transitions:
`/update_weights_from_disk`, `/update_weights_from_tensor` (safe encodings only),
`/pause_generation` and `/continue_generation` (Engine.pause / resume), `/flush_cache`,
`/release_memory_occupation` and `/resume_memory_occupation` (sleep / wakeup),
`/get_weight_version`, `/update_weight_version`, and a single-prompt `/generate` whose
`meta_info` carries `weight_version` and per-token `weight_versions` spans (and, asked with
`return_routed_experts`, a MoE model's `routed_experts` in SGLang's encoding). None of these
names is one of hotswap's own routes, so they live at the root. Every route here takes the
admin key, `/generate` included: the api key opens `/v1/*` only, and an RL controller that
pauses and updates holds the admin key anyway.

Failures answer SGLang's `{"success": false, "message": ...}` with the status of hotswap's
error table (api/http_errors.py); a body whose bytes are a pickle gets 415, a pickled
`serialized_named_tensors` field 400, and neither is ever unpickled.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from hotswap.api import actions, prompt_fields, router_fields, streaming, structured_fields
from hotswap.api.engine_loop import ServerContext, ctx_of, require_admin
from hotswap.api.http_errors import HotswapError, PickleBodyRefused, RequestError, exception_body
from hotswap.api.kept_fields import kept_json
from hotswap.api.protocol import spec_decode, wire_logprob
from hotswap.api.version_labels import label, spans
from hotswap.engine import lifecycle
from hotswap.engine.outputs import RequestOutput
from hotswap.engine.sampling import SamplingParams
from hotswap.programs.sampler import TOP_LOGPROBS
from hotswap.weights.options import UpdateOptions

router = APIRouter()
admin = [Depends(require_admin)]
PAUSE_MODES = ("abort", "retract", "in_place")


def failure(e: HotswapError) -> JSONResponse:
    """SGLang's shape, plus hotswap's `error` object (every 4xx/5xx body here carries one)."""
    status, body, headers = exception_body(e)
    return JSONResponse({**body, "success": False, "message": str(e)}, status_code=status, headers=headers)


class _UpdateFromDisk(BaseModel):
    """SGLang's UpdateWeightFromDiskReqInput. CUDA-side knobs are accepted and have no effect
    here (there is no CUDA graph to recapture nor torch cache to empty)."""

    model_config = ConfigDict(extra="forbid")

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True  # always true here: an update empties the prefix cache by construction
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int | None = None


def _in_flight(ctx: ServerContext) -> int:
    return ctx.engine.num_running() + ctx.engine.num_waiting()


@router.post("/update_weights_from_disk", dependencies=admin)
async def update_weights_from_disk(body: _UpdateFromDisk, request: Request) -> JSONResponse:
    """Not paused: waits for in-flight requests (drain), as SGLang does; paused: applies now."""
    ctx = ctx_of(request)
    try:
        ctx.check_admitting()
        source = actions.path_source(ctx, body.model_path, "model_path")
        if body.abort_all_requests:
            await actions.abort_all(ctx)
        paused = _in_flight(ctx) if ctx.engine.is_paused else 0
        await actions.update(ctx, source, UpdateOptions(), label=body.weight_version)
    except HotswapError as e:
        return failure(e)
    return JSONResponse(
        {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": paused}
    )


def _flag(value: Any) -> bool:
    """A boolean that may come as a query string."""
    return value is True or str(value).lower() in ("1", "true")


@router.post("/update_weights_from_tensor", dependencies=admin)
async def update_weights_from_tensor(request: Request) -> JSONResponse:
    """JSON `{"tensors": [...], "weight_version", "flush_cache", "abort_all_requests"}`, or
    safetensors bytes with those as query parameters. `serialized_named_tensors`: 400."""
    ctx = ctx_of(request)
    try:
        body = await actions.read_update(request, pickle_error=PickleBodyRefused)
        fields = {**request.query_params, **body.fields}
        if body.payload is None:
            missing = f'update_weights_from_tensor JSON needs "tensors"; send {actions.SAFE_FORMATS}'
            payload: Any = actions.tensor_entries(body.fields, missing)
        else:
            payload = body.payload
        if _flag(fields.get("abort_all_requests")):
            await actions.abort_all(ctx)
        await actions.update_chunk(
            ctx, payload, content_type=body.content_type, label=fields.get("weight_version")
        )
    except HotswapError as e:
        return failure(e)
    return JSONResponse({"success": True, "message": "Succeeded to update parameter online."})


class _Pause(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: str = "abort"  # abort | retract | in_place


@router.post("/pause_generation", dependencies=admin)
async def pause_generation(request: Request) -> JSONResponse:
    ctx = ctx_of(request)
    try:
        body = _Pause.model_validate(await actions.read_fields(request, pickle_error=PickleBodyRefused))
        await actions.pause(ctx, body.mode, PAUSE_MODES)
    except HotswapError as e:
        return failure(e)
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation", dependencies=admin)
async def continue_generation(request: Request) -> JSONResponse:
    await actions.resume(ctx_of(request))
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


@router.api_route("/flush_cache", methods=["GET", "POST"], dependencies=admin)
async def flush_cache(request: Request) -> Response:
    """Succeeds even while requests run: they keep their pages, only the index is emptied."""
    await actions.reset_prefix_cache(ctx_of(request))
    return PlainTextResponse("Cache flushed.\n")


class _Tags(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: list[str] | None = None


async def _tags(request: Request) -> frozenset[str]:
    fields = await actions.read_fields(request, pickle_error=PickleBodyRefused)
    return lifecycle.wake_tags(_Tags.model_validate(fields).tags, RequestError)


@router.post("/release_memory_occupation", dependencies=admin)
async def release_memory_occupation(request: Request) -> JSONResponse:
    """Sleep level 1 (weights to host memory, KV dropped: in-flight requests end), then wake
    what was not asked to be released, so exactly `tags` stay released."""
    ctx = ctx_of(request)
    try:
        tags = await _tags(request)
        await actions.release(ctx, tags)
    except HotswapError as e:
        return failure(e)
    return JSONResponse({"success": True, "message": f"Released {', '.join(sorted(tags))}."})


@router.post("/resume_memory_occupation", dependencies=admin)
async def resume_memory_occupation(request: Request) -> JSONResponse:
    ctx = ctx_of(request)
    try:
        tags = await _tags(request)
        await actions.wakeup(ctx, sorted(tags))
    except HotswapError as e:
        return failure(e)
    return JSONResponse({"success": True, "message": f"Resumed {', '.join(sorted(tags))}."})


@router.get("/get_weight_version", dependencies=admin)
async def get_weight_version(request: Request) -> dict[str, Any]:
    ctx = ctx_of(request)
    return {"weight_version": label(ctx, ctx.engine.weights_version)}


class _NewVersion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    new_version: str
    abort_all_requests: bool = False


@router.post("/update_weight_version", dependencies=admin)
async def update_weight_version(body: _NewVersion, request: Request) -> JSONResponse:
    """Relabel the serving version (the weights do not change)."""
    ctx = ctx_of(request)
    if body.abort_all_requests:
        await actions.abort_all(ctx)
    actions.relabel(ctx, body.new_version)
    return JSONResponse({"success": True, "new_version": body.new_version})


class _Abort(BaseModel):
    """SGLang's AbortReq: one request by `rid`, or `abort_all`."""

    model_config = ConfigDict(extra="forbid")
    rid: str = ""
    abort_all: bool = False


@router.post("/abort_request", dependencies=admin)
async def abort_request(request: Request) -> JSONResponse:
    """End the request `rid` names (its `/generate` rid, or any id api/request_ids.py knows),
    or every request in flight with `abort_all`; each answers with finish_reason "abort" and
    its partial output. A rid never run here: 404; one that ended lately: 200, in `finished`."""
    ctx = ctx_of(request)
    try:
        body = _Abort.model_validate(await actions.read_fields(request, pickle_error=PickleBodyRefused))
        if not body.abort_all and not body.rid:
            raise RequestError('/abort_request takes {"rid": "<request id>"} or {"abort_all": true}')
        done = await actions.abort_requests(ctx, None if body.abort_all else [body.rid])
    except HotswapError as e:
        return failure(e)
    return JSONResponse({"success": True, "aborted": done.request_ids, "finished": done.finished})


# --------------------------------------------------------------------------- /generate


class _SGLangSampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    # Structured outputs (SGLang's names): at most one.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # hotswap's (as on the OpenAI routes): what the log-probs are of, each token's kept set
    # (`meta_info.kept_counts` ...: api/kept_fields.py).
    logprobs_mode: str | None = None
    return_kept_set: bool | str | None = None
    # SGLang's: a matched stop string stays at the end of the text (api/router_fields.py).
    no_stop_trim: bool = False

    def engine(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.sampling_seed,
            max_tokens=self.max_new_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            logprobs_mode=self.logprobs_mode,
            return_kept_set=self.return_kept_set,
            include_stop_str_in_output=self.no_stop_trim,
            structured_outputs=structured_fields.from_sglang(
                self.json_schema, self.regex, self.ebnf, self.structural_tag
            ),
        )


class _Generate(BaseModel):
    """One prompt (`text` or `input_ids`); batches are not taken here."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: _SGLangSampling = _SGLangSampling()
    stream: bool = False
    return_logprob: bool = False
    # With return_logprob: the prompt tokens' log-probs from this index (-1: the last token only,
    # which computes none) in `input_token_logprobs`; `top_logprobs_num` likeliest tokens per
    # position in `input_top_logprobs` / `output_top_logprobs`; token texts instead of nulls.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    rid: str | None = None
    # A MoE model's routing (SGLang's rollout routing replay): `meta_info.routed_experts`, base64
    # of int32 [rows, moe layers, k] for the tokens [routed_experts_start_len, seq_len - 1).
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # What sglang-router fills in (api/router_fields.py): `model` names the served model or a
    # LoRA adapter, as on /v1/*; `no_logs` either value (no request's contents are logged here);
    # the rest only at these values (another: a 400 naming it).
    model: str | None = None
    no_logs: bool = False
    log_metrics: bool = True
    return_hidden_states: bool = False
    background: bool = False
    return_bytes: bool = False
    return_entropy: bool = False


def _routed_experts(c, start: int) -> dict[str, Any]:
    """SGLang's encoding: base64 of the int32 array [rows, moe layers, k], flattened, rows from
    `start` (`routed_experts_start_len`: a later turn skips what it already holds)."""
    if c.routed_experts is None:
        return {"routed_experts": None}
    rows = np.ascontiguousarray(c.routed_experts[start:], dtype=np.int32)
    return {"routed_experts": base64.b64encode(rows.tobytes()).decode(), "routed_experts_start_len": start}


def _logprob_start(body: _Generate, prompt_len: int) -> int:
    """The first prompt index whose token `input_token_logprobs` lists (SGLang's -1: the last)."""
    start = prompt_len - 1 if body.logprob_start_len == -1 else body.logprob_start_len
    if not 0 <= start < prompt_len:
        raise RequestError(
            f"logprob_start_len={body.logprob_start_len} must be -1 or in [0, {prompt_len - 1}] (the prompt's tokens)"
        )
    if not 0 <= body.top_logprobs_num <= TOP_LOGPROBS:
        raise RequestError(f"top_logprobs_num={body.top_logprobs_num} must be in [0, {TOP_LOGPROBS}]")
    return start


def _logprobs(ctx: ServerContext, body: _Generate, out: RequestOutput, start: int) -> dict[str, Any]:
    """SGLang's log-prob fields of `meta_info`: [logprob, token id, text or null] per token."""
    tok, c, k = ctx.engine.tokenizer, out.outputs[0], body.top_logprobs_num

    def text(tid: int) -> str | None:
        return tok.decode([tid], skip_special_tokens=False) if body.return_text_in_logprobs and tok else None

    meta = prompt_fields.sglang_input(out.prompt_token_ids, out.prompt_logprobs, start, k, text)
    meta["output_token_logprobs"] = [
        [wire_logprob(lp), t, text(t)] for lp, t in zip(c.logprobs, c.token_ids, strict=True)
    ]
    if k:
        meta["output_top_logprobs"] = [
            [[wire_logprob(lp), i, text(i)] for i, lp in d.items()] for d in c.top_logprobs or []
        ]
    return meta


def _body(
    ctx: ServerContext, out: RequestOutput, logprobs: dict[str, Any] | None, routed_from: int | None = None
) -> dict[str, Any]:
    c = out.outputs[0]
    finish = None if c.finish_reason is None else {"type": c.finish_reason}
    if finish is not None and c.stop_reason is not None:
        finish["matched"] = c.stop_reason
    versions = c.weights_versions
    meta: dict[str, Any] = {
        "id": out.request_id,
        "finish_reason": finish,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(c.token_ids),
        "cached_tokens": out.num_cached_tokens,
        "weight_version": label(ctx, versions[-1] if versions else out.weights_version),
        "weight_versions": spans(ctx, versions),
        "kv_weight_versions": spans(ctx, c.kv_versions),  # hotswap: oldest KV per token
    }
    if logprobs is not None:
        meta.update(logprobs)
    if routed_from is not None:
        meta.update(_routed_experts(c, routed_from))
    meta.update(kept_json(c))
    spec = spec_decode([c])
    if spec is not None:  # SGLang's count of verifications, and the figures `usage` carries
        meta.update(spec_verify_ct=spec["num_drafts"], spec_decode=spec)
    return {"text": c.text, "output_ids": list(c.token_ids), "meta_info": meta}


@router.post("/generate", dependencies=admin)
async def generate(body: _Generate, request: Request) -> Response:
    ctx = ctx_of(request)
    ctx.check_admitting()
    if (body.text is None) == (body.input_ids is None):
        raise RequestError('/generate takes exactly one of "text" or "input_ids" (one prompt)')
    router_fields.refuse_unserved(body)
    lora_name = ctx.check_model(body.model)
    _, ids = ctx.engine.tokenize(body.text if body.text is not None else body.input_ids)
    if not 0 <= body.routed_experts_start_len <= len(ids):
        raise RequestError(
            f"routed_experts_start_len={body.routed_experts_start_len} must be in [0, {len(ids)}] (the prompt's tokens)"
        )
    params = body.sampling_params.engine()
    params.return_routed_experts = body.return_routed_experts
    start = _logprob_start(body, len(ids)) if body.return_logprob else None
    if start is not None:
        params.logprobs = body.top_logprobs_num
        if start < len(ids) - 1:  # the prompt's log-probs from the step (no prefix-cache hit then)
            params.prompt_logprobs = body.top_logprobs_num
    routed_from = body.routed_experts_start_len if body.return_routed_experts else None
    queue: asyncio.Queue = asyncio.Queue()
    # SGLang's `rid`: the client's id for this request (`meta_info.id`), which /abort_request takes.
    rids = [await ctx.submit(ids, params, body.stream, queue, lora_name, rid=body.rid)]

    def render(out: RequestOutput) -> list[dict[str, Any]]:
        logprobs = None if start is None else _logprobs(ctx, body, out, start)
        return [_body(ctx, out, logprobs, routed_from)]

    if body.stream:
        return streaming.stream(streaming.events(ctx, request, queue, rids, render))
    outs = await streaming.collect(ctx, request, queue, rids)
    if outs is None:
        return streaming.gone()
    return JSONResponse(render(outs[0])[0])

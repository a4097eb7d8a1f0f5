"""What SGLang's server tells a router about itself, with SGLang's names and keys, so
sglang-router (SGLang Model Gateway) registers and balances hotswap replicas as SGLang ones.

On registration the router reads `/server_info` (`/get_server_info`, the older name, as a
fall-back): `served_model_name` (else `model_path`) is the model it routes by, `dp_size` the
data-parallel ranks; then `/model_info` (`/get_model_info`): `model_type`, `architectures`.
Its `/get_loads` reads each worker's `/get_load` (`num_tokens`). `/health_generate` is
SGLang's deeper health check (`--health-check-endpoint /health_generate`): one generated
token. They take the api key, as `/v1/models` does. `model_path` is the served name: a
replica does not publish its file system.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

import hotswap
from hotswap.api.engine_loop import ServerContext, ctx_of
from hotswap.api.version_labels import label
from hotswap.engine.sampling import SamplingParams
from hotswap.errors import HotswapError
from hotswap.model.config import hf_names

router = APIRouter()
HEALTH_GENERATE_S = 20.0  # SGLang's /health_generate waits 20 s for its token too


def _load(ctx: ServerContext) -> dict[str, int]:
    """SGLang's scheduler load: requests (running and waiting), waiting, tokens held in KV."""
    e = ctx.engine
    owned = e.state.pool.usage(e.state.prefix)["owned"]
    running, waiting = e.num_running(), e.num_waiting()
    return {
        "dp_rank": 0,
        "num_reqs": running + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": owned * e.ecfg.page_size,
    }


def _server_info(ctx: ServerContext) -> dict[str, Any]:
    e, name = ctx.engine, ctx.model_name
    cfg = e.ecfg
    return {
        "model_path": name,
        "tokenizer_path": name if e.tokenizer is not None else None,
        "served_model_name": name,
        "dp_size": 1,  # one engine a server; a fleet is several servers behind the router
        "context_length": cfg.max_model_len,
        "page_size": cfg.page_size,
        "max_running_requests": cfg.max_num_seqs,
        "max_prefill_tokens": cfg.max_num_batched_tokens,
        "chunked_prefill_size": cfg.max_num_batched_tokens,
        "max_total_num_tokens": (cfg.num_pages - 1) * cfg.page_size,  # page 0 is the null page
        "max_req_input_len": cfg.max_model_len - 1,
        "enable_lora": cfg.enable_lora,
        "version": hotswap.__version__,
        "weight_version": label(ctx, e.weights_version),
        "internal_states": [{**_load(ctx), "weight_version": label(ctx, e.weights_version)}],
    }


def _model_info(ctx: ServerContext) -> dict[str, Any]:
    e = ctx.engine
    model_type, architecture = hf_names(e.mcfg.arch)
    return {
        "model_path": ctx.model_name,
        "tokenizer_path": ctx.model_name if e.tokenizer is not None else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": label(ctx, e.weights_version),
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": model_type,
        "architectures": [architecture],
        # a draft checkpoint's version (speculative_config `model: <path>`); None without one
        "draft_version": e.draft_version,
    }


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict[str, Any]:
    return _server_info(ctx_of(request))


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> dict[str, Any]:
    return _model_info(ctx_of(request))


@router.get("/get_load")
async def get_load(request: Request) -> list[dict[str, int]]:
    """A list, one entry per data-parallel rank, as SGLang's."""
    return [_load(ctx_of(request))]


def _unhealthy(why: str) -> JSONResponse:
    return JSONResponse({"status": why}, status_code=503)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 once the engine generates one token (greedy, after the BOS token or token 0);
    503 naming why it cannot: shutting down, paused, asleep, refused, or no token in time."""
    ctx = ctx_of(request)
    e = ctx.engine
    if ctx.shutting_down or not ctx.loop.alive:
        return _unhealthy("shutting down" if ctx.shutting_down else "engine loop stopped")
    if e.is_paused or e.is_sleeping:
        return _unhealthy("paused" if e.is_paused else "asleep")
    queue: asyncio.Queue = asyncio.Queue()
    prompt = [e.mcfg.bos_token_id or 0]
    try:
        rid = await ctx.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0), False, queue)
    except HotswapError as err:
        return _unhealthy(f"refused: {err}")
    try:
        async with asyncio.timeout(HEALTH_GENERATE_S):
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    return _unhealthy(f"failed: {item}")
                if item.finished:
                    if item.outputs[0].finish_reason == "abort":
                        return _unhealthy("aborted")
                    return Response(status_code=200)
    except TimeoutError:
        ctx.loop.abort(rid)
        return _unhealthy(f"no token in {HEALTH_GENERATE_S:g} s")

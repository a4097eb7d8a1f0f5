"""LoRA adapters served by name over REST: vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (bodies `lora_name`, `lora_path`) and SGLang's `/load_lora_adapter`
and `/unload_lora_adapter` (the same fields).

The engine needs `--enable-lora`; a path must lie under `--weights-root` (a PEFT directory:
adapter_config.json and adapter_model.safetensors; a pickled adapter_model.bin is refused,
never unpickled). Loading validates the adapter before anything changes (rank above
`--max-lora-rank`, an unknown target module, another model's shapes, NaN, a name past
`--max-loras`: a typed 4xx naming the problem), then writes it into its buffer slot in place;
reloading a name bumps its version, so its cached prefixes stop matching. A request's `model`
then names the adapter (`/v1/models` lists them). Both dialects are adapters over
api/actions.py (`load_adapter`, `unload_adapter`).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from hotswap.api import actions
from hotswap.api.engine_loop import ctx_of, require_admin
from hotswap.api.http_errors import HotswapError
from hotswap.api.routes_sglang import failure

router = APIRouter(dependencies=[Depends(require_admin)])


class _LoadLoRA(BaseModel):
    """vLLM's LoadLoRAAdapterRequest and SGLang's LoadLoRAAdapterReqInput."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str
    lora_alpha: float | None = None  # only for a source whose config does not state it


class _UnloadLoRA(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_int_id: int | None = None


async def _load(body: _LoadLoRA, request: Request):
    return await actions.load_adapter(ctx_of(request), body.lora_name, body.lora_path, body.lora_alpha)


@router.post("/v1/load_lora_adapter")
async def load_vllm(body: _LoadLoRA, request: Request) -> Response:
    """vLLM answers 200 with a plain-text message."""
    a = await _load(body, request)
    return PlainTextResponse(f"Success: LoRA adapter '{a.name}' added successfully (version {a.version}).")


@router.post("/v1/unload_lora_adapter")
async def unload_vllm(body: _UnloadLoRA, request: Request) -> Response:
    await actions.unload_adapter(ctx_of(request), body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _loaded(request: Request) -> dict:
    return {a.name: a.source for a in ctx_of(request).engine.lora_adapters()}


@router.post("/load_lora_adapter")
async def load_sglang(body: _LoadLoRA, request: Request) -> JSONResponse:
    """SGLang's shape: `success`, `error_message`, `loaded_adapters`."""
    try:
        await _load(body, request)
    except HotswapError as e:
        return failure(e)
    return JSONResponse({"success": True, "error_message": "", "loaded_adapters": _loaded(request)})


@router.post("/unload_lora_adapter")
async def unload_sglang(body: _UnloadLoRA, request: Request) -> JSONResponse:
    try:
        await actions.unload_adapter(ctx_of(request), body.lora_name)
    except HotswapError as e:
        return failure(e)
    return JSONResponse({"success": True, "error_message": "", "loaded_adapters": _loaded(request)})

"""The REST actions layer: what the lifecycle routes of every dialect do, written once.

hotswap's own routes (management.py), SGLang's (routes_sglang.py), vLLM's (routes_vllm.py)
and the LoRA routes (routes_lora.py) are adapters: each maps its dialect's field names to a
call here, and the result to its dialect's response shape. Here, and nowhere else in the
HTTP layer:

- a request body is read: the pickle refusal (by the bytes, whatever the content type says),
  the content type, the JSON object, SGLang's pickled `serialized_named_tensors` field;
- a path is checked against `--weights-root` before the engine sees it;
- an update's REST fields become one `UpdateOptions` (`UpdateFields`, generated from it);
- the engine is called, in a worker thread (`ServerContext.run_sync`: a drain may take a
  while, and the event loop keeps streaming meanwhile), and the server's count of committed
  updates and its version labels are written;
- requests are aborted by the ids clients know them by (`abort_requests`: vLLM's
  `/abort_requests`, SGLang's `/abort_request`).

Payload bytes are not decoded here: the engine decodes them (`weights/readers.wire_tensors`),
the body's bytes or the `tensors` list of a JSON body parsed here alike.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

import pydantic
from fastapi import Request

from hotswap.api.engine_loop import ServerContext
from hotswap.api.http_errors import (
    HotswapError,
    PayloadError,
    PickleRefused,
    RequestError,
    RequestNotFound,
    WeightsPathNotAllowed,
)
from hotswap.checkpoint.payload import sniff_refuse_pickle
from hotswap.engine import lifecycle
from hotswap.weights import plan, readers
from hotswap.weights.options import UpdateOptions

JSON = "application/json"
OCTET = "application/octet-stream"  # a body without a Content-Type: safetensors bytes
SAFE_FORMATS = (
    'JSON {"tensors": [{"name", "dtype", "shape", "data" (base64)}]} or safetensors bytes '
    "(Content-Type: application/octet-stream)"
)

# --------------------------------------------------------------------------- bodies


@dataclasses.dataclass(frozen=True)
class Body:
    """An update's body, read once: a JSON object's `fields`, or (any other content type)
    `payload` bytes, which the engine decodes by `content_type`."""

    content_type: str
    fields: dict[str, Any]
    payload: bytes | None = None


def media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def _refuse_pickle(raw: bytes, error: type[HotswapError]) -> None:
    """A body whose bytes are a pickle, torch.save archive or object .npy is refused before
    anything reads it; `error`: the dialect's type for it (SGLang and vLLM answer 415)."""
    try:
        sniff_refuse_pickle(raw)
    except PickleRefused as e:
        if error is PickleRefused:
            raise
        raise error(str(e)) from None


def refuse_serialized(fields: dict[str, Any]) -> None:
    """SGLang's `serialized_named_tensors` (and vLLM's in `update_info`): pickled tensors, a
    PickleRefused (400) on every route, never unpickled."""
    if "serialized_named_tensors" in fields:
        raise PickleRefused(
            '"serialized_named_tensors" holds pickled (ForkingPickler) tensors, and pickles are never '
            f"loaded; send {SAFE_FORMATS}"
        )


def _json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PayloadError(f"the body is not valid JSON: {e}") from None
    except RecursionError:  # [[[[...]]]] thousands deep: json's C parser gives up
        raise PayloadError("the body is JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise PayloadError("the body must be a JSON object")
    refuse_serialized(data)
    return data


async def read_fields(
    request: Request, *, pickle_error: type[HotswapError] = PickleRefused
) -> dict[str, Any]:
    """A control route's body: a JSON object whatever the content type says (empty: {})."""
    raw = await request.body()
    _refuse_pickle(raw, pickle_error)
    return _json_object(raw)


async def read_update(request: Request, *, pickle_error: type[HotswapError] = PickleRefused) -> Body:
    """An update's body: a JSON object (`application/json`), or payload bytes (any other
    content type: safetensors, or whatever the engine's decoder names in its refusal)."""
    content_type = request.headers.get("content-type", OCTET)
    raw = await request.body()
    _refuse_pickle(raw, pickle_error)
    if media_type(content_type) == JSON:
        return Body(content_type, _json_object(raw))
    return Body(content_type, {}, raw)


def tensor_entries(fields: dict[str, Any], missing: str) -> list[dict[str, Any]]:
    """The `tensors` list of a JSON update (the engine decodes the entries); `missing`: the
    dialect's message when there is none."""
    refuse_serialized(fields)
    if "tensors" not in fields:
        raise RequestError(missing)
    entries = fields["tensors"]
    if not isinstance(entries, list) or not all(isinstance(t, dict) for t in entries):
        raise RequestError('"tensors" must be a list of {name, dtype, shape, data} entries')
    return entries


# --------------------------------------------------------------------------- update options


def _fields_model() -> type[pydantic.BaseModel]:
    # Generated from UpdateOptions, so a field and its default are written once, there.
    hints = typing.get_type_hints(UpdateOptions)
    fields: dict[str, Any] = {f.name: (hints[f.name], f.default) for f in dataclasses.fields(UpdateOptions)}
    return pydantic.create_model(
        "_UpdateOptionFields", __config__=pydantic.ConfigDict(extra="forbid"), **fields
    )


OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(UpdateOptions))


class UpdateFields(_fields_model()):  # type: ignore[misc]
    """UpdateOptions' fields over REST: query parameters, or JSON fields next to the source
    (query strings are coerced: `partial=true`, `version=3`); an unknown one is a 400."""

    def options(self) -> UpdateOptions:
        return UpdateOptions(**self.model_dump(include=OPTION_NAMES))


class ChunkFields(UpdateFields):
    """A chunked upload's fields besides the options: `finished=false` stages the chunk."""

    finished: bool = True
    update_id: str | None = None


# --------------------------------------------------------------------------- weight updates


def path_source(ctx: ServerContext, value: str, field: str = "path") -> str:
    """A path source, checked before the engine resolves it under `--weights-root` (which it
    must lie under: the engine's resolver refuses anything outside with a 403)."""
    if ctx.engine.weights_root is None:
        raise WeightsPathNotAllowed(
            f"{field}: loading from a path is disabled: start the server with --weights-root DIR"
        )
    if "\x00" in value:
        raise RequestError(f"{field} contains a NUL byte")
    return value


def transfer_source(ref: Any):
    """A `hotswap.weights.transfer` reference from its JSON: {"address", "uuid", "timeout_s"?, "processes"?}."""
    from hotswap.weights.transfer import TransferRef  # imports the transfer library: only when used

    return TransferRef.from_json(ref)


def named_source(ctx: ServerContext, data: dict, kind: str) -> Any:
    """The one weights source a JSON body names: `kind` "path" (a directory under
    --weights-root) or "transfer" (a reference)."""
    if kind == "path":
        if not isinstance(data["path"], str):
            raise RequestError('"path" must be a string: a directory under --weights-root')
        return path_source(ctx, data["path"])
    return transfer_source(data["transfer"])


def _committed(ctx: ServerContext, version: int, label: str | None) -> int:
    ctx.weight_updates += 1
    if label is not None:
        ctx.version_labels[version] = str(label)
    return version


async def update(ctx: ServerContext, source: Any, options: UpdateOptions, *, label: str | None = None) -> int:
    """One whole update (`path_source`, `transfer_source`); the new version, labelled
    `label` for SGLang and vLLM controllers."""
    ctx.check_admitting()
    version = await ctx.run_sync(ctx.engine.update_weights, source, options)
    return _committed(ctx, version, label)


async def update_draft(ctx: ServerContext, source: Any) -> int:
    """The speculative draft checkpoint's weights replaced (`Engine.update_draft_weights`): the
    draft's new version; the serving weights, their version and the cache untouched."""
    ctx.check_admitting()
    return await ctx.run_sync(ctx.engine.update_draft_weights, source)


async def prepare(ctx: ServerContext, source: Any, options: UpdateOptions) -> Any:
    """Pass 1 of a fleet-wide update (api/routes_fleet.py): `source` read, checked and placed
    while serving goes on; nothing swapped. Returns the engine's `place.Prepared`."""
    ctx.check_admitting()
    controller = ctx.engine.controller

    def stage():
        opened = readers.read(
            source, controller.mcfg, weights_root=controller.weights_root, abstract=controller.abstract
        )
        return controller.prepare_planned(
            plan.plan(opened, controller.mcfg, controller.abstract, options=options)
        )

    return await ctx.run_sync(stage)


async def commit_prepared(ctx: ServerContext, prepared: Any) -> int:
    """Pass 2: swap in what `prepare` placed (the caller paused the engine); the new version."""
    version = await ctx.run_sync(ctx.engine.controller.commit_prepared, prepared)
    return _committed(ctx, version, None)


@dataclasses.dataclass(frozen=True)
class Staged:
    """What a chunked upload holds after a chunk that did not finish it."""

    count: int
    nbytes: int
    update_id: str | None


async def update_chunk(
    ctx: ServerContext,
    payload: bytes | list | dict,
    *,
    content_type: str = OCTET,
    finished: bool = True,
    update_id: str | None = None,
    options: UpdateOptions | None = None,
    label: str | None = None,
) -> int | Staged:
    """Stage one chunk (body bytes or a JSON `tensors` list, decoded by the engine in the
    worker thread); on `finished`, commit every staged tensor as one update: its version."""
    ctx.check_admitting()
    opts = options or UpdateOptions()

    def run():
        return ctx.engine.update_weights_chunk(
            payload, finished=finished, update_id=update_id, content_type=content_type, options=opts
        )

    version = await ctx.run_sync(run)
    if version is None:
        pending = ctx.engine.stager.pending
        return Staged(pending["count"], pending["bytes"], pending["update_id"])
    return _committed(ctx, version, label)


def drop_staged(ctx: ServerContext) -> int:
    """Drop a chunked upload in progress (nothing staged is committed); how many tensors it held."""
    dropped = ctx.engine.stager.pending["count"]
    ctx.engine.stager.abort()
    return dropped


def relabel(ctx: ServerContext, name: str) -> None:
    """Label the serving version (the weights do not change)."""
    ctx.version_labels[ctx.engine.weights_version] = str(name)


# --------------------------------------------------------------------------- pause, sleep, cache


async def pause(ctx: ServerContext, mode: str, modes: tuple[str, ...], *, clear_cache: bool = False) -> None:
    """`modes`: the dialect's names of `engine/pausing.py`'s modes (SGLang's and vLLM's differ)."""
    if mode not in modes:
        raise RequestError(f"unknown pause mode {mode!r}; use {', '.join(modes[:-1])} or {modes[-1]}")
    await ctx.run_sync(ctx.engine.pause, mode, clear_cache=clear_cache)


async def resume(ctx: ServerContext) -> None:
    await ctx.run_sync(ctx.engine.resume)


async def abort_all(ctx: ServerContext) -> None:
    """Every request ends now, and the engine stays paused (in its mode) or not, as it was."""
    was = ctx.engine.pause_mode

    def run():
        ctx.engine.pause("abort")
        if was is None:
            ctx.engine.resume()
        else:
            ctx.engine.pause(was)

    await ctx.run_sync(run)


@dataclasses.dataclass(frozen=True)
class Aborted:
    """What an abort did: the engine requests it ended (each answers with finish_reason
    "abort" and its partial output), and the ids it named whose requests had already ended."""

    request_ids: list[str]
    finished: list[str]


async def abort_requests(ctx: ServerContext, ids: list[str] | None) -> Aborted:
    """End the requests `ids` name (api/request_ids.py: a client's own id, a response's `id`, an
    engine request's), or with `ids` None every request in flight; the engine is not paused.

    An id this server never ran is a RequestNotFound (404) and nothing is aborted; an id whose
    requests ended lately (an abort racing a finish) is listed in `finished`. Runs under the
    engine lock, so what is reported is what happened: the aborted requests' final outputs are
    on their way to their clients when this returns."""
    engine, ids_table = ctx.engine, ctx.loop.ids

    def run() -> Aborted:
        with engine.lock:
            if ids is None:
                running, finished = list(dict.fromkeys([*engine.requests, *ids_table.in_flight()])), []
            else:
                resolved = ids_table.resolve(ids)
                if resolved.unknown:
                    raise RequestNotFound(
                        f"no request with id {', '.join(map(repr, resolved.unknown))} was run by this "
                        "server (or it ended long ago); a request is named by the id it was answered "
                        "with (`id`), by its X-Request-Id / request_id, or by SGLang's rid"
                    )
                running, finished = resolved.running, resolved.finished
            for rid in running:
                if rid in engine.requests:
                    engine.abort(rid)
                else:  # named, not yet queued: the loop aborts it as soon as the engine has it
                    ids_table.doom(rid)
            return Aborted(running, finished)

    return await ctx.run_sync(run)


async def sleep(ctx: ServerContext, level: int, mode: str = "abort") -> None:
    """Level 1: weights to host memory, KV dropped. Level 2: weights dropped too. mode=wait drains first."""
    lifecycle.sleep_level(level, RequestError)  # refused before the engine thread is asked
    await ctx.run_sync(ctx.engine.sleep, level, mode)


async def wakeup(ctx: ServerContext, tags: list[str] | None) -> None:
    """No tags wakes everything."""
    lifecycle.wake_tags(tags, RequestError)
    await ctx.run_sync(ctx.engine.wakeup, tags or None)


async def release(ctx: ServerContext, tags: frozenset[str]) -> None:
    """Exactly `tags` asleep: a level-1 sleep (in-flight requests end), then the rest woken."""
    awake = lifecycle.SLEEP_TAGS - lifecycle.wake_tags(tags, RequestError)

    def run():
        ctx.engine.sleep(1)
        if awake:
            ctx.engine.wakeup(sorted(awake))

    await ctx.run_sync(run)


async def reset_prefix_cache(ctx: ServerContext) -> None:
    """Running requests keep their pages; only the prefix index is emptied."""
    await ctx.run_sync(ctx.engine.reset_prefix_cache)


# --------------------------------------------------------------------------- LoRA adapters


async def load_adapter(ctx: ServerContext, name: str, lora_path: str, lora_alpha: float | None):
    ctx.check_admitting()
    source = path_source(ctx, lora_path, "lora_path")
    return await ctx.run_sync(ctx.engine.load_lora_adapter, name, source, lora_alpha=lora_alpha)


async def unload_adapter(ctx: ServerContext, name: str) -> None:
    await ctx.run_sync(ctx.engine.unload_lora_adapter, name)

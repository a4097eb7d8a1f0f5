"""What the SGLang- and vLLM-compatible routes share: version labels, wire spans, body decoding.

SGLang and vLLM name a weights version with a free string (`weight_version="step-1"`);
hotswap's version is an int that only grows. Both are kept: `ServerContext.version_labels`
maps an int version to the label a controller gave it, and a version without one is
labelled by its number (`"1"`, `"2"`, ...). Spans on the wire are SGLang's and vLLM's
`weight_versions`: `[{"version": label, "start", "end"}]` over output token positions,
end exclusive.
"""

from __future__ import annotations

import json
from typing import Any

from hotswap.api.engine_loop import ServerContext
from hotswap.api.errors import PayloadError, UnsupportedMediaType
from hotswap.checkpoint.payload import sniff_refuse_pickle
from hotswap.errors import PickleRefused

VLLM_PREFIX = "/vllm"  # where the vLLM-compatible routes live (routes_vllm.py says why)

SAFE_FORMATS = (
    'JSON {"tensors": [{"name", "dtype", "shape", "data" (base64)}]} or safetensors bytes '
    "(Content-Type: application/octet-stream)"
)


class PickleMediaRefused(UnsupportedMediaType):
    """A pickled tensor body (SGLang's `serialized_named_tensors`): 415, never unpickled."""

    code = "pickle_refused"


def label(ctx: ServerContext, version: int) -> str:
    return ctx.version_labels.get(version, str(version))


def set_label(ctx: ServerContext, version: int, name: str | None) -> None:
    if name is not None:
        ctx.version_labels[version] = str(name)


def spans(ctx: ServerContext, versions: list[int]) -> list[dict[str, Any]]:
    """Runs of equal version over token positions, labelled: [{"version", "start", "end"}]."""
    out: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if out and out[-1]["_v"] == v:
            out[-1]["end"] = i + 1
        else:
            out.append({"_v": v, "version": label(ctx, v), "start": i, "end": i + 1})
    for s in out:
        del s["_v"]
    return out


def wire_version_fields(ctx: ServerContext, path: str):
    """Per finished choice, under the /vllm mount: vLLM's labelled `weight_versions` spans, and
    `kv_weight_versions` (hotswap's: the oldest KV each token was computed over); else nothing."""
    if not path.startswith(VLLM_PREFIX + "/"):
        return lambda comp: {}
    return lambda comp: {
        "weight_versions": spans(ctx, comp.weights_versions),
        "kv_weight_versions": spans(ctx, comp.kv_versions),
    }


def refuse_pickle(body: bytes) -> None:
    """415 with the safe formats named, for any body whose bytes are a pickle."""
    try:
        sniff_refuse_pickle(body)
    except PickleRefused as e:
        raise PickleMediaRefused(f"{e}; send {SAFE_FORMATS}") from None


def json_body(body: bytes) -> dict[str, Any]:
    """A JSON object body (an empty body is {}); a pickle in it is refused with 415 first."""
    if not body.strip():
        return {}
    refuse_pickle(body)
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise PayloadError(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise PayloadError("the body must be a JSON object")
    return data


def refuse_serialized(data: dict[str, Any]) -> None:
    if "serialized_named_tensors" in data:
        raise PickleMediaRefused(
            '"serialized_named_tensors" holds pickled (ForkingPickler) tensors, and pickles are never '
            f"loaded; send {SAFE_FORMATS}"
        )

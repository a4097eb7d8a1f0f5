"""Weights versions as SGLang and vLLM name them: free string labels, and per-token spans.

SGLang and vLLM name a weights version with a free string (`weight_version="step-1"`);
hotswap's version is an int that only grows. Both are kept: `ServerContext.version_labels`
maps an int version to the label a controller gave it (written by api/actions.py when an
update commits or a version is relabelled), and a version without one is labelled by its
number (`"1"`, `"2"`, ...). Spans on the wire are SGLang's and vLLM's `weight_versions`:
`[{"version": label, "start", "end"}]` over output token positions, end exclusive.
"""

from __future__ import annotations

from typing import Any

from hotswap.api.engine_loop import ServerContext

VLLM_PREFIX = "/vllm"  # where the vLLM-compatible routes live (routes_vllm.py says why)


def label(ctx: ServerContext, version: int) -> str:
    return ctx.version_labels.get(version, str(version))


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

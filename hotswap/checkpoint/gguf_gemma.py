"""What a Gemma 2 / Gemma 3 GGUF's config states beyond a Llama's, as HF's config fields.

llama.cpp's converter writes only part of a Gemma config into the metadata; the rest
llama.cpp hard-codes per architecture (`llama-model.cpp`), and those constants are
what the published checkpoints' HF configs hold. Each field is read from the file
where the converter writes it, else taken as llama.cpp takes it:
- `layer_types`: every 2nd (Gemma 2) / 6th (Gemma 3) layer is global, the others
  slide (`attention.sliding_window_pattern` when a file states it);
- `query_pre_attn_scalar`: hidden / heads for the 27B models (46 / 62 layers; HF's
  configs say 144 and 168), else head_dim (256 in every other published config);
- the softcaps: Gemma 2 files state both (50, 30); Gemma 3 has none;
- Gemma 3's local rope base: `rope.freq_base_swa`, else 10000; its global rope
  scaling (linear, 4B and up) applies to the global layers only, as in HF's config.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hotswap.checkpoint.gguf_header import decimal32
from hotswap.errors import ConfigError

_PERIOD = {"gemma2": 2, "gemma3": 6}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
_LOCAL_ROPE_BASE = 10000.0


def _layer_types(meta: Mapping[str, Any], arch: str, layers: int, where: Path) -> list[str]:
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer: true = sliding
        if len(pattern) != layers:
            raise ConfigError(
                f"{where}: {arch}.attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers"
            )
        return ["sliding_attention" if s else "full_attention" for s in pattern]
    period = int(pattern) if pattern is not None else _PERIOD[arch]
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]


def hf_config(
    meta: Mapping[str, Any],
    arch: str,
    layers: int,
    hidden_per_head: int,
    head_dim: int,
    rope: dict[str, Any],
    *,
    where: Path,
) -> dict[str, Any]:
    """The Gemma fields of the HF config (`rope` is the global layers' rope, as read for Llama)."""
    p = f"{arch}."
    if p + "attention.sliding_window" not in meta:
        raise ConfigError(f"{where}: GGUF metadata lacks {p + 'attention.sliding_window'!r}")

    def cap(key: str) -> float | None:
        value = meta.get(p + key)
        return None if value is None or float(value) == 0.0 else decimal32(value)

    cfg: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(meta[p + "attention.sliding_window"]),
        "layer_types": _layer_types(meta, arch, layers, where),
        "query_pre_attn_scalar": hidden_per_head if layers == _LAYERS_27B[arch] else head_dim,
        "attn_logit_softcapping": cap("attn_logit_softcapping"),
        "final_logit_softcapping": cap("final_logit_softcapping"),
    }
    scaling = meta.get(p + "rope.scaling.type", "none")
    if scaling not in ("none", ""):
        if arch != "gemma3" or scaling != "linear":
            raise ConfigError(f"{where}: rope scaling {scaling!r} is not supported for {arch}")
        rope = {**rope, "rope_type": "linear", "factor": decimal32(meta[p + "rope.scaling.factor"])}
    if arch == "gemma3":
        local = decimal32(meta.get(p + "rope.freq_base_swa", _LOCAL_ROPE_BASE))
        rope = {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    cfg["rope_parameters"] = rope
    return cfg

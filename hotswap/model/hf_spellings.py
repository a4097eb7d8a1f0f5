"""The names transformers writes a config.json field under, read into one: a config saved by any
transformers from 4.56 to 5.25 means to ModelConfig.from_hf what it means to transformers.

Provenance: transformers 4.56.2 and 5.25.0, `models/<family>/configuration_<family>.py` for llama,
mistral, mixtral, qwen2, qwen3, qwen3_moe, gemma2 and gemma3 (Gemma3TextConfig): each class's
`attribute_map` (the names transformers reads one field under) and what `save_pretrained` writes
(checked by saving each family with 5.12.1 and 5.25.0), and `configuration_utils.py` /
`modeling_rope_utils.py` (`convert_rope_params_to_dict`, `standardize_rope_params`) for rope.
Among these families' `attribute_map`s only Qwen3-MoE's and Mixtral's rename a field the parser
reads. Other families' names for the same fields (DeepSeek's `n_routed_experts`, `moe_num_experts`,
`num_experts_per_token`) are not read by transformers for these families, so not here either: a
Qwen3-MoE config with only `n_routed_experts` is refused as missing `num_experts`, where transformers
would silently build its default 128 experts."""

from __future__ import annotations

from typing import Any

from hotswap.errors import ConfigError

SLIDING, FULL = "sliding_attention", "full_attention"

# field (the name the parser reads) -> every name transformers writes it under. Two names present
# with different values are refused: transformers versions disagree on which one wins.
SPELLINGS: dict[str, tuple[str, ...]] = {
    # Qwen3MoeConfig 5.x: attribute_map {"num_experts": "num_local_experts"}, so it saves
    # `num_local_experts` (4.56 saved `num_experts`). MixtralConfig has always saved
    # `num_local_experts` (5.x maps `num_experts` to it as well).
    "num_experts": ("num_experts", "num_local_experts"),
    # 5.x saves `dtype`; 4.x saved `torch_dtype` (5.x still reads it).
    "dtype": ("dtype", "torch_dtype"),
}
# Rope, 4.x: top-level `rope_theta` and `rope_scaling` (whose kind was `type` before `rope_type`),
# and Gemma 3's `rope_local_base_freq` for its sliding layers. 5.x: one `rope_parameters` dict with
# `rope_theta` inside; Gemma 3 one per layer type, {full_attention: {...}, sliding_attention: {...}}
# (5.12 also leaves a flat `rope_type` / `rope_theta: null` beside them). The parser reads the 4.x
# names: `rope_theta`, `rope_scaling` (a dict with `rope_type`, only when not "default") and
# `rope_local_base_freq`.
ROPE_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "rope_local_base_freq")


def spelled(field: str) -> str:
    """How a message names `field`: with its other spellings, e.g. 'num_experts' (or 'num_local_experts')."""
    first, *others = SPELLINGS.get(field, (field,))
    return repr(first) + (f" (or {', '.join(map(repr, others))})" if others else "")


def standard(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with every field under the one name the parser reads (a new dict)."""
    out = {k: v for k, v in cfg.items() if k not in ROPE_KEYS}
    for field, names in SPELLINGS.items():
        for name in names:
            out.pop(name, None)
        present = [(n, cfg[n]) for n in names if cfg.get(n) is not None]
        if len({repr(v) for _, v in present}) > 1:
            sets = " and ".join(f"{n}={v!r}" for n, v in present)
            raise ConfigError(f"config.json sets {sets}: two spellings of {field!r} that disagree")
        if present:
            out[field] = present[0][1]
    return out | _standard_rope(cfg)


def _standard_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope fields under their 4.x names, from either form, with transformers 5's precedence:
    a legacy `rope_scaling` replaces `rope_parameters` (Gemma 3: updates its full layers' entry);
    a `rope_theta` inside them wins over the top-level one."""
    params = _object(cfg, "rope_parameters")
    nested = FULL in params or SLIDING in params
    full = _object(params, FULL, "rope_parameters.") if nested else params
    if cfg.get("rope_scaling") is not None:
        full = {**(full if nested else {}), **_object(cfg, "rope_scaling")}
    out: dict[str, Any] = {}
    theta = _first(full.get("rope_theta"), cfg.get("rope_theta"))
    if theta is not None:
        out["rope_theta"] = theta
    kind = full.get("rope_type", full.get("type"))
    if kind not in (None, "default"):
        out["rope_scaling"] = {
            **{k: v for k, v in full.items() if k not in ("type", "rope_theta")},
            "rope_type": kind,
        }
    local = _object(params, SLIDING, "rope_parameters.") if nested else {}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ConfigError(
            f"rope_parameters.{SLIDING}.rope_type={local.get('rope_type')!r} is not supported (only 'default')"
        )
    local_theta = _first(local.get("rope_theta"), cfg.get("rope_local_base_freq"))
    if local_theta is not None:
        out["rope_local_base_freq"] = local_theta
    return out


def _object(parent: dict[str, Any], key: str, where: str = "") -> dict[str, Any]:
    """parent[key], a JSON object ({} when unset)."""
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}{key} must be an object, got {value!r}")
    return dict(value)


def _first(*values):
    """The first value that is set (transformers writes an unset one as null)."""
    return next((v for v in values if v is not None), None)

"""HF `config.json` + `*.safetensors` (+ index) <-> the params pytree.

Which HF tensor holds which param, in which layout, is the spec table's
(`model/spec.py`: HF name, shape, transpose); this module applies it to files.
HF linear weights are 2-D `[out, in]`; params store `[in, out]` with the
attention heads split out, so linear weights are transposed (and attention's
split, a free reshape) on the way in and back on the way out. Tied-embedding
checkpoints carry no `lm_head.weight`; params always hold an untied `[D, V]`
head, made here as a copy of `embed.T`. Weight updates and the engine's first load
do the same conversion on the engine's devices (weights/hf_device.py). Either way the
tensors are checked first by the one validator (`model/validate.py`: names, shapes,
dtypes, tied head), whose errors name the HF tensor, because that is the name the user
sees in their checkpoint or payload; their values are checked for NaN/Inf where the
engine places them (`weights/finiteness.py`), once.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from hotswap.checkpoint import experts
from hotswap.checkpoint.safetensors_io import read_safetensors, write_safetensors
from hotswap.errors import CheckpointError, ConfigError, WeightsMismatch
from hotswap.model import validate
from hotswap.model.config import FULL, SLIDING, ModelConfig, RopeScaling
from hotswap.model.spec import EMBED, Params, ParamSpec, hf_specs, param_specs

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
_MODEL_TYPES = {"gemma3": "gemma3_text"}  # config.json model_type, where it is not the family name


def np_dtype(name: str | np.dtype) -> np.dtype:
    """'bfloat16' -> ml_dtypes' numpy dtype; numpy itself does not know the name."""
    return np.dtype(ml_dtypes.bfloat16) if str(name) == "bfloat16" else np.dtype(name)


def hf_tensor_names(cfg: ModelConfig) -> dict[str, str]:
    """HF name -> params path ("model.layers.3.mlp.up_proj.weight" -> "layers.3.w_up")."""
    return {name: spec.name for name, spec in hf_specs(cfg).items()}


def _convert(name: str, array: Any, spec: ParamSpec, target: np.dtype) -> np.ndarray:
    """One checked HF tensor -> a fresh C-contiguous params-layout copy (on the host)."""
    a = np.asarray(array)
    # A fresh copy: params must not alias a caller's buffer or a memmapped file.
    with np.errstate(over="ignore", invalid="ignore"):  # overflow shows up in the finiteness check
        return np.array(spec.from_hf(a), dtype=target, order="C", copy=True)


def empty_tree(cfg: ModelConfig) -> Params:
    return {"embed": None, "layers": [{} for _ in range(cfg.num_layers)], "final_norm": None, "lm_head": None}


def copy_tree(params: Params) -> Params:
    """New containers, same leaves: a partial update never mutates its base."""
    return {**params, "layers": [dict(layer) for layer in params["layers"]]}


def set_leaf(tree: Params, path: tuple[str | int, ...], value: Any) -> None:
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def get_leaf(tree: Params, path: tuple[str | int, ...]) -> Any:
    node = tree
    for key in path:
        node = node[key]
    return node


def params_from_hf(
    cfg: ModelConfig,
    tensors: Mapping[str, Any],
    *,
    dtype: str | None = None,
    partial_base: Params | None = None,
) -> Params:
    """HF-named `[out, in]` arrays -> a params tree of fresh numpy arrays.

    With `partial_base` (a full params tree) `tensors` may be any subset; the
    other leaves are taken from the base unchanged, which is how partial weight
    updates are staged. For tied models a new embedding also rebuilds `lm_head`.
    The dtype is `dtype`, else the base's dtype, else `cfg.dtype`.

    This is the host path (GGUF loading, checkpoint creation); the engine converts
    on its devices instead (`weights/hf_device.py`). Values are not checked for NaN/Inf
    here: the engine checks them where it places them, once (`weights/finiteness.py`).
    """
    if dtype is None and partial_base is not None:
        target = np.dtype(partial_base["embed"].dtype)
    else:
        target = np_dtype(dtype or cfg.dtype)
    tensors = experts.stack(cfg, tensors, partial=partial_base is not None)
    chosen = validate.hf_tensors(cfg, tensors, target, partial=partial_base is not None)
    params = empty_tree(cfg) if partial_base is None else copy_tree(partial_base)
    for name, spec in chosen.items():
        set_leaf(params, spec.path, _convert(name, tensors[name], spec, target))
    if cfg.tie_word_embeddings and EMBED in chosen:
        params["lm_head"] = np.ascontiguousarray(param_specs(cfg)["lm_head"].from_hf(params["embed"]))
    return params


def hf_from_params(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """The inverse of `params_from_hf`: HF names, `[out, in]`, no `lm_head.weight` when tied."""
    out = {}
    for name, spec in hf_specs(cfg).items():
        try:
            leaf = np.asarray(get_leaf(params, spec.path))
        except (KeyError, IndexError, TypeError) as e:
            raise WeightsMismatch(f"params has no leaf {spec.name} (for {name})") from e
        if tuple(leaf.shape) != spec.shape:
            raise WeightsMismatch(f"{spec.name}: expected {spec.shape}, got {tuple(leaf.shape)}")
        out[name] = np.ascontiguousarray(spec.to_hf(leaf))
    return experts.unstack(cfg, out)


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """A transformers-5-style config.json for `cfg` (rope settings under `rope_parameters`)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope.update(_rope_scaling_dict(cfg.rope_scaling))
    eos = list(cfg.eos_token_ids)
    hf: dict[str, Any] = {
        "architectures": [_ARCH_CLASSES[cfg.arch]],
        "model_type": _MODEL_TYPES.get(cfg.arch, cfg.arch),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "dtype": cfg.dtype,
    }
    if cfg.arch in ("mistral", "mixtral"):
        hf["sliding_window"] = cfg.sliding_window
    if cfg.arch in ("qwen2", "qwen3", "qwen3_moe"):
        hf["use_sliding_window"] = False
    if cfg.is_gemma:
        hf.update(
            hidden_act=cfg.hidden_act,
            hidden_activation=cfg.hidden_act,
            sliding_window=cfg.sliding_window,
            layer_types=None if cfg.layer_types is None else list(cfg.layer_types),
            attn_logit_softcapping=cfg.attn_logit_softcapping,
            final_logit_softcapping=cfg.final_logit_softcapping,
            query_pre_attn_scalar=_int_if_whole(cfg.query_pre_attn_scalar),
        )
    if cfg.rope_local_base_freq is not None:  # Gemma 3: one rope per layer type
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_base_freq}
        hf["rope_parameters"] = {FULL: rope, SLIDING: local}
    if cfg.arch == "qwen3_moe":
        hf.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
        )
    if cfg.arch == "mixtral":
        hf.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok)
    return hf


def _int_if_whole(x: float | None) -> float | int | None:
    """transformers 5's Gemma configs type `query_pre_attn_scalar` as int and refuse 256.0."""
    return int(x) if x is not None and float(x).is_integer() else x


def _rope_scaling_dict(rs: RopeScaling) -> dict[str, Any]:
    if rs.rope_type == "linear":
        return {"rope_type": "linear", "factor": rs.factor}
    fields = dataclasses.asdict(rs)
    fields.pop("rope_type")
    return {"rope_type": "llama3", **fields}


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The raw config.json dict (kept so a re-save loads in transformers unchanged)."""
    path = Path(model_dir) / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: not found (is {model_dir} an HF model directory?)") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _shard_path(model_dir: Path, index: Path, shard: Any) -> Path:
    # The index is untrusted input: a shard name must not escape the directory.
    if not isinstance(shard, str) or not shard or "/" in shard or "\\" in shard or shard in (".", ".."):
        raise CheckpointError(f"{index}: invalid shard file name {shard!r}")
    return model_dir / shard


def read_hf_tensors(model_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of `model.safetensors` or of the shards an index lists (memmapped views)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    single, index = model_dir / SINGLE_FILE, model_dir / INDEX_FILE
    if single.exists():
        return read_safetensors(single)
    if not index.exists():
        if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
            raise CheckpointError(
                f"{model_dir}: only safetensors checkpoints are loaded "
                "(pickle-based .bin/.pt files never are); "
                "convert with transformers' save_pretrained(safe_serialization=True)"
            )
        raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
    tensors: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        for name, array in read_safetensors(_shard_path(model_dir, index, shard)).items():
            if name in tensors:
                raise CheckpointError(f"{index}: tensor {name} appears in more than one shard")
            tensors[name] = array
    for name, shard in weight_map.items():
        if name not in tensors:
            raise CheckpointError(f"{index}: tensor {name} is mapped to {shard} but that file lacks it")
    return tensors


def load_hf_dir(model_dir: str | Path, *, dtype: str | None = None) -> tuple[ModelConfig, Params]:
    """Read an HF model directory into (ModelConfig, numpy params). `dtype` overrides config.json's."""
    cfg = ModelConfig.from_hf(read_hf_config(model_dir), dtype=dtype)
    return cfg, params_from_hf(cfg, read_hf_tensors(model_dir))


def save_hf_dir(
    config: ModelConfig | Mapping[str, Any],
    params: Params,
    out_dir: str | Path,
    *,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write config.json + safetensors (sharded with an index when `max_shard_bytes` is set).

    Pass the original config.json dict when there is one: its extra fields are
    what make the directory load in transformers exactly as before. The dtype
    field is rewritten to the params' dtype, so the round trip is bit-exact.
    Earlier weight files in `out_dir` are removed so no stale file can win.
    """
    if isinstance(config, ModelConfig):
        hf, cfg = hf_config_dict(config), config
    else:
        hf = dict(config)
        cfg = ModelConfig.from_hf(hf)
    tensors = hf_from_params(cfg, params)
    dt = tensors[EMBED].dtype.name
    if dt not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"params dtype {dt} cannot be saved as an HF checkpoint")
    hf["dtype"] = dt
    if "torch_dtype" in hf:
        hf["torch_dtype"] = dt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    if max_shard_bytes is None:
        write_safetensors(out / SINGLE_FILE, tensors)
    else:
        _write_shards(out, tensors, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return out


def _write_shards(out: Path, tensors: dict[str, np.ndarray], max_shard_bytes: int) -> None:
    """Greedy packing in checkpoint order; a tensor larger than the limit gets its own shard."""
    if max_shard_bytes <= 0:
        raise ConfigError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    groups: list[list[str]] = [[]]
    used = 0
    for name, array in tensors.items():
        if groups[-1] and used + array.nbytes > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += array.nbytes
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(out / fname, {n: tensors[n] for n in group})
        weight_map.update(dict.fromkeys(group, fname))
    total = sum(math.prod(a.shape) * a.dtype.itemsize for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

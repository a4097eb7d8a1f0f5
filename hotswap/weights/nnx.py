"""Flax NNX model state <-> hotswap params, for Tunix's Llama3, Qwen2 and Qwen3 (dense and MoE)
models.

The mapping is the spec table (`model/spec.py`): each row's `nnx_name` is the
parameter's path in the NNX model. Tunix models use hotswap's params layout
(`[in, out]`, attention heads split out: `q_proj.w` `[D, N, H]` is `wq`), so every
leaf is passed through as the same `jax.Array`, never copied or reshaped; only a
tied LM head is derived (the embedding's transpose, computed on its devices). A
state already on the engine's sharding is served from its own buffers.

    cfg = model_config(tunix_model)                       # hotswap ModelConfig
    params = params_from_state(nnx.state(tunix_model, nnx.Param), cfg)
    state = state_from_params(params, cfg, like=nnx.state(tunix_model, nnx.Param))

The config is what the Tunix model computes, which is not always what its config says:
Tunix's Llama3 and Qwen3 attention call their module's `apply_rope` without `rope_theta`,
so they rotate by its default base, 1e6, whatever `config.rope_theta` holds (a Llama 3
config holds 5e5). The engine rotates as the trainer's model does: a different base
changes every attention score, and the log-probs the trainer recomputes then differ
from the rollout's, the more as training sharpens attention.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from hotswap.errors import ConfigError, WeightsMismatch
from hotswap.model import validate
from hotswap.model.config import ModelConfig
from hotswap.model.spec import Params, ParamSpec, is_spec, param_specs

log = logging.getLogger(__name__)


class Family(NamedTuple):
    """How hotswap serves one Tunix model class."""

    arch: str  # hotswap's arch
    qkv_bias: bool
    qk_norm: bool
    tie_field: str  # the Tunix config field that ties the head
    rope_theta: float | None  # the RoPE base its attention applies; None: its config's rope_theta


# Tunix model class name -> Family. Llama3 and Qwen3 rotate by `apply_rope`'s default base.
FAMILIES = {
    "Llama3": Family("llama", False, False, "weight_tying", 1_000_000.0),
    "Qwen2": Family("qwen2", True, False, "use_tied_embedding", None),
    "Qwen3": Family("qwen3", False, True, "use_tied_embedding", 1_000_000.0),
}


def model_config(
    model: nnx.Module, *, max_position_embeddings: int = 4096, eos_token_ids: tuple[int, ...] = ()
) -> ModelConfig:
    """The hotswap ModelConfig of a Tunix Llama3 / Qwen2 / Qwen3 model (dtype from its params)."""
    family = FAMILIES.get(type(model).__name__)
    if family is None:
        raise ConfigError(
            f"{type(model).__module__}.{type(model).__name__} is not a supported Flax model; "
            f"supported: Tunix {', '.join(sorted(FAMILIES))}"
        )
    c = model.config
    moe = {}
    if getattr(c, "num_experts", None):
        if family.arch != "qwen3":
            raise ConfigError(
                f"{type(model).__name__} with num_experts={c.num_experts}: only Qwen3 MoE is served"
            )
        # Tunix's Qwen3 MoE: every layer sparse, experts of hidden_dim, top-k renormalised.
        moe = dict(
            arch="qwen3_moe",
            num_experts=int(c.num_experts),
            num_experts_per_tok=int(c.num_experts_per_tok),
            moe_intermediate_size=int(c.hidden_dim),
            norm_topk_prob=True,
        )
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    dtype = np.dtype(leaves[0].dtype).name if leaves else "float32"
    theta = float(c.rope_theta) if family.rope_theta is None else family.rope_theta
    if theta != float(c.rope_theta):
        log.warning(
            "Tunix %s applies RoPE base %g whatever its config's rope_theta (%g) says; "
            "hotswap serves what the model computes",
            type(model).__name__,
            theta,
            float(c.rope_theta),
        )
    fields = dict(
        arch=family.arch,
        vocab_size=c.vocab_size,
        hidden_size=c.embed_dim,
        intermediate_size=c.hidden_dim,
        num_layers=c.num_layers,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rope_theta=theta,
        rms_norm_eps=float(c.norm_eps),
        tie_word_embeddings=bool(getattr(c, family.tie_field)),
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        max_position_embeddings=max_position_embeddings,
        dtype=dtype,
        eos_token_ids=tuple(eos_token_ids),
    )
    return ModelConfig(**{**fields, **moe})


def _name(path) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)


def flat_variables(source: nnx.State | nnx.Module) -> dict[str, Any]:
    """ "layers.3.attn.q_proj.w" -> Variable for every variable of an NNX state or module.

    A LoRA adapter (`nnx.LoRAParam`) is refused: the engine serves plain weights, so merge
    the adapter into the base weights (and pass those) before an update.
    """
    state = nnx.state(source) if isinstance(source, nnx.Module) else source
    if not isinstance(state, nnx.State):
        raise WeightsMismatch(f"expected an nnx.State or nnx.Module, got {type(source).__name__}")
    flat = {_name(path): var for path, var in nnx.to_flat_state(state)}
    lora = sorted(n for n, v in flat.items() if isinstance(v, nnx.LoRAParam))
    if lora:
        raise WeightsMismatch(
            f"{lora[0]}: a LoRA parameter (nnx.LoRAParam); merge the adapter into the base weights "
            "and pass those (hotswap serves plain weights)"
        )
    return {n: v for n, v in flat.items() if isinstance(v, nnx.Param)}


def _value(var) -> jax.Array:
    return var.get_value() if hasattr(var, "get_value") else var.value


def params_from_state(
    source: nnx.State | nnx.Module, cfg: ModelConfig, abstract: Params | None = None
) -> Params:
    """An NNX state (or module) of `cfg`'s family -> hotswap params, by the spec table.

    Validated once (`model/validate.py`): a missing, unexpected or wrongly shaped
    parameter (and, given the engine's `abstract` params, a wrong dtype) raises
    WeightsMismatch naming the NNX parameter. Finiteness is the engine's placing step's.
    """
    flat = {n: _value(v) for n, v in flat_variables(source).items()}
    validate.nnx_variables(flat, cfg, abstract)
    specs = param_specs(cfg)

    def leaf(s: ParamSpec):
        if s.nnx_name is None:  # tied head: the spec row's transform of the embedding, on its devices
            return s.from_hf(flat[specs["embed"].nnx_name])
        return flat[s.nnx_name]

    return jax.tree.map(leaf, specs, is_leaf=is_spec)


def nnx_name(cfg: ModelConfig, params_name: str) -> str | None:
    """The NNX path of a params leaf ("layers.1.w_down" -> "layers.1.mlp.down_proj.kernel")."""
    for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec):
        if s.name == params_name:
            return s.nnx_name
    return None


def reshard(params: Params, abstract: Params) -> Params:
    """Move each `jax.Array` leaf not on its `abstract` sharding there by one jitted identity:
    a device-side reshard (collectives). `jax.device_put` between shardings of the same devices
    goes through the host on CPU, which Tunix's transfer guard refuses. Leaves already there,
    and non-jax leaves (validated and placed by the engine), are returned as they are."""
    flat, tree = jax.tree.flatten(params)
    targets = jax.tree.leaves(abstract)
    if len(targets) != len(flat):
        return params  # a structure mismatch: the engine's validation names it
    move = [
        i
        for i, (x, t) in enumerate(zip(flat, targets, strict=True))
        if isinstance(x, jax.Array)
        and t.sharding is not None
        and x.shape == t.shape
        and set(x.sharding.device_set) == set(t.sharding.device_set)
        and not x.sharding.is_equivalent_to(t.sharding, x.ndim)
    ]
    if move:
        moved = jax.jit(lambda xs: xs, out_shardings=[targets[i].sharding for i in move])(
            [flat[i] for i in move]
        )
        for i, x in zip(move, moved, strict=True):
            flat[i] = x
    return jax.tree.unflatten(tree, flat)


def state_from_params(params: Params, cfg: ModelConfig, like: nnx.State) -> nnx.State:
    """Hotswap params -> an NNX Param state shaped like `like` (the model's own state)."""
    specs = param_specs(cfg)
    by_name = {
        s.nnx_name: x
        for s, x in zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(params), strict=True)
        if s.nnx_name is not None
    }
    out = []
    for path, var in nnx.to_flat_state(like):
        out.append((path, var.replace(by_name[_name(path)])))
    return nnx.from_flat_state(out)

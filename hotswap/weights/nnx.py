"""Flax NNX model state <-> hotswap params, for Tunix's Llama3, Qwen2, Qwen3 (dense and MoE),
Gemma 2 and Gemma3 models.

The mapping is the spec table (`model/spec.py`): each row's `nnx_name` is the
parameter's path in the NNX model. Tunix's Llama3 / Qwen models use hotswap's params
layout (`[in, out]`, attention heads split out: `q_proj.w` `[D, N, H]` is `wq`), so every
leaf is passed through as the same `jax.Array`, never copied or reshaped; only a
tied LM head is derived (the embedding's transpose, computed on its devices). A
state already on the engine's sharding is served from its own buffers.

Tunix's Gemma 2 (`tunix.models.gemma.Gemma`) and Gemma3 store q, k and v as einsum weights
`[N, D, H]`, k and v stacked in one `[2, K, D, H]` leaf (q, k, v in one `[3, N, D, H]` when
N == K): those three are taken by index and transposed to `[D, N, H]` (`ParamSpec.from_nnx`),
a copy of each per update. The engine's attention contracts `[D, N, H]` with the heads split
out as tensor parallelism shards them (`model/spec.py`); `[N, D, H]` would put the heads
first and make every q/k/v matmul a batched one. q/k/v are (N + 2K) * D * H of a layer's
parameters; the embedding, the norms (`scale`, applied as 1 + scale, as here),
`attn_vec_einsum` `[N, H, D]` and the MLP kernels are passed through as they are. Their
RMSNorm eps is fixed at 1e-6, and the config is taken from what their modules compute
(Gemma3: every 6th layer global whatever its config says; Gemma 2: each layer's own
`attn_type`, RoPE base 1e4, queries scaled by head_dim ** -0.5).

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

import functools
import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hotswap.errors import ConfigError, WeightsMismatch
from hotswap.model.config import FULL, SLIDING, ModelConfig, RopeScaling
from hotswap.model.spec import Params, ParamSpec, is_spec, param_specs

HEAD = ("lm_head",)

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
    """The hotswap ModelConfig of a Tunix Llama3 / Qwen2 / Qwen3 / Gemma 2 / Gemma3 model
    (dtype from its params)."""
    name = type(model).__name__
    if name in GEMMAS:
        return _gemma_config(model, max_position_embeddings, tuple(eos_token_ids))
    family = FAMILIES.get(name)
    if family is None:
        raise ConfigError(
            f"{type(model).__module__}.{name} is not a supported Flax model; "
            f"supported: Tunix {', '.join(sorted([*FAMILIES, *GEMMAS]))}"
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


# Tunix's Gemma 2 and Gemma 3: RMSNorm eps fixed at 1e-6, GeGLU with jax's tanh gelu, a tied
# head; what differs is computed per class below (the spec table maps both: `model/spec.py`).
_GEMMA3_PERIOD = 6  # Gemma3: every 6th layer global (GEMMA3_ATTENTION_PATTERN)


def _gemma2_fields(model: nnx.Module) -> dict:
    """Tunix's `Gemma` (`tunix.models.gemma`), Gemma 2 only: each layer slides or not by its own
    `attn_type`; RoPE at `apply_rope`'s default base 1e4; queries scaled by head_dim ** -0.5;
    logits of both kinds soft-capped when its config sets a cap."""
    c = model.config
    if not (c.use_post_attn_norm and c.use_post_ffw_norm):
        raise ConfigError(
            "Tunix Gemma without post-attention / post-FFW norms (Gemma 1) is not supported: "
            "serve a Gemma 2 config (use_post_attn_norm and use_post_ffw_norm true)"
        )
    kinds = [layer.attn.attn_type.name for layer in model.layers]
    return dict(
        arch="gemma2",
        rope_theta=10_000.0,
        sliding_window=c.sliding_window_size if "LOCAL_SLIDING" in kinds else None,
        layer_types=tuple(SLIDING if k == "LOCAL_SLIDING" else FULL for k in kinds),
        attn_logit_softcapping=None if c.attn_logits_soft_cap is None else float(c.attn_logits_soft_cap),
        final_logit_softcapping=None if c.final_logit_softcap is None else float(c.final_logit_softcap),
        query_pre_attn_scalar=float(c.head_dim),
        qk_norm=False,
    )


def _gemma3_fields(model: nnx.Module) -> dict:
    """Tunix's `Gemma3`: q/k norms, local / global RoPE bases, no softcaps."""
    c = model.config
    if getattr(model, "vision_encoder", None) is not None:
        raise ConfigError("Tunix Gemma3 with a vision encoder is not supported: serve the text model")
    if float(c.local_scale_factor) != 1.0:
        raise ConfigError(f"Tunix Gemma3 local_scale_factor={c.local_scale_factor}: only 1.0 is supported")
    scaling = None
    if float(c.global_scale_factor) != 1.0:  # positions divided by it on global layers: HF's linear scaling
        scaling = RopeScaling(factor=float(c.global_scale_factor), rope_type="linear")
    by_head = c.query_pre_attn_norm.name == "BY_ONE_OVER_SQRT_HEAD_DIM"
    return dict(
        arch="gemma3",
        rope_theta=float(c.global_base_frequency),
        rope_scaling=scaling,
        rope_local_base_freq=float(c.local_base_frequency),
        sliding_window=c.sliding_window_size,
        layer_types=tuple(FULL if (i + 1) % _GEMMA3_PERIOD == 0 else SLIDING for i in range(c.num_layers)),
        query_pre_attn_scalar=float(c.head_dim if by_head else c.embed_dim // c.num_heads),
        qk_norm=True,
    )


# Tunix model class name -> what its Gemma computes that the other does not.
GEMMAS = {"Gemma": _gemma2_fields, "Gemma3": _gemma3_fields}


def _gemma_config(
    model: nnx.Module, max_position_embeddings: int, eos_token_ids: tuple[int, ...]
) -> ModelConfig:
    c = model.config
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return ModelConfig(
        vocab_size=c.num_embed,
        hidden_size=c.embed_dim,
        intermediate_size=c.hidden_dim,
        num_layers=len(model.layers),
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qkv_bias=False,
        max_position_embeddings=max_position_embeddings,
        dtype=np.dtype(leaves[0].dtype).name,
        eos_token_ids=eos_token_ids,
        hidden_act="gelu_pytorch_tanh",
        **GEMMAS[type(model).__name__](model),
    )


# Jitted with the index and permutation static, so that no index crosses from the host (Tunix
# syncs under jax.transfer_guard("disallow")); one compile per (index, perm), not per layer.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _from_nnx(index: int | None, perm: tuple[int, ...] | None, leaf: jax.Array) -> jax.Array:
    return ParamSpec((), (), (), None, nnx_index=index, nnx_perm=perm).from_nnx(leaf)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("stack",))
def _to_nnx(perm: tuple[int, ...] | None, parts: list[jax.Array], stack: bool = False) -> jax.Array:
    row = ParamSpec((), (), (), None, nnx_perm=perm)
    out = [row.to_nnx_part(x) for x in parts]
    return jnp.stack(out) if stack else out[0]


def _name(path) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)


def flat_variables(source: nnx.State | nnx.Module) -> dict[str, Any]:
    """ "layers.3.attn.q_proj.w" -> Variable for every variable of an NNX state or module.

    A state mixing base weights and LoRA factors (`nnx.LoRAParam`) is refused: an update is
    either the base (plain Params) or an adapter (LoRAParams alone, `weights/lora_forms.py`).
    """
    state = nnx.state(source) if isinstance(source, nnx.Module) else source
    if not isinstance(state, nnx.State):
        raise WeightsMismatch(f"expected an nnx.State or nnx.Module, got {type(source).__name__}")
    flat = {_name(path): var for path, var in nnx.to_flat_state(state)}
    lora = sorted(n for n, v in flat.items() if isinstance(v, nnx.LoRAParam))
    if lora:
        raise WeightsMismatch(
            f"{lora[0]}: a LoRA parameter (nnx.LoRAParam) beside base weights; send the adapter "
            "alone (the LoRAParam state: merged into the kept base) or the base weights alone"
        )
    return {n: v for n, v in flat.items() if isinstance(v, nnx.Param)}


def base_state(model: nnx.Module) -> nnx.State:
    """A module's base weights: its Params but the LoRA factors (`nnx.LoRAParam`, a Param subclass)."""
    return nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))


def lora_state(model: nnx.Module) -> nnx.State:
    return nnx.state(model, nnx.LoRAParam)


def qwix_lora_alpha(model: nnx.Module) -> float:
    """The alpha of the qwix LoRA rules applied to `model` (`qwix.apply_lora_to_model` keeps its
    provider in the wrapped `__call__`), so an adapter's scale alpha / r is the trainer's."""
    seen, todo, alphas = set(), [type(model).__call__], set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        for rule in getattr(obj, "_rules", None) or ():  # a qwix provider's rules
            if hasattr(rule, "alpha") and hasattr(rule, "rank"):
                alphas.add(float(rule.alpha))
        if isinstance(obj, functools.partial):
            todo += [obj.func, *obj.args, *obj.keywords.values()]
        if hasattr(obj, "__self__"):  # a bound method of a provider
            todo.append(obj.__self__)
        todo += [c.cell_contents for c in getattr(obj, "__closure__", None) or () if _filled(c)]
        if hasattr(obj, "__wrapped__"):
            todo.append(obj.__wrapped__)
    if len(alphas) != 1:
        raise ConfigError(
            f"{type(model).__name__} carries LoRA parameters but its qwix rules give "
            f"{'no' if not alphas else 'several'} alpha ({sorted(alphas)}); pass lora_alpha"
        )
    return alphas.pop()


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


def _value(var) -> jax.Array:
    return var.get_value() if hasattr(var, "get_value") else var.value


def flat_values(source: nnx.State | nnx.Module, cfg: ModelConfig) -> dict[str, Any]:
    """NNX path -> array of every parameter of an NNX state (or module) of `cfg`'s family, as
    the ingest pipeline reads it (`readers.py`); checked by NNX names in `plan.py`."""
    unmapped = [
        s.name
        for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec)
        if s.nnx_name is None and s.path != HEAD
    ]
    if unmapped:
        raise ConfigError(f"{cfg.arch}: no Tunix NNX layout is known for params {unmapped[0]}")
    return {n: _value(v) for n, v in flat_variables(source).items()}


def params_from_flat(flat: Mapping[str, Any], cfg: ModelConfig) -> Params:
    """Checked NNX variables (`flat_values`) -> hotswap params, by the spec table: the trainer's
    own arrays, except the Gemmas' q/k/v (sliced and transposed, a copy each) and a tied head."""
    specs = param_specs(cfg)

    def leaf(s: ParamSpec):
        if s.nnx_name is None:  # tied head: the spec row's transform of the embedding, on its devices
            return s.from_hf(flat[specs["embed"].nnx_name])
        if s.nnx_copies:  # the Gemmas' q/k/v: sliced and transposed on the leaf's devices (a copy)
            return _from_nnx(s.nnx_index, s.nnx_perm, flat[s.nnx_name])
        return flat[s.nnx_name]

    return jax.tree.map(leaf, specs, is_leaf=is_spec)


def params_from_state(source: nnx.State | nnx.Module, cfg: ModelConfig) -> Params:
    """An NNX state (or module) of `cfg`'s family -> hotswap params, unchecked (a tool's view;
    an update checks it by NNX names first: `LLM.update_weights(state)`)."""
    return params_from_flat(flat_values(source, cfg), cfg)


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
    by_name: dict[str, Any] = {}
    stacked: dict[str, dict[int, Any]] = {}
    for s, x in zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(params), strict=True):
        if s.nnx_name is None:
            continue
        if s.nnx_index is None:
            by_name[s.nnx_name] = _to_nnx(s.nnx_perm, [x]) if s.nnx_copies else x
        else:  # the Gemmas' k/v (or q/k/v): one leaf stacking the rows
            stacked.setdefault(s.nnx_name, {})[s.nnx_index] = (s, x)
    for name, parts in stacked.items():
        rows = [parts[k] for k in sorted(parts)]
        by_name[name] = _to_nnx(rows[0][0].nnx_perm, [x for _, x in rows], stack=True)
    out = []
    for path, var in nnx.to_flat_state(like):
        out.append((path, var.replace(by_name[_name(path)])))
    return nnx.from_flat_state(out)

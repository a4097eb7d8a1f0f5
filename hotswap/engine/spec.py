"""The parameter spec table: for every parameter its shape, logical axes, HF name and transform.

One row (`ParamSpec`) per params leaf, in the style of jax-llm-examples' `ArrayInfo`.
Everything that needs to know a parameter reads it here: the params tree and its
abstract (`params.py`), the shardings (`sharding.py`, through the logical axes and
`sharding.RULES`), the HF loader and saver (`checkpoint/hf.py`), the device-side HF
conversion of an update (`hf_device.py`), and the validation of every update
(through `params.abstract_params`). `checkpoint/` imports this module and nothing
else from `engine/`: the table is what ties a file's tensor names to the params.

Shapes are the params layout (`params.py`): matrices `[in, out]`, used as `x @ W`.
HF stores linear weights `[out, in]`, so those rows have `transpose=True`. The LM
head is always its own `[D, V]` leaf; a tied-embedding checkpoint has no HF tensor
for it (`hf_name=None`): it is derived from the embedding.

`nnx_name` / `nnx_shape` name the same parameter in a Tunix Flax NNX model (Llama3,
Qwen2, Qwen3: `integrations/flax.py`). Those models are already `[in, out]`; only the
attention projections keep heads as their own axis (`q_proj.w` `[D, N, H]`, `o_proj.w`
`[N, H, D]`), so every row maps by a reshape, never a transpose.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from hotswap.config import ModelConfig

Params = dict[str, Any]  # nested dict of jax/numpy arrays, layout in params.py

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: where it sits in params, its shape there, its axes and its HF tensor."""

    path: tuple[str | int, ...]  # ("layers", 3, "wq")
    shape: tuple[int, ...]  # params layout: [in, out] for linear weights
    axes: tuple[str, ...]  # one logical axis per dim; sharding.RULES maps them to mesh axes
    hf_name: str | None  # None: not stored in HF checkpoints (a tied head)
    transpose: bool = False  # HF stores it [out, in]
    nnx_name: str | None = None  # "layers.3.attn.q_proj.w" in a Tunix NNX model; None: tied head
    nnx_shape: tuple[int, ...] | None = None  # its shape there when not `shape` (heads split out)

    @property
    def name(self) -> str:
        """The params name used in errors: "layers.3.wq"."""
        return ".".join(str(p) for p in self.path)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape)) if self.transpose else self.shape


def is_spec(x: Any) -> bool:
    """`is_leaf` for `jax.tree.map` over a tree of ParamSpec."""
    return isinstance(x, ParamSpec)


def layer_specs(cfg: ModelConfig, i: int) -> dict[str, ParamSpec]:
    """The rows of decoder layer `i`, in checkpoint order."""
    d, f, q, kv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.head_dim

    nh, nkv = cfg.num_heads, cfg.num_kv_heads

    def row(
        key: str,
        shape: tuple[int, ...],
        axes: tuple[str, ...],
        hf: str,
        transpose: bool = False,
        nnx: str = "",
        nnx_shape: tuple[int, ...] | None = None,
    ):
        hf_name, nnx_name = f"model.layers.{i}.{hf}", f"layers.{i}.{nnx}"
        return ParamSpec(("layers", i, key), shape, axes, hf_name, transpose, nnx_name, nnx_shape)

    rows = {
        "attn_norm": row("attn_norm", (d,), ("embed",), "input_layernorm.weight", nnx="input_layernorm.w"),
        # q/k/v split by output column (heads), o by input row: one all-reduce after attention.
        "wq": row(
            "wq", (d, q), ("embed", "heads"), "self_attn.q_proj.weight", True, "attn.q_proj.w", (d, nh, hd)
        ),
        "wk": row(
            "wk",
            (d, kv),
            ("embed", "kv_heads"),
            "self_attn.k_proj.weight",
            True,
            "attn.k_proj.w",
            (d, nkv, hd),
        ),
        "wv": row(
            "wv",
            (d, kv),
            ("embed", "kv_heads"),
            "self_attn.v_proj.weight",
            True,
            "attn.v_proj.w",
            (d, nkv, hd),
        ),
        "wo": row(
            "wo", (q, d), ("heads", "embed"), "self_attn.o_proj.weight", True, "attn.o_proj.w", (nh, hd, d)
        ),
        "mlp_norm": row(
            "mlp_norm", (d,), ("embed",), "post_attention_layernorm.weight", nnx="post_attention_layernorm.w"
        ),
        # gate/up split by output column (mlp), down by input row: one all-reduce after the MLP.
        "w_gate": row(
            "w_gate", (d, f), ("embed", "mlp"), "mlp.gate_proj.weight", True, "mlp.gate_proj.kernel"
        ),
        "w_up": row("w_up", (d, f), ("embed", "mlp"), "mlp.up_proj.weight", True, "mlp.up_proj.kernel"),
        "w_down": row(
            "w_down", (f, d), ("mlp", "embed"), "mlp.down_proj.weight", True, "mlp.down_proj.kernel"
        ),
    }
    if cfg.qkv_bias:  # qwen2
        rows["bq"] = row("bq", (q,), ("heads",), "self_attn.q_proj.bias", nnx="attn.q_bias")
        rows["bk"] = row("bk", (kv,), ("kv_heads",), "self_attn.k_proj.bias", nnx="attn.k_bias")
        rows["bv"] = row("bv", (kv,), ("kv_heads",), "self_attn.v_proj.bias", nnx="attn.v_bias")
    if cfg.qk_norm:  # qwen3
        rows["q_norm"] = row("q_norm", (hd,), ("head_dim",), "self_attn.q_norm.weight", nnx="attn.q_norm.w")
        rows["k_norm"] = row("k_norm", (hd,), ("head_dim",), "self_attn.k_norm.weight", nnx="attn.k_norm.w")
    return rows


def param_specs(cfg: ModelConfig) -> Params:
    """The spec table as a params-shaped tree of ParamSpec leaves."""
    v, d = cfg.vocab_size, cfg.hidden_size
    return {
        "embed": ParamSpec(
            ("embed",), (v, d), ("vocab", "embed"), EMBED, nnx_name="embedder.input_embedding"
        ),
        "layers": [layer_specs(cfg, i) for i in range(cfg.num_layers)],
        "final_norm": ParamSpec(
            ("final_norm",), (d,), ("embed",), "model.norm.weight", nnx_name="final_norm.w"
        ),
        "lm_head": ParamSpec(
            ("lm_head",),
            (d, v),
            ("embed", "vocab"),
            None if cfg.tie_word_embeddings else LM_HEAD,
            True,
            nnx_name=None if cfg.tie_word_embeddings else "lm_head.w",
        ),
    }


def hf_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """HF tensor name -> row, for every tensor an HF checkpoint holds, in checkpoint order."""
    tree = param_specs(cfg)
    rows = [tree["embed"], *(s for layer in tree["layers"] for s in layer.values())]
    rows += [tree["final_norm"], tree["lm_head"]]
    return {s.hf_name: s for s in rows if s.hf_name is not None}


def path_name(path) -> str:
    """A jax key path -> the params name ("layers.3.wq"), as `ParamSpec.name` spells it."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        else:
            parts.append(str(k))
    return ".".join(parts)

"""The parameter spec table: for every parameter its shape, logical axes, HF name and transform.

One row (`ParamSpec`) per params leaf, in the style of jax-llm-examples' `ArrayInfo`.
Everything that needs to know a parameter reads it here: the params tree and its
abstract (`params.py`), the shardings (`sharding.py`, through the logical axes and
`sharding.RULES`), the HF loader and saver (`checkpoint/hf.py`), the device-side HF
conversion of an update (`hf_device.py`), and the validation of every update
(`validate.py`). `checkpoint/` reads the model through this table and never imports
`engine/`: the table is what ties a file's tensor names to the params.

Shapes are the params layout (`params.py`): matrices `[in, out]`, used as `x @ W`,
with the attention projections' heads as their own axes (`wq` `[D, Hq, hd]`, `wo`
`[Hq, hd, D]`): the model contracts them as they are (`forward.py`), and the heads axis
is what tensor parallelism splits. HF stores linear weights as 2-D `[out, in]`
matrices: `transpose=True` rows are transposed, and a row with `matrix` set is that
`[in, out]` matrix split into `shape` by a row-major reshape (`from_hf` / `to_hf`,
the one statement of the transform). The LM head is always its own `[D, V]` leaf; a
tied-embedding checkpoint has no HF tensor for it (`hf_name=None`): it is derived
from the embedding by its own row's transform (`from_hf` of the `[V, D]` embedding, its
transpose), wherever it is made (host, device, NNX).

A sparse layer (`model/moe.py`) holds its router `[D, E]` and its experts stacked, one leaf
per projection: gate/up `[E, D, F]`, down `[E, F, D]`, on an `expert` axis. HF files hold one
`[out, in]` tensor per expert (`hf_expert`, the name with `{}` for the expert): they are stacked
into the row's `hf_name` (`[E, out, in]`) where a file's tensors enter the table
(`checkpoint/experts.py`) and split again on save, so every other step sees one tensor per
row. A row's `transpose` swaps its last two axes: the whole matrix of a 2-D row, each expert's
of a stacked one.

`nnx_name` names the same parameter in a Tunix Flax NNX model (Llama3, Qwen2, Qwen3,
Gemma 2, Gemma3: `weights/nnx.py`). Llama3 and the Qwens are `[in, out]` with heads split out
exactly as here (`q_proj.w` `[D, N, H]`, `o_proj.w` `[N, H, D]`, `q_bias` `[N*H]`), so
every row maps leaf to leaf with the same shape: a state already on the engine's
sharding is served from its own buffers. The Gemmas' q/k/v are einsum weights `[N, D, H]`,
k and v stacked in one leaf: those rows set `nnx_index` / `nnx_perm` (a copy).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from hotswap.model.config import ModelConfig

Params = dict[str, Any]  # nested dict of jax/numpy arrays, layout in params.py

EMBED = "model.embed_tokens.weight"
# The layer rows a LoRA adapter may target (PEFT's q/k/v/o_proj, gate/up/down_proj).
ADAPTABLE = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
LM_HEAD = "lm_head.weight"
QUANTIZABLE = (*ADAPTABLE, "lm_head")  # the rows `ParamSpec.quantizable` names


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: where it sits in params, its shape there, its axes and its HF tensor."""

    path: tuple[str | int, ...]  # ("layers", 3, "wq")
    shape: tuple[int, ...]  # params layout: [in, out] for linear weights, heads split out
    axes: tuple[str, ...]  # one logical axis per dim; sharding.RULES maps them to mesh axes
    hf_name: str | None  # None: not stored in HF checkpoints (a tied head)
    transpose: bool = False  # HF stores the [in, out] matrix [out, in]
    matrix: tuple[int, int] | None = None  # the [in, out] matrix `shape` splits ([D, Hq*hd])
    nnx_name: str | None = None  # "layers.3.attn.q_proj.w" in a Tunix NNX model; None: none there
    # Where the NNX leaf is not this row's layout (Tunix's Gemma 3 einsums): the row is
    # `leaf[nnx_index]` (k and v stacked in one `[2, K, D, H]` leaf), then `nnx_perm` of it.
    nnx_index: int | None = None
    nnx_perm: tuple[int, ...] | None = None
    adaptable: bool = False  # a LoRA adapter may target it (`lora_shapes`, `lora_names`; model/lora.py)
    hf_expert: str | None = None  # stacked experts: each expert's HF name, "{}" for its index

    @property
    def name(self) -> str:
        """The params name used in errors: "layers.3.wq"."""
        return ".".join(str(p) for p in self.path)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        m = self.matrix or self.shape
        return (*m[:-2], m[-1], m[-2]) if self.transpose else m

    @property
    def n_in(self) -> int:
        """How many leading dims of `shape` are the matmul's inputs (wo [Hq, hd, D]: 2)."""
        rows, dims, prod = (self.matrix or self.shape)[0], 0, 1
        while prod < rows:
            prod *= self.shape[dims]
            dims += 1
        return max(dims, 1)

    @property
    def quantizable(self) -> bool:
        """Served quantized under a `quantization` scheme (`weights/quantize.py`): the layer
        matmuls and the LM head, as vLLM's and llama.cpp's weight-only schemes quantize; the
        embedding, norms, biases, router and the stacked experts stay dense."""
        return self.path[-1] in QUANTIZABLE and "expert" not in self.axes

    @property
    def layout(self) -> ParamSpec:
        """This row reduced to its HF transform: equal for every row that converts alike (a
        cache key for one conversion per shape, not per layer)."""
        return ParamSpec((), self.shape, (), None, self.transpose, self.matrix)

    def from_hf(self, a):
        """HF-layout array (numpy or jax) -> params layout: transpose, then split the heads.
        On numpy both are views; under jit the split is a free reshape of the result."""
        m = a.swapaxes(-1, -2) if self.transpose else a
        return m.reshape(self.shape) if self.matrix is not None else m

    def to_hf(self, x):
        """Params-layout array -> HF layout (views on numpy): merge the heads, then transpose."""
        m = x.reshape(self.matrix) if self.matrix is not None else x
        return m.swapaxes(-1, -2) if self.transpose else m

    @property
    def nnx_copies(self) -> bool:
        """The NNX leaf is not this row as it is: taking it copies (a slice or a transpose)."""
        return self.nnx_index is not None or self.nnx_perm is not None

    @property
    def nnx_part_shape(self) -> tuple[int, ...]:
        """This row's part of its NNX leaf (the leaf itself unless `nnx_index` is set)."""
        if self.nnx_perm is None:
            return self.shape
        inverse = sorted(range(len(self.nnx_perm)), key=self.nnx_perm.__getitem__)
        return tuple(self.shape[inverse[k]] for k in range(len(self.shape)))

    def from_nnx(self, leaf):
        """The NNX leaf (jax or numpy) -> this row's params layout."""
        a = leaf[self.nnx_index] if self.nnx_index is not None else leaf
        return a.transpose(self.nnx_perm) if self.nnx_perm is not None else a

    def to_nnx_part(self, x):
        """Params layout -> this row's part of its NNX leaf (`from_nnx`'s inverse, before stacking)."""
        if self.nnx_perm is None:
            return x
        return x.transpose(sorted(range(len(self.nnx_perm)), key=self.nnx_perm.__getitem__))

    def lora_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A LoRA pair's shapes in the params layout, as qwix makes them on Tunix's models: A
        `[*in, r]`, B `[r, *out]`, so that A·B reshaped is `shape` (wq: A [D, r], B [r, Hq, hd];
        wo: A [Hq, hd, r], B [r, D]). The `[in, out]` matrix's first dim is the leading dims'."""
        rows, n_in = (self.matrix or self.shape)[0], 0
        prod = 1
        while prod < rows:
            prod *= self.shape[n_in]
            n_in += 1
        return (*self.shape[: max(n_in, 1)], rank), (rank, *self.shape[max(n_in, 1) :])

    def lora_names(self, form: str) -> tuple[str, str]:
        """The (A, B) tensor names of a LoRA pair on this row, as each source names them:
        "peft" (`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`, PEFT's
        `[r, in]` / `[out, r]`), "nnx" (qwix on Tunix: `layers.3.attn.q_proj.w_lora_a`), "params"
        (`layers.3.wq.lora_a`, the shapes of `lora_shapes`)."""
        if form == "peft":
            module = f"base_model.model.{self.hf_name.removesuffix('.weight')}"
            return f"{module}.lora_A.weight", f"{module}.lora_B.weight"
        base = self.nnx_name if form == "nnx" else self.name
        sep = "_" if form == "nnx" else "."
        return f"{base}{sep}lora_a", f"{base}{sep}lora_b"

    @property
    def module(self) -> str:
        """The HF module name a PEFT `target_modules` entry names ("q_proj", "down_proj")."""
        return self.hf_name.split(".")[-2] if self.hf_name else ""

    def hf_dims(self) -> tuple[tuple[int, ...], ...]:
        """For each HF dim, the params dims it merges, major first: wq [D, Hq, hd] from HF
        [Hq*hd, D] -> ((1, 2), (0,))."""
        groups, dim = [], 0
        for size in self.matrix or self.shape:
            group, prod = [], 1
            while dim < len(self.shape) and (prod < size or not group):
                prod *= self.shape[dim]
                group.append(dim)
                dim += 1
            groups.append(tuple(group))
        return (*groups[:-2], groups[-1], groups[-2]) if self.transpose else tuple(groups)


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
        nnx: str | None = "",
        matrix: tuple[int, int] | None = None,
    ):
        hf_name, nnx_name = f"model.layers.{i}.{hf}", None if nnx is None else f"layers.{i}.{nnx}"
        return ParamSpec(("layers", i, key), shape, axes, hf_name, transpose, matrix, nnx_name)

    def attn(key: str, heads: int, axis: str, hf: str, nnx: str) -> ParamSpec:
        # q/k/v: [D, H, hd], split by head (output column); o: [Hq, hd, D], by head (input row).
        if key == "wo":
            return row(key, (heads, hd, d), (axis, "head_dim", "embed"), hf, True, nnx, (heads * hd, d))
        return row(key, (d, heads, hd), ("embed", axis, "head_dim"), hf, True, nnx, (d, heads * hd))

    rows = {
        "attn_norm": row("attn_norm", (d,), ("embed",), "input_layernorm.weight", nnx="input_layernorm.w"),
        # q/k/v split by heads, o by its input heads: one all-reduce after attention.
        "wq": attn("wq", nh, "heads", "self_attn.q_proj.weight", "attn.q_proj.w"),
        "wk": attn("wk", nkv, "kv_heads", "self_attn.k_proj.weight", "attn.k_proj.w"),
        "wv": attn("wv", nkv, "kv_heads", "self_attn.v_proj.weight", "attn.v_proj.w"),
        "wo": attn("wo", nh, "heads", "self_attn.o_proj.weight", "attn.o_proj.w"),
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
    if cfg.is_moe_layer(i):
        for key in ("w_gate", "w_up", "w_down"):
            del rows[key]
        rows.update(expert_specs(cfg, i))
    for key in ADAPTABLE:  # the rows a LoRA adapter may target
        if key in rows:
            rows[key] = dataclasses.replace(rows[key], adaptable=True)
    if cfg.is_gemma:
        # Gemma norms after attention and after the MLP too; HF's `post_attention_layernorm` is
        # the post-attention norm there (Llama's pre-MLP norm), `pre_feedforward_layernorm` the
        # pre-MLP one. (1 + w) scaling, as the model applies it (`gemma.py`).
        rows["mlp_norm"] = row("mlp_norm", (d,), ("embed",), "pre_feedforward_layernorm.weight", nnx=None)
        rows["post_attn_norm"] = row(
            "post_attn_norm", (d,), ("embed",), "post_attention_layernorm.weight", nnx=None
        )
        rows["post_mlp_norm"] = row(
            "post_mlp_norm", (d,), ("embed",), "post_feedforward_layernorm.weight", nnx=None
        )
    if cfg.qk_norm:  # qwen3, gemma3
        rows["q_norm"] = row("q_norm", (hd,), ("head_dim",), "self_attn.q_norm.weight", nnx="attn.q_norm.w")
        rows["k_norm"] = row("k_norm", (hd,), ("head_dim",), "self_attn.k_norm.weight", nnx="attn.k_norm.w")
    if cfg.is_gemma:
        rows = {k: _tunix_gemma(r, i, nh == nkv, cfg.arch) for k, r in rows.items()}
    if cfg.qkv_bias:  # qwen2; flat [H*hd] as HF and Tunix store them (the model splits them)
        rows["bq"] = row("bq", (q,), ("heads",), "self_attn.q_proj.bias", nnx="attn.q_bias")
        rows["bk"] = row("bk", (kv,), ("kv_heads",), "self_attn.k_proj.bias", nnx="attn.k_bias")
        rows["bv"] = row("bv", (kv,), ("kv_heads",), "self_attn.v_proj.bias", nnx="attn.v_bias")
    return rows


# Tunix's Gemma 2 (`tunix.models.gemma`) and Gemma 3 (`tunix.models.gemma3`) share their
# layer's layout: norms are `scale` (applied as 1 + scale, as here), q/k/v are einsum weights
# `[N, D, H]` (transposed to `[D, N, H]` here: a copy), k and v stacked in one `[2, K, D, H]`
# leaf, or q, k and v in one `[3, N, D, H]` when N == K; the output projection `[N, H, D]` and
# the MLP kernels `[in, out]` are this layout as they are. They differ in one name, the
# post-attention norm's, and Gemma 2 has no q/k norms (its config has no `qk_norm`).
_NDH = (1, 0, 2)
_TUNIX_GEMMA = {
    "attn_norm": ("pre_attention_norm.scale", None),
    "post_attn_norm": ("post_attention_norm.scale", None),
    "mlp_norm": ("pre_ffw_norm.scale", None),
    "post_mlp_norm": ("post_ffw_norm.scale", None),
    "q_norm": ("attn._query_norm.scale", None),
    "k_norm": ("attn._key_norm.scale", None),
    "wo": ("attn.attn_vec_einsum.w", None),
    "wq": ("attn.q_einsum.w", None),
    "wk": ("attn.kv_einsum.w", 0),
    "wv": ("attn.kv_einsum.w", 1),
}
_TUNIX_GEMMA_FUSED = {
    "wq": ("attn.qkv_einsum.w", 0),
    "wk": ("attn.qkv_einsum.w", 1),
    "wv": ("attn.qkv_einsum.w", 2),
}
_TUNIX_GEMMA_ARCH = {"gemma2": {"post_attn_norm": ("post_attn_norm.scale", None)}, "gemma3": {}}


def _tunix_gemma(r: ParamSpec, i: int, fused: bool, arch: str) -> ParamSpec:
    key = r.path[-1]
    table = {**_TUNIX_GEMMA, **(_TUNIX_GEMMA_FUSED if fused else {}), **_TUNIX_GEMMA_ARCH[arch]}
    if key not in table:  # the MLP kernels: named as for Llama ("layers.3.mlp.up_proj.kernel")
        return r
    name, index = table[key]
    perm = _NDH if key in ("wq", "wk", "wv") else None
    return dataclasses.replace(r, nnx_name=f"layers.{i}.{name}", nnx_index=index, nnx_perm=perm)


def nnx_leaf_shapes(rows: list[ParamSpec]) -> dict[str, tuple[int, ...]]:
    """NNX name -> the shape of its leaf, from the rows that read it (stacked parts counted)."""
    shapes: dict[str, tuple[int, ...]] = {}
    counts: dict[str, int] = {}
    for s in rows:
        if s.nnx_name is None:
            continue
        shapes[s.nnx_name] = s.nnx_part_shape
        if s.nnx_index is not None:
            counts[s.nnx_name] = max(counts.get(s.nnx_name, 0), s.nnx_index + 1)
    return {n: (counts[n], *shape) if n in counts else shape for n, shape in shapes.items()}


# Where a family keeps its sparse MLP in HF files: (router, experts' gate, up, down), under
# `model.layers.{i}.`, "{}" for the expert.
_MOE_HF = {
    "qwen3_moe": (
        "mlp.gate",
        "mlp.experts.{}.gate_proj",
        "mlp.experts.{}.up_proj",
        "mlp.experts.{}.down_proj",
    ),
    "mixtral": (
        "block_sparse_moe.gate",
        "block_sparse_moe.experts.{}.w1",
        "block_sparse_moe.experts.{}.w3",
        "block_sparse_moe.experts.{}.w2",
    ),
}


def expert_specs(cfg: ModelConfig, i: int) -> dict[str, ParamSpec]:
    """The rows of sparse layer `i`'s MLP (`model/moe.py`): the router [D, E] and the experts'
    gate/up [E, D, F] and down [E, F, D], stacked on the `expert` axis."""
    d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    router, gate, up, down = (f"model.layers.{i}.{n}" for n in _MOE_HF[cfg.arch])

    # Tunix's Qwen3 MoE layer holds the same leaves (`nnx_name`): router.kernel [D, E],
    # gate_proj / up_proj [E, D, F], down_proj [E, F, D].
    def stacked(key: str, shape: tuple[int, ...], axes: tuple[str, ...], hf: str, nnx: str) -> ParamSpec:
        # the stacked name drops the index: "model.layers.3.mlp.experts.gate_proj.weight"
        name = hf.replace(".{}.", ".") + ".weight"
        nnx_name = f"layers.{i}.mlp.{nnx}"
        return ParamSpec(
            ("layers", i, key), shape, axes, name, True, nnx_name=nnx_name, hf_expert=hf + ".weight"
        )

    router_row = ParamSpec(
        ("layers", i, "router"),
        (d, e),
        ("embed", "expert_scores"),
        router + ".weight",
        True,
        nnx_name=f"layers.{i}.mlp.router.kernel",
    )
    return {
        "router": router_row,
        "experts_gate": stacked(
            "experts_gate", (e, d, f), ("expert", "embed", "expert_mlp"), gate, "gate_proj"
        ),
        "experts_up": stacked("experts_up", (e, d, f), ("expert", "embed", "expert_mlp"), up, "up_proj"),
        "experts_down": stacked(
            "experts_down", (e, f, d), ("expert", "expert_mlp", "embed"), down, "down_proj"
        ),
    }


def param_specs(cfg: ModelConfig) -> Params:
    """The spec table as a params-shaped tree of ParamSpec leaves."""
    v, d = cfg.vocab_size, cfg.hidden_size
    return {
        "embed": ParamSpec(
            ("embed",), (v, d), ("vocab", "embed"), EMBED, nnx_name="embedder.input_embedding"
        ),
        "layers": [layer_specs(cfg, i) for i in range(cfg.num_layers)],
        "final_norm": ParamSpec(
            ("final_norm",),
            (d,),
            ("embed",),
            "model.norm.weight",
            nnx_name="final_norm.scale" if cfg.is_gemma else "final_norm.w",
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

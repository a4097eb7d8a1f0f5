"""The one weight validator: what a source's tensors must be, judged against the spec table.

Every weight source is read into named tensors (or, before any byte moves, a manifest of
names, shapes and dtypes) and checked here, once: names (missing, unexpected; a partial
update may bring any subset), shapes, dtypes, and a tied head. The forms differ only in
how their tensors are named:

- HF names (`hf_tensors`): directories, GGUF files, payload bytes, HF-named mappings;
  shapes in the HF layout, any float dtype (converted to the engine's);
- params names (`layout`): params trees, a transfer manifest, an orbax checkpoint's
  metadata; shapes and dtypes as the engine holds them;
- NNX names (`nnx_variables`): a Flax NNX state, leaf to leaf with the params.

Each error is a `WeightsMismatch` that names the tensor as the user's source names it.
Whether and where values are checked for NaN/Inf is the placing step's
(`weights/finiteness.py`); nothing here reads tensor data, except a tied head sent with
its embedding (compared with it). This module sits beside the spec table so that the
checkpoint readers (`checkpoint/`) and the update pipeline (`weights/`) share it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from hotswap.errors import WeightsMismatch
from hotswap.kernels.qtensor import FORMATS, QTensor, block_bytes, is_qtensor
from hotswap.model.config import ModelConfig
from hotswap.model.spec import (
    EMBED,
    LM_HEAD,
    Params,
    ParamSpec,
    hf_specs,
    is_spec,
    nnx_leaf_shapes,
    param_specs,
    path_name,
)

FLOAT_DTYPES = frozenset(np.dtype(t) for t in ("float16", "float32", "float64", ml_dtypes.bfloat16))
# What must match for a source to be the same model (its dtype may differ: it is converted).
SAME_MODEL_FIELDS = (
    "arch",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
)


def _listed(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def names(
    got: Iterable[str],
    want: Iterable[str],
    *,
    partial: bool = False,
    where: str = "",
    what: str = "tensor",
    model: ModelConfig | None = None,
) -> None:
    """The one missing/unexpected check: `got` must be `want` (a subset of it when `partial`).

    `where` prefixes the message (a file, a transfer offer); `what` is how the source calls
    its entries ("parameter" for an NNX state); `model`, when given, is named as the model
    the entries were expected for.
    """
    wanted, have = set(want), set(got)
    of = f" for a {model.arch} model of {model.num_layers} layers" if model is not None else ""
    unexpected = sorted(have - wanted)
    if unexpected:
        hint = " (another family or size?)" if model is not None else ""
        raise WeightsMismatch(f"{where}unexpected {what}(s): {_listed(unexpected)}{of}{hint}")
    missing = [] if partial else sorted(wanted - have)
    if missing:
        raise WeightsMismatch(f"{where}missing {what}(s): {_listed(missing)}{of}")


def mismatch(name: str, want_shape, want_dtype, got_shape, got_dtype) -> WeightsMismatch:
    """`name: expected (s) dtype, got (s) dtype`: the one wording of a wrong tensor."""
    return WeightsMismatch(
        f"{name}: expected {tuple(want_shape)} {np.dtype(want_dtype)}, got {tuple(got_shape)} {np.dtype(got_dtype)}"
    )


def same_model(where: str, theirs: ModelConfig, cfg: ModelConfig) -> None:
    """A source that states its config (config.json, GGUF metadata) must be the engine's model."""
    for field in SAME_MODEL_FIELDS:
        if getattr(theirs, field) != getattr(cfg, field):
            raise WeightsMismatch(
                f"{where}: {field}={getattr(theirs, field)!r} but the engine serves "
                f"{getattr(cfg, field)!r}; a weight update must keep the architecture"
            )


# ---- params names: trees, transfer manifests, orbax metadata --------------------------------


def meta(array: Any) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) without reading the data: a jax array stays on its device."""
    if isinstance(array, (np.ndarray, jax.Array, jax.ShapeDtypeStruct)):
        return tuple(array.shape), np.dtype(array.dtype)
    if hasattr(array, "shape") and hasattr(array, "dtype"):  # orbax ArrayMetadata
        return tuple(array.shape), np.dtype(array.dtype)
    a = np.asarray(array)
    return tuple(a.shape), a.dtype


def layout(
    got: Mapping[str, tuple[tuple[int, ...], Any]],
    abstract: Params,
    *,
    where: str = "",
    cast_floats: bool = False,
) -> None:
    """Params-named (shape, dtype) entries against the engine's abstract params.

    `cast_floats`: a float may stand for another float (an orbax restore casts it); any
    other dtype must match exactly.
    """
    want = [(path_name(p), s) for p, s in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    names(got, [n for n, _ in want], where=where)
    for name, spec in want:
        shape, dtype = got[name]
        w_dt, h_dt = np.dtype(spec.dtype), np.dtype(dtype)
        same = h_dt == w_dt or (cast_floats and _is_float(h_dt) and _is_float(w_dt))
        if tuple(shape) != tuple(spec.shape) or not same:
            raise mismatch(f"{where}{name}", spec.shape, w_dt, shape, h_dt)


def tree(params: Params, abstract: Params) -> None:
    """A params tree: names, structure, shapes and dtypes against the engine's abstract params."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    got = {path_name(p): meta(leaf) for p, leaf in flat}
    want_names = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    names(got, want_names)
    if treedef != jax.tree.structure(abstract):
        raise WeightsMismatch(
            "params tree structure differs from the engine's (e.g. a tuple where a list is)"
        )
    layout(got, abstract)


def ordered_layout(got: Mapping[str, tuple[tuple[int, ...], Any]], abstract: Params, *, where: str) -> None:
    """A transfer manifest (name -> (shape, dtype) in the sender's flatten order)."""
    layout(got, abstract, where=where)
    want = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    if list(got) != want:
        raise WeightsMismatch(f"{where}params tree structure differs from the engine's (leaf order)")


def _is_float(dt: np.dtype) -> bool:
    return bool(jax.numpy.issubdtype(dt, jax.numpy.floating))


# ---- HF names: directories, GGUF files, payloads, HF-named mappings --------------------------


def _hf_meta(name: str, array: Any, spec: ParamSpec, target: np.dtype) -> None:
    if is_qtensor(array):  # a GGUF's blocks, served as they are (`quantization="gguf"`)
        _blocks_meta(name, array, spec)
        return
    shape, dtype = meta(array)
    if dtype not in FLOAT_DTYPES:
        raise WeightsMismatch(f"{name}: dtype {dtype} is not a float type; expected {target}")
    if shape != spec.hf_shape:
        raise WeightsMismatch(f"{name}: expected {spec.hf_shape}, got {shape}")


def _blocks_meta(name: str, q: QTensor, spec: ParamSpec) -> None:
    """Block rows must hold the row's HF `[out, in]` matrix: one row per output, whole blocks
    of the format along the input."""
    if not (spec.quantizable or spec.path == ("embed",)):
        raise WeightsMismatch(f"{name}: {q.fmt} blocks; this tensor is served dense, not quantized")
    if len(spec.hf_shape) != 2:
        raise WeightsMismatch(f"{name}: {q.fmt} blocks for a {len(spec.hf_shape)}-D tensor")
    out, k = spec.hf_shape
    f = FORMATS[q.fmt]
    if k % f.block:
        raise WeightsMismatch(f"{name}: {k} inputs are not whole {q.fmt} blocks of {f.block}")
    want = (out, block_bytes(q.fmt, k))
    if tuple(q.data.shape) != want or np.dtype(q.data.dtype) != np.uint8:
        raise WeightsMismatch(
            f"{name}: {q.fmt} blocks of {spec.hf_shape} must be uint8 {want}, got {q.data.dtype} {tuple(q.data.shape)}"
        )


def hf_tensors(
    cfg: ModelConfig, tensors: Mapping[str, Any], target: np.dtype, *, partial: bool = False
) -> dict[str, ParamSpec]:
    """Names, dtypes and shapes of HF tensors, checked without reading their data.

    Returns the spec of every tensor to load, in checkpoint order. With `partial`
    any subset is allowed. A tied checkpoint's `lm_head.weight` is checked here (its
    data against the embedding's) and left out of the result: the head is derived
    from the embedding.
    """
    specs = hf_specs(cfg)
    tied_head = cfg.tie_word_embeddings and LM_HEAD in tensors
    names((n for n in tensors if not (tied_head and n == LM_HEAD)), specs, partial=partial, model=cfg)
    chosen = {name: spec for name, spec in specs.items() if name in tensors}
    for name, spec in chosen.items():
        _hf_meta(name, tensors[name], spec, target)
    if tied_head:
        _tied_head(cfg, tensors, target)
    return chosen


def _tied_head(cfg: ModelConfig, tensors: Mapping[str, Any], target: np.dtype) -> None:
    """Accept `lm_head.weight` in a tied checkpoint only when it repeats the embedding.

    Some writers store the tied head anyway. Ignoring a *different* head would
    silently serve a head the user did not mean (the stale-tied-head bug), so
    that is an error, as is a head sent without the embedding it is tied to.
    Equality is judged in the engine's dtype, as the head would be served.
    """
    if EMBED not in tensors:
        raise WeightsMismatch(
            f"{LM_HEAD}: this model ties word embeddings; send {EMBED} (the head is derived from it)"
        )
    _hf_meta(LM_HEAD, tensors[LM_HEAD], hf_specs(cfg)[EMBED], target)  # the embedding's [V, D]
    with np.errstate(over="ignore", invalid="ignore"):
        head, embed = (np.asarray(tensors[n], dtype=target) for n in (LM_HEAD, EMBED))
    if not np.array_equal(head, embed, equal_nan=True):  # a NaN embedding is reported as NaN, later
        raise WeightsMismatch(
            f"{LM_HEAD}: differs from {EMBED} but config.json sets tie_word_embeddings=true"
        )


# ---- NNX names: a Flax NNX state ------------------------------------------------------------


def nnx_variables(flat: Mapping[str, Any], cfg: ModelConfig, abstract: Params | None = None) -> None:
    """An NNX state's parameters (NNX path -> array) against the spec table's `nnx_name`s:
    names, shapes and (given the engine's `abstract` params) dtypes, named as the NNX model
    names them."""
    rows: list[ParamSpec] = jax.tree.leaves(param_specs(cfg), is_leaf=is_spec)
    rows = [s for s in rows if s.nnx_name is not None]
    dtypes = {}
    if abstract is not None:
        dtypes = {path_name(p): a.dtype for p, a in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    leaf_shapes = nnx_leaf_shapes(rows)
    names(flat, list(leaf_shapes), what="parameter", model=cfg)
    for s in rows:
        shape, dt = meta(flat[s.nnx_name])
        if shape != leaf_shapes[s.nnx_name]:
            raise WeightsMismatch(
                f"{s.nnx_name}: expected {leaf_shapes[s.nnx_name]}, got {shape} (params {s.name})"
            )
        if s.name in dtypes and dt != np.dtype(dtypes[s.name]):
            raise mismatch(f"{s.nnx_name}", s.shape, dtypes[s.name], shape, dt)


# ---- LoRA adapters: PEFT names, qwix's NNX names, params names ---------------------------------

LORA_FORMS = ("peft", "nnx", "params")


def lora_shapes(
    spec: ParamSpec, form: str, rank: int, parts: int | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (A, B) shapes `form` stores a rank-`rank` pair on `spec` in: PEFT's torch Linear
    weights `[r, in]` / `[out, r]`, else the params layout's `[*in, r]` / `[r, *out]`. `parts`:
    the row is one of that many stacked in one NNX leaf (`lora_stacks`), whose one pair has
    B `[r, parts, *out]` (Tunix's Gemma 3 kv_einsum: `[r, 2, K, H]`)."""
    a, b = spec.lora_shapes(rank)
    if form == "peft":
        return (rank, int(np.prod(a[:-1]))), (int(np.prod(b[1:])), rank)
    if parts is not None:
        return a, (rank, parts, *b[1:])
    return a, b


def lora_stacks(rows: list[ParamSpec], form: str) -> dict[str, int]:
    """NNX leaf -> how many adaptable rows it stacks (k and v in Tunix's Gemma 3 `kv_einsum`,
    q/k/v in its `qkv_einsum`). qwix puts one LoRA pair on such a leaf: A `[D, r]`, shared by
    its rows, and B `[r, parts, *out]`, row `nnx_index` its B[:, nnx_index]. Other forms name a
    pair per row: none stacked."""
    if form != "nnx":
        return {}
    stacks: dict[str, int] = {}
    for s in rows:
        if s.nnx_index is not None:
            stacks[s.nnx_name] = max(stacks.get(s.nnx_name, 0), s.nnx_index + 1)
    return stacks


def lora_rank(form: str, a_shape: tuple[int, ...]) -> int:
    """A pair's rank, read off its A factor as `form` lays it out."""
    if not a_shape:
        return 0
    return a_shape[0] if form == "peft" else a_shape[-1]


def lora_tensors(
    cfg: ModelConfig, tensors: Mapping[str, Any], form: str, *, max_rank: int | None = None
) -> dict[str, tuple[ParamSpec, str, str, int]]:
    """A LoRA adapter's tensors, named as `form` names them, against the spec table's adaptable
    rows (`ParamSpec.adaptable`: q/k/v/o, gate/up/down): every name an A or B factor of one,
    in pairs, float, shaped for the pair's rank, the rank within `max_rank`. Nothing is read
    but shapes and dtypes. Returns params name -> (row, A name, B name, rank, part): part is the
    row's index into a stacked pair's B (`lora_stacks`), else None."""
    rows = [s for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec) if s.adaptable]
    stacks = lora_stacks(rows, form)
    by_name = {n: (s, i) for s in rows for i, n in enumerate(s.lora_names(form))}
    unknown = sorted(n for n in tensors if n not in by_name)
    if unknown:
        modules = ", ".join(sorted({s.module for s in rows}))
        raise WeightsMismatch(
            f"unexpected LoRA tensor(s): {_listed(unknown)}; an adapter for a {cfg.arch} model of "
            f"{cfg.num_layers} layers targets only {modules} (another model, or an unsupported target module?)"
        )
    if not tensors:
        raise WeightsMismatch("a LoRA adapter with no tensors")
    out = {}
    for s in rows:
        a_name, b_name = s.lora_names(form)
        if a_name not in tensors and b_name not in tensors:
            continue
        for name, other in ((a_name, b_name), (b_name, a_name)):
            if name not in tensors:
                raise WeightsMismatch(f"{name}: missing, but its pair {other} was sent (LoRA needs both)")
        a_meta, b_meta = meta(tensors[a_name]), meta(tensors[b_name])
        rank = lora_rank(form, a_meta[0])
        for name, (_, dtype) in ((a_name, a_meta), (b_name, b_meta)):
            if dtype not in FLOAT_DTYPES:
                raise WeightsMismatch(f"{name}: dtype {dtype} is not a float type")
        if rank < 1:
            raise WeightsMismatch(f"{a_name}: a LoRA factor of rank 0, shape {a_meta[0]}")
        parts = stacks.get(s.nnx_name)
        want_a, want_b = lora_shapes(s, form, rank, parts)
        for name, want, (shape, _) in ((a_name, want_a, a_meta), (b_name, want_b, b_meta)):
            if shape != want:
                raise WeightsMismatch(
                    f"{name}: expected {want} for a rank-{rank} LoRA pair on {s.name} "
                    f"{s.shape}, got {shape} (an adapter for another model?)"
                )
        if max_rank is not None and rank > max_rank:
            raise WeightsMismatch(f"{a_name}: LoRA rank {rank} is above max_lora_rank={max_rank}")
        out[s.name] = (s, a_name, b_name, rank, s.nnx_index if parts else None)
    return out


def lora_targets(cfg: ModelConfig, modules: Iterable[str], where: str) -> None:
    """An adapter config's `target_modules` must name adaptable modules of this model."""
    known = {s.module for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec) if s.adaptable}
    unknown = sorted(set(modules) - known)
    if unknown:
        raise WeightsMismatch(
            f"{where}: target module(s) {_listed(unknown)} cannot be adapted; a {cfg.arch} model's "
            f"adaptable modules are {', '.join(sorted(known))}"
        )

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
from hotswap.model.config import ModelConfig
from hotswap.model.spec import EMBED, LM_HEAD, Params, ParamSpec, hf_specs, is_spec, param_specs, path_name

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


def ordered_layout(entries: list[Mapping[str, Any]], abstract: Params, *, where: str) -> None:
    """A transfer manifest (entries of name, shape, dtype in the sender's flatten order)."""
    layout({e["name"]: (e["shape"], e["dtype"]) for e in entries}, abstract, where=where)
    want = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    if [e["name"] for e in entries] != want:
        raise WeightsMismatch(f"{where}params tree structure differs from the engine's (leaf order)")


def _is_float(dt: np.dtype) -> bool:
    return bool(jax.numpy.issubdtype(dt, jax.numpy.floating))


# ---- HF names: directories, GGUF files, payloads, HF-named mappings --------------------------


def _hf_meta(name: str, array: Any, spec: ParamSpec, target: np.dtype) -> None:
    shape, dtype = meta(array)
    if dtype not in FLOAT_DTYPES:
        raise WeightsMismatch(f"{name}: dtype {dtype} is not a float type; expected {target}")
    if shape != spec.hf_shape:
        raise WeightsMismatch(f"{name}: expected {spec.hf_shape}, got {shape}")


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
    names(flat, [s.nnx_name for s in rows], what="parameter", model=cfg)
    for s in rows:
        shape, dt = meta(flat[s.nnx_name])
        if shape != s.shape:
            raise WeightsMismatch(f"{s.nnx_name}: expected {s.shape}, got {shape} (params {s.name})")
        if s.name in dtypes and dt != np.dtype(dtypes[s.name]):
            raise mismatch(f"{s.nnx_name}", s.shape, dtypes[s.name], shape, dt)

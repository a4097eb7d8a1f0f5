"""HF files' per-expert tensors <-> the spec table's stacked expert rows.

An HF MoE checkpoint stores each expert's projections as tensors of their own
(`model.layers.3.mlp.experts.5.gate_proj.weight`, `[F, D]`); params hold them stacked,
one `[E, D, F]` leaf per projection (`model/spec.py`, `expert_specs`). `stack` turns a
source's per-expert tensors into the row's one stacked tensor (`[E, out, in]`, under the
row's `hf_name`) before the one validator and the conversion see them, so every weight source
that names tensors as HF does (directories, GGUF, payloads, chunks) takes the same path;
`unstack` is its inverse for saving. A source may also bring the stacked tensor itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hotswap.errors import WeightsMismatch
from hotswap.model import validate
from hotswap.model.config import ModelConfig
from hotswap.model.spec import ParamSpec, hf_specs


def _expert_rows(cfg: ModelConfig) -> list[ParamSpec]:
    return [s for s in hf_specs(cfg).values() if s.hf_expert is not None]


def stack(cfg: ModelConfig, tensors: Mapping[str, Any], *, partial: bool = False) -> Mapping[str, Any]:
    """`tensors` with each row's per-expert tensors replaced by one `[E, out, in]` stack.

    A row's experts come all together or (in a partial update) not at all; a missing expert
    is a WeightsMismatch naming its tensor. Tensors of an expert the model does not have stay
    as they are, for the validator to name as unexpected. Dense models: `tensors` itself."""
    rows = _expert_rows(cfg)
    if not rows:
        return tensors
    out = dict(tensors)
    for spec in rows:
        names = [spec.hf_expert.format(e) for e in range(cfg.num_experts)]
        have = [n for n in names if n in out]
        if not have:
            if not partial and spec.hf_name not in out:
                validate.names(have, names, where=f"{spec.name}: ")  # raises: every expert missing
            continue
        if spec.hf_name in out:
            raise WeightsMismatch(f"{have[0]}: sent together with the stacked {spec.hf_name}; send one form")
        if len(have) < len(names):  # a layer's experts come together: name the ones missing
            validate.names(
                have, names, where=f"{spec.name} ({len(have)} of {cfg.num_experts} experts sent): "
            )
        parts = [out.pop(n) for n in names]
        for n, p in zip(names, parts, strict=True):
            if tuple(np.shape(p)) != spec.hf_shape[1:]:
                raise WeightsMismatch(f"{n}: expected {spec.hf_shape[1:]}, got {tuple(np.shape(p))}")
        out[spec.hf_name] = np.stack([np.asarray(p) for p in parts])
    return out


def unstack(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of `stack`: each stacked `[E, out, in]` tensor as E per-expert tensors, in
    the checkpoint's order (the row's place, expert by expert)."""
    rows = {s.hf_name: s for s in _expert_rows(cfg)}
    if not rows:
        return tensors
    out: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        spec = rows.get(name)
        if spec is None:
            out[name] = array
            continue
        for e in range(array.shape[0]):
            out[spec.hf_expert.format(e)] = np.ascontiguousarray(array[e])
    return out

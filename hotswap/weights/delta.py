"""Delta updates: only the tensors (or rows of tensors) that changed since a known version.

An RL step changes few weights; sending them all is most of an update's cost. A delta is
HF-named tensors sent with `UpdateOptions.base_version`, the weights version they apply to:

- a whole tensor replaces its serving tensor (a partial update, `plan.py`);
- `Rows(indices, values)` (or, on the wire, the tensor `NAME` holding the rows' values
  `[k, *rest]` beside an int tensor `NAME:rows` of their `[k]` indices) replaces rows of the
  serving tensor in its HF layout: rows of an embedding `[vocab, hidden]`, output rows of a
  linear weight `[out, in]`. The rows are scattered into a host copy of the serving tensor
  in pass 1 (`expanded`), so the rest of the pipeline sees an ordinary whole tensor: one
  validator, one conversion, and a result bitwise equal to sending the full tensor.

The engine refuses a delta against any other serving version (`BaseVersionMismatch`, 409)
before anything changes. `changed` computes a delta from two HF-named dicts, exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from hotswap.checkpoint import hf
from hotswap.errors import WeightsMismatch
from hotswap.model.params import Params
from hotswap.model.spec import ParamSpec

ROWS_SUFFIX = ":rows"  # `NAME:rows` on the wire: the int indices of the rows `NAME` carries


@dataclasses.dataclass(frozen=True)
class Rows:
    """Rows `indices` `[k]` of one HF tensor replaced by `values` `[k, *hf_shape[1:]]`."""

    indices: Any
    values: Any


def split(tensors: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Rows]]:
    """`tensors` -> (whole tensors, row entries): `Rows` values, and wire pairs `NAME` + `NAME:rows`."""
    whole, rows = {}, {}
    for name, value in tensors.items():
        if name.endswith(ROWS_SUFFIX):
            base = name[: -len(ROWS_SUFFIX)]
            if base not in tensors:
                raise WeightsMismatch(f"{name}: row indices without the rows' values (a tensor {base!r})")
            rows[base] = Rows(value, tensors[base])
        elif isinstance(value, Rows):
            rows[name] = value
        elif name + ROWS_SUFFIX not in tensors:
            whole[name] = value
    return whole, rows


def check_rows(name: str, r: Rows, spec: ParamSpec | None) -> Rows:
    """`r` as numpy, its indices and values checked against its HF row `spec`."""
    if spec is None:
        raise WeightsMismatch(
            f"{name}: rows sent for a tensor this model does not have (or a stacked expert)"
        )
    idx = np.asarray(r.indices)
    values = r.values if hasattr(r.values, "shape") else np.asarray(r.values)
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise WeightsMismatch(
            f"{name}{ROWS_SUFFIX}: row indices must be a 1-D int array, got {idx.dtype} {idx.shape}"
        )
    n = spec.hf_shape[0]
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise WeightsMismatch(
            f"{name}{ROWS_SUFFIX}: row indices must lie in [0, {n}), got {idx.min()}..{idx.max()}"
        )
    if np.unique(idx).size != idx.size:
        raise WeightsMismatch(f"{name}{ROWS_SUFFIX}: a row index is repeated")
    want = (idx.size, *spec.hf_shape[1:])
    if tuple(values.shape) != want:
        raise WeightsMismatch(
            f"{name}: {idx.size} rows of {spec.hf_shape} must be {want}, got {tuple(values.shape)}"
        )
    if not np.issubdtype(np.dtype(values.dtype), np.floating) and np.dtype(values.dtype).kind != "V":
        raise WeightsMismatch(f"{name}: rows of dtype {values.dtype} are not a float type")
    return Rows(idx, values)


def expanded(
    rows: Mapping[str, Rows], specs: Mapping[str, ParamSpec], current: Params
) -> dict[str, np.ndarray]:
    """Each row entry as a whole HF tensor: a host copy of the serving tensor (`current`, in
    params layout) with the rows replaced, in the serving dtype (what a whole tensor sent in
    any float dtype is cast to)."""
    out = {}
    for name, r in rows.items():
        spec = specs[name]
        serving = np.asarray(hf.get_leaf(current, spec.path))
        full = np.array(spec.to_hf(serving), order="C", copy=True)  # [rows, *rest], HF layout
        with np.errstate(over="ignore", invalid="ignore"):  # overflow shows up in the finiteness check
            full[r.indices] = np.asarray(r.values).astype(full.dtype)
        out[name] = full
    return out


def changed(old: Mapping[str, Any], new: Mapping[str, Any], *, rows: bool = False) -> dict[str, Any]:
    """The delta from `old` to `new` (HF-named, same names and shapes): the tensors of `new`
    that differ bitwise from `old`'s. With `rows`, a 2-D+ tensor with fewer than half its rows
    changed comes as `Rows` of those rows only."""
    if set(old) != set(new):
        raise WeightsMismatch(
            f"a delta compares the same tensors; names differ: {sorted(set(old) ^ set(new))[:5]}"
        )
    out: dict[str, Any] = {}
    for name, b in new.items():
        a, b = np.ascontiguousarray(old[name]), np.ascontiguousarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            out[name] = b
            continue
        # Exact: bit patterns, so -0.0 vs 0.0 and NaN payloads count as changes.
        diff = a.view(np.uint8).reshape(a.shape + (-1,)) != b.view(np.uint8).reshape(b.shape + (-1,))
        if not diff.any():
            continue
        hit = np.flatnonzero(diff.reshape(a.shape[0], -1).any(axis=1)) if a.ndim >= 2 else None
        if rows and hit is not None and hit.size < a.shape[0] / 2:
            out[name] = Rows(hit.astype(np.int64), np.ascontiguousarray(b[hit]))
        else:
            out[name] = b
    return out


def wire(delta: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A delta as plain named arrays for a payload (safetensors, JSON entries): each `Rows` as
    `NAME` (values) + `NAME:rows` (indices)."""
    out = {}
    for name, v in delta.items():
        if isinstance(v, Rows):
            out[name] = np.asarray(v.values)
            out[name + ROWS_SUFFIX] = np.asarray(v.indices, dtype=np.int64)
        else:
            out[name] = v
    return out


def nbytes(delta: Mapping[str, Any]) -> int:
    """Bytes a delta's arrays hold (what it sends, before framing)."""
    return sum(np.asarray(a).nbytes for a in wire(delta).values())

"""Stage 2 of the ingest pipeline: `plan(opened, cfg, abstract) -> Plan`, the one validator call.

Whatever row opened a source (`readers.py`), its names, shapes and dtypes are judged here
against the spec table (`model/validate.py` holds the rules), once, before any byte moves:
which spec rows it fills, whole or partial, a tied head, a LoRA adapter's rank and targets,
and that a source which states its config is the served model. A `WeightsMismatch` names the
tensor in the source's own naming (`Opened.rename`: a GGUF's tensor names). The `Plan` is
what every later stage reads: `place.py` never validates again, the in-place pass 2 reuses
pass 1's plan, and the multi-host driver checks a source here before any follower hears of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from hotswap.checkpoint import experts
from hotswap.errors import WeightsMismatch
from hotswap.model import validate
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params
from hotswap.model.spec import ParamSpec, hf_specs
from hotswap.weights import delta
from hotswap.weights.options import UpdateOptions
from hotswap.weights.readers import Opened


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked source: what it holds (`kind`: "hf", "tree", "nnx", "fetch" or "adapter", as
    `Opened` holds it), which leaves it replaces, and for HF names the spec row of each tensor
    (`chosen`, checkpoint order; experts stacked)."""

    opened: Opened
    kind: str
    cfg: ModelConfig
    abstract: Params
    options: UpdateOptions
    chosen: dict[str, ParamSpec] | None = None  # hf: HF name -> spec row
    tensors: Mapping[str, Any] | None = None  # hf: the tensors `chosen` names (experts stacked)
    adapter_rows: dict | None = None  # adapter: params name -> (row, A name, B name, rank, part)
    replaced: frozenset[tuple[str | int, ...]] | None = None  # leaf paths; None: every leaf
    rows: dict[str, delta.Rows] | None = None  # hf delta: HF name -> rows (checked; `chosen` names it)

    @property
    def partial(self) -> bool:
        return self.replaced is not None


def _kind(opened: Opened) -> str:
    if opened.adapter is not None:
        return "adapter"
    if opened.tensors is not None:
        return "hf"
    if opened.nnx is not None:
        return "nnx"
    if opened.fetch is not None:
        return "fetch"
    return "tree"


def plan(
    opened: Opened,
    cfg: ModelConfig,
    abstract: Params,
    *,
    options: UpdateOptions | None = None,
    max_lora_rank: int | None = None,
) -> Plan:
    """Check `opened` against the served model (`cfg`, `abstract`). Nothing is converted or
    moved. `max_lora_rank`: a named adapter's bound (its slot's buffers)."""
    options = options or UpdateOptions()
    kind = _kind(opened)
    if options.base_version is not None and kind == "hf" and not options.partial:
        # A delta brings only the tensors that changed: the others keep their serving values.
        options = dataclasses.replace(options, partial=True)
    if options.partial and kind != "hf":
        raise WeightsMismatch(
            f"{opened.where}: a partial update takes HF-named tensors; this source is a whole {opened.form}"
        )
    try:
        return _checked(opened, kind, cfg, abstract, options, max_lora_rank)
    except WeightsMismatch as e:
        if opened.rename is None:
            raise
        raise opened.rename(e) from e


def _names(rows) -> str:
    return ", ".join(sorted(rows)[:3]) + (" ..." if len(rows) > 3 else "")


def _checked(opened, kind, cfg, abstract, options, max_lora_rank) -> Plan:
    base = Plan(opened, kind, cfg, abstract, options)
    if opened.stated is not None:
        validate.same_model(*opened.stated, cfg)
    if kind == "hf":
        whole, rows = delta.split(opened.tensors)
        if rows and options.base_version is None:
            raise WeightsMismatch(
                f"{opened.where}: row entries ({_names(rows)}) replace rows of the serving weights, "
                "so they need the base_version they apply to"
            )
        tensors = experts.stack(cfg, whole, partial=options.partial)
        target = np.dtype(abstract["embed"].dtype)
        chosen = validate.hf_tensors(cfg, tensors, target, partial=options.partial)
        if rows:
            specs = hf_specs(cfg)
            rows = {n: delta.check_rows(n, r, specs.get(n)) for n, r in rows.items()}
            chosen = {n: s for n, s in specs.items() if n in chosen or n in rows}  # checkpoint order
        replaced = None
        if options.partial:
            tied = cfg.tie_word_embeddings and any(s.path == ("embed",) for s in chosen.values())
            replaced = frozenset({s.path for s in chosen.values()} | ({("lm_head",)} if tied else set()))
        return dataclasses.replace(base, chosen=chosen, tensors=tensors, replaced=replaced, rows=rows or None)
    if kind == "tree":
        validate.tree(opened.tree, abstract)
    elif kind == "nnx":
        validate.nnx_variables(opened.nnx, cfg)  # names and shapes; a float dtype is cast (`place.py`)
    elif kind == "fetch":
        if opened.ordered:
            validate.ordered_layout(opened.layout, abstract, where=opened.where)
        else:
            validate.layout(opened.layout, abstract, where=opened.where, cast_floats=opened.cast_floats)
    elif kind == "adapter":
        adapter = opened.adapter
        targets = opened.adapter_targets
        # PEFT's "all-linear" and regexes name no module list: the tensors' own names are checked
        if targets and not any(t == "all-linear" or t.startswith("(") or "*" in t for t in targets):
            validate.lora_targets(cfg, [t.split(".")[-1] for t in targets], adapter.where)
        rows = validate.lora_tensors(cfg, adapter.tensors, adapter.form, max_rank=max_lora_rank)
        return dataclasses.replace(base, adapter_rows=rows)
    return base

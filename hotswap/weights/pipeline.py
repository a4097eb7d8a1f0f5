"""The ingest pipeline in one line: `read -> plan -> place`, for callers that stage a copy.

`Engine.update_weights` runs the stages itself (an in-place update has a second pass under its
lock); the engine's first load (an update into an empty state), `LLM`'s tools and a trainer
process that publishes a checkpoint run this.
"""

from __future__ import annotations

import os
from typing import Any

from hotswap.model.config import ModelConfig
from hotswap.model.params import Params
from hotswap.weights import place, plan, readers
from hotswap.weights.options import UpdateOptions


def stage(
    source: Any,
    cfg: ModelConfig,
    abstract: Params,
    *,
    options: UpdateOptions | None = None,
    current: Params | None = None,
    weights_root: str | os.PathLike | None = None,
) -> place.StagedParams:
    """Any weight source, read, checked and placed on `abstract` as a copy (an adapter merged
    into `current`)."""
    opened = readers.read(source, cfg, weights_root=weights_root, abstract=abstract)
    checked = plan.plan(opened, cfg, abstract, options=options)
    return place.prepare(checked, "copy", current).staged

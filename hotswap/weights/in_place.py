"""Hot updates written over the serving weights: one copy of the params on the device.

A staged update (`sources.stage_source`) builds the new params beside the serving ones and
swaps them in one assignment: serving goes on through the transfer, and the device must
hold two copies of the params. On TPU/GPU that second copy is HBM the KV cache does not
get (a 27B model on a v5e-8 keeps under 1 GiB a chip of cache beside two copies). An
in-place update, vLLM's memory profile with hotswap's rule kept (a rejected update leaves
the old weights serving), runs in two passes:

1. `check_source`, outside the engine's lock while serving goes on: the source is read,
   validated by its own names, and converted on the device tensor by tensor for the
   finiteness pass, each converted tensor dropped as soon as its check is dispatched. A bad
   source is refused here, before anything serving is touched.
2. `place`, under the lock once the in-flight policy has run: the engine drops the serving
   leaves the update replaces (`lifecycle.drop_weights`), then the checked source is
   converted again into their room, not checked twice. This pass can fail only as the
   device does (out of memory, a lost chip); the replaced leaves are gone by then, so the
   engine's weights are discarded as at sleep level 2 and `WeightsLost` says so: the next
   update loads them.

The conversion runs twice (about a second of host transfers for a 27B model on a v5e-8); the
device needs the serving params plus what one pass holds in flight (`update_reserve`).
Params trees already on the engine's shardings (a colocated trainer's, Tunix's) are used
as they are in either mode: they cost nothing here. A LoRA adapter (merged beside the
base weights it keeps) and a transfer pull (which lands on the device as it arrives) are
staged as before.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from hotswap.checkpoint import hf
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params
from hotswap.weights import hf_device, sources, transfer
from hotswap.weights import lora as lora_source
from hotswap.weights.ingest import StagedParams, check_params, place_params, stage_params


def resolve(staging: str, platform: str) -> str:
    """The one decision of how an update is staged: "auto" is "in_place" on an accelerator,
    where device memory bounds the KV cache, and "copy" on CPU, where the device is host
    memory and a staged copy lets serving go on through the whole update."""
    if staging == "auto":
        return "copy" if platform == "cpu" else "in_place"
    return staging


def update_reserve(staging: str, params_bytes: int, largest_leaf_bytes: int) -> int:
    """Device bytes a hot update needs beyond the serving params, per chip. Either way the HF
    tensors in flight (`hf_device.IN_FLIGHT_BYTES` and the one that passes the bound, still in
    the file's layout); staged, the whole new copy beside them; in place, their converted
    twins, each dropped (pass 1) or written into a released leaf's room (pass 2)."""
    in_flight = hf_device.IN_FLIGHT_BYTES + largest_leaf_bytes
    if staging == "copy":
        return params_bytes + in_flight
    return 2 * in_flight


@dataclasses.dataclass(frozen=True)
class Checked:
    """A source read, validated and checked for NaN/Inf, not yet on the devices; or, for the
    forms that stage as before, already `staged`."""

    read: sources.Read | None = None
    replaced: frozenset[tuple[str | int, ...]] | None = None  # leaf paths; None: every leaf
    staged: StagedParams | None = None


def check_source(
    source: Any,
    cfg: ModelConfig,
    *,
    current: Params | None,
    abstract: Params,
    partial: bool = False,
    weights_root: str | os.PathLike | None = None,
    check_finite: bool = True,
    lora_alpha: float | None = None,
) -> Checked:
    """Pass 1 (see the module doc). `current`: the serving base weights, which a partial update
    needs loaded and a LoRA adapter (staged) is merged into."""
    adapter = lora_source.read(source, cfg, weights_root=weights_root)
    if adapter is not None:  # read once, handed on
        staged = sources.stage_adapter(
            adapter, cfg, current=current, abstract=abstract, check_finite=check_finite, lora_alpha=lora_alpha
        )
        return Checked(staged=staged)
    if isinstance(source, transfer.TransferRef):
        staged = sources.stage_source(
            source,
            cfg,
            current=current,
            abstract=abstract,
            partial=partial,
            weights_root=weights_root,
            check_finite=check_finite,
            lora_alpha=lora_alpha,
        )
        return Checked(staged=staged)
    if partial:
        sources.partial_base(current, partial)  # raises when there is nothing to keep
    got = sources.read(source, cfg, weights_root=weights_root, abstract=abstract)
    if got.tensors is not None:
        replaced = hf_device.check_on_device(
            cfg, got.tensors, abstract, partial=partial, check_finite=check_finite
        )
        return Checked(read=got, replaced=replaced if partial else None)
    check_params(got.tree, abstract, check_finite=check_finite, validated=got.validated)
    return Checked(read=dataclasses.replace(got, validated=True))


def keeping(current: Params, replaced: frozenset[tuple[str | int, ...]]) -> Params:
    """New containers holding the leaves of `current` a partial update keeps; the replaced ones
    are left out, so dropping the serving state frees them."""
    kept = hf.copy_tree(current)
    for path in replaced:
        hf.set_leaf(kept, path, None)
    return kept


def place(checked: Checked, cfg: ModelConfig, abstract: Params, kept: Params | None) -> StagedParams:
    """Pass 2: the checked source on `abstract`'s shardings, into the room the dropped leaves
    left. `kept`: a partial update's kept leaves (`keeping`)."""
    if checked.staged is not None:
        return checked.staged
    got = checked.read
    if got.tensors is None:
        return stage_params(got.tree, abstract, check_finite=False, validated=True)
    params = hf_device.hf_to_device(cfg, got.tensors, abstract, base=kept, check_finite=False)
    return StagedParams(place_params(params, abstract), abstract)

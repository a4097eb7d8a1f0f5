"""Stage 3 of the ingest pipeline: `prepare(plan, strategy) -> Prepared`, then `StagedParams`.

A checked `Plan` is put on the engine's shardings by one row of `STRATEGIES`, with one
finiteness pass (`finiteness.py`) and no second validation:

| strategy   | for                       | pass 1, serving goes on          | pass 2, under the lock     |
|------------|---------------------------|----------------------------------|----------------------------|
| `copy`     | whole or partial weights  | convert + check + place (a copy) | (none)                     |
| `in_place` | HF-named weights          | convert + check, each dropped    | convert into freed room    |
| `merge`    | a LoRA adapter            | factors checked, merged (a copy) | (none)                     |

`copy` builds the new params beside the serving ones and swaps them in one assignment: the
device holds two copies. `in_place` (vLLM's memory profile, with hotswap's rule kept: a
rejected update leaves the old weights serving) refuses a bad source in pass 1, before
anything serving is touched; pass 2 runs after the engine dropped the leaves the update
replaces (`lifecycle.drop_weights`) and can fail only as the device does (out of memory, a lost
chip), which the engine reports as `WeightsLost`. Only HF-named sources convert, so only they
have a second pass: trees, NNX states and fetched arrays are used as they are (zero copy when
they already sit on the engine's shardings). `strategy_for` is the one decision of the row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from hotswap.checkpoint import hf
from hotswap.errors import WeightsMismatch
from hotswap.kernels.qtensor import is_qtensor
from hotswap.model import lora
from hotswap.model.params import Params, path_name
from hotswap.weights import delta, finiteness, hf_device, lora_forms, quantize
from hotswap.weights.plan import Plan

STAGINGS = ("auto", "copy", "in_place")


@dataclasses.dataclass(frozen=True)
class StagedParams:
    """Params checked against `abstract` and placed on its shardings: the only thing a lifecycle
    transition (`engine/lifecycle.update_weights`) takes. `base`: the base weights `params`
    merged a LoRA adapter into (None: params are the base)."""

    params: Params
    abstract: Params
    base: Params | None = None


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Pass 1 done: `staged` when the strategy has no pass 2, else the plan pass 2 writes."""

    plan: Plan
    strategy: str
    staged: StagedParams | None = None


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


def place_params(params: Params, abstract: Params) -> Params:
    """Put each leaf on the engine's sharding. Arrays already there are used as they are
    (zero copy); others move device-to-device with `jax.device_put` (a reshard, no host trip)."""

    def put(x, spec):
        sharding = spec.sharding
        if (
            isinstance(x, jax.Array)
            and sharding is not None
            and x.committed  # uncommitted arrays would key a separate jit cache entry: recompiles
            and x.sharding.is_equivalent_to(sharding, x.ndim)
        ):
            return x
        return jax.device_put(x, sharding) if sharding is not None else jnp.asarray(x)

    def put_quantized(q, spec):
        # A QTensor's arrays keep the shardings they were quantized or read with (`quantize.py`);
        # from host memory (sleep level 1) they come back to them, or from numpy to the dense
        # weight's sharding (same-shaped int8/fp8 data) or whole on each device (scales, blocks).
        def one(a):
            if isinstance(a, jax.Array):
                if a.sharding.memory_kind != "pinned_host":
                    return a
                return jax.device_put(a, a.sharding.with_memory_kind("device"))
            whole = spec.sharding
            if isinstance(whole, jax.sharding.NamedSharding):
                whole = jax.sharding.NamedSharding(whole.mesh, jax.sharding.PartitionSpec())
            return put(
                a, spec if a.shape == spec.shape else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole)
            )

        return jax.tree.map(one, q)

    return jax.tree.map(
        lambda x, spec: put_quantized(x, spec) if is_qtensor(x) else put(x, spec),
        params,
        abstract,
        is_leaf=is_qtensor,
    )


def _checked_tree(params: Params, check_finite: bool) -> Params:
    """One NaN/Inf pass over a params tree's leaves as they are."""
    check = finiteness.Check(check_finite)
    named = {path_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    check.add(named)
    check.raise_first(list(named))
    return params


def fetched(plan: Plan) -> Params:
    """A checked transfer offer's or orbax checkpoint's arrays, moved now (not yet checked for
    NaN/Inf): what the multi-host processes agree on before they place it."""
    return plan.opened.fetch(plan.abstract)


def holding(plan: Plan, tree: Params) -> Plan:
    """`plan` with its arrays already `fetched`: placing it moves nothing more (the multi-host
    processes fetch, agree on the outcome, then place)."""
    return dataclasses.replace(plan, opened=dataclasses.replace(plan.opened, fetch=lambda abstract: tree))


def tree_of(plan: Plan) -> Params:
    """The params tree of a tree-like plan: as given, from NNX variables, or fetched now."""
    opened = plan.opened
    if plan.kind == "nnx":
        from hotswap.weights import nnx as nnx_params  # the [tunix] extra: flax

        params = nnx_params.params_from_flat(opened.nnx, plan.cfg)
        # A trainer's dtype may differ from the engine's: cast on the leaf's devices, then move
        # to the engine's shardings there (Tunix's transfer guard refuses host round trips).
        params = jax.tree.map(
            lambda x, a: x if x.dtype == a.dtype else x.astype(a.dtype), params, plan.abstract
        )
        return nnx_params.reshard(params, plan.abstract)
    if plan.kind == "fetch":
        return fetched(plan)
    return opened.tree


def _base(plan: Plan, current: Params | None) -> Params | None:
    """The params a partial update fills in: the current ones, as they are (no copy)."""
    if not plan.partial:
        return None
    if current is None:
        raise WeightsMismatch("a partial update needs the current weights loaded (not after sleep level 2)")
    return current


def _copy(plan: Plan, current: Params | None) -> Prepared:
    check = plan.options.check_finite
    if plan.kind == "hf":
        params = hf_device.hf_to_device(
            plan.cfg, plan.tensors, plan.chosen, plan.abstract, base=_base(plan, current), check_finite=check
        )
    else:
        params = _checked_tree(tree_of(plan), check)
    return Prepared(
        plan, "copy", StagedParams(served(plan, place_params(params, plan.abstract)), plan.abstract)
    )


def factors(plan: Plan) -> lora.Factors:
    """A LoRA plan's factors, checked for NaN/Inf and placed on the adapted weights' devices."""
    return lora_forms.stage(
        plan.opened.adapter,
        plan.adapter_rows,
        plan.abstract,
        lora_alpha=plan.options.lora_alpha,
        check_finite=plan.options.check_finite,
    )


def _merge(plan: Plan, current: Params | None) -> Prepared:
    """The staged params serve W + (alpha / r)·A·B and keep `current`, the base, as their base."""
    if current is None:
        raise WeightsMismatch("a LoRA adapter needs base weights loaded (not after sleep level 2)")
    if plan.cfg.quantization is not None:
        raise WeightsMismatch(
            f"a LoRA adapter cannot be merged into {plan.cfg.quantization}-quantized weights: send the "
            "merged full-precision weights (they are re-quantized on the way in)"
        )
    staged = StagedParams(lora.merge(current, factors(plan)), plan.abstract, base=current)
    return Prepared(plan, "merge", staged)


def _check_values(plan: Plan, current: Params | None) -> Prepared:
    """In place, pass 1: every tensor converted on the device for the finiteness pass and
    dropped once its check is dispatched; nothing kept."""
    _base(plan, current)  # a partial update with nothing to keep is refused now
    if plan.options.check_finite:
        hf_device.check_on_device(plan.cfg, plan.tensors, plan.chosen, plan.abstract)
    return Prepared(plan, "in_place")


def keeping(current: Params, replaced: frozenset[tuple[str | int, ...]]) -> Params:
    """New containers holding the leaves of `current` a partial update keeps; the replaced ones
    are left out, so dropping the serving state frees them."""
    kept = hf.copy_tree(current)
    for path in replaced:
        hf.set_leaf(kept, path, None)
    return kept


def write(prepared: Prepared, kept: Params | None) -> StagedParams:
    """In place, pass 2: the checked tensors converted into the room the dropped leaves left,
    not checked twice. `kept`: a partial update's kept leaves (`keeping`)."""
    plan = prepared.plan
    params = hf_device.hf_to_device(
        plan.cfg, plan.tensors, plan.chosen, plan.abstract, base=kept, check_finite=False
    )
    return StagedParams(served(plan, place_params(params, plan.abstract)), plan.abstract)


def served(plan: Plan, params: Params) -> Params:
    """The `quantize` step every strategy ends with: checked full-precision params become what
    the engine serves under `cfg.quantization` (`quantize.py`); without one, `params` as they are."""
    return quantize.serve(plan.cfg, params)


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    prepare: Callable[[Plan, Params | None], Prepared]  # pass 1 (plan, the serving base weights)
    writes_in_place: bool = False  # pass 2 (`write`) runs after the serving leaves are dropped


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("copy", _copy),
        Strategy("in_place", _check_values, writes_in_place=True),
        Strategy("merge", _merge),
    )
}


def strategy_for(plan: Plan, staging: str) -> Strategy:
    """An adapter merges; HF-named weights follow the engine's staging (`resolve`); everything
    else is already converted, so it is placed as it is (`copy`, zero copy where it can)."""
    if plan.kind == "adapter":
        return STRATEGIES["merge"]
    if plan.kind == "hf":
        return STRATEGIES[staging]
    return STRATEGIES["copy"]


def prepare(plan: Plan, staging: str, current: Params | None) -> Prepared:
    """Pass 1 of `plan` by its strategy row. `current`: the serving base weights (a partial
    update's kept leaves, an adapter's base). A delta's rows become whole tensors here, from
    `current` (the engine checked that it is the delta's base version)."""
    if plan.rows:
        full = delta.expanded(plan.rows, plan.chosen, _base(plan, current))
        plan = dataclasses.replace(plan, tensors={**plan.tensors, **full}, rows=None)
    return strategy_for(plan, staging).prepare(plan, current)

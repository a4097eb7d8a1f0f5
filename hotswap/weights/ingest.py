"""Validated, placed params for the engine: the end of the weight-ingest pipeline.

Every weight source ends here before a transition may consume it (`lifecycle.py`):
`sources.stage_source` reads a source, has it validated once by `model/validate.py`
(by its own names, before any conversion or, for a transfer or an orbax checkpoint,
before any byte moves) and placed on the engine's shardings with one finiteness pass
(`finiteness.py`), and hands it over as `StagedParams`. HF-named tensors are placed by
`hf_device.py`; params trees here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hotswap.model import validate
from hotswap.model.params import Params, path_name
from hotswap.weights import finiteness


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

    return jax.tree.map(put, params, abstract)


@dataclasses.dataclass(frozen=True)
class StagedParams:
    """Params already validated against `abstract` and placed on its shardings.

    Lets the engine validate and place (the slow part: a full read for the
    finiteness check, maybe a reshard) outside its lock, then swap without
    doing that work twice.
    """

    params: Params
    abstract: Params
    base: Params | None = (
        None  # the base weights `params` merged a LoRA adapter into; None: params are the base
    )


def check_params(
    params: Params, abstract: Params, *, check_finite: bool = True, validated: bool = False
) -> None:
    """A params tree validated (`validate.tree`, unless its reader `validated` it already, by
    its manifest or metadata) and checked for NaN/Inf, one pass over the leaves as they are."""
    if not validated:
        validate.tree(params, abstract)
    check = finiteness.Pass(check_finite)
    named = {path_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    check.add(named)
    check.raise_first(list(named))


def stage_params(
    params: Params, abstract: Params, *, check_finite: bool = True, validated: bool = False
) -> StagedParams:
    """A params tree -> checked (`check_params`) and placed (`place_params`)."""
    check_params(params, abstract, check_finite=check_finite, validated=validated)
    return StagedParams(place_params(params, abstract), abstract)

"""Validated, placed params for the engine: the end of the weight-ingest pipeline.

Every weight source ends here before a transition may consume it (`lifecycle.py`):
`sources.stage_source` turns a source into params and hands them over as
`StagedParams`, validated once and placed on the engine's shardings. A params tree
is validated by `validate_params` (tree, names, shapes, dtypes, finiteness);
HF-named tensors are validated by name, shape and dtype against the spec table
before their conversion (`checkpoint/hf.check_hf_tensors`), and the converted
tree, built from that table, is not validated a second time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.errors import NonFiniteWeights, WeightsMismatch
from hotswap.kernels import finite
from hotswap.model.params import Params, path_name


def validate_params(params: Params, abstract: Params, *, check_finite: bool = True) -> None:
    """Tree structure, shapes, dtypes, finiteness; raises a typed error naming the tensor.

    The finiteness check reads every weight once (`kernels/finite.py`: on one CPU
    device a C++ call, on TPU/GPU a reduction in HBM). A trainer that already
    guards its loss may skip it with check_finite=False; nothing else is skipped.
    """
    want = jax.tree_util.tree_flatten_with_path(abstract)[0]
    got_flat, got_def = jax.tree_util.tree_flatten_with_path(params)
    want_names = {path_name(p) for p, _ in want}
    got = {path_name(p): leaf for p, leaf in got_flat}
    missing = sorted(want_names - got.keys())
    extra = sorted(got.keys() - want_names)
    if missing:
        raise WeightsMismatch(
            f"missing tensor(s): {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "")
        )
    if extra:
        raise WeightsMismatch(
            f"unexpected tensor(s): {', '.join(extra[:5])}" + (" ..." if len(extra) > 5 else "")
        )
    if got_def != jax.tree.structure(abstract):
        raise WeightsMismatch(
            "params tree structure differs from the engine's (e.g. a tuple where a list is)"
        )
    for path, spec in want:
        name = path_name(path)
        leaf = got[name]
        shape, dtype = tuple(np.shape(leaf)), np.dtype(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype)
        if shape != tuple(spec.shape) or dtype != np.dtype(spec.dtype):
            raise WeightsMismatch(
                f"{name}: expected {tuple(spec.shape)} {np.dtype(spec.dtype)}, got {shape} {dtype}"
            )
    if check_finite:
        bad = finite.non_finite(got)
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise NonFiniteWeights(f"{bad[0]}: contains NaN or Inf{more}")


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


def stage_params(params: Params, abstract: Params, *, check_finite: bool = True) -> StagedParams:
    """A params tree -> validated (`validate_params`) and placed (`place_params`)."""
    validate_params(params, abstract, check_finite=check_finite)
    return StagedParams(place_params(params, abstract), abstract)

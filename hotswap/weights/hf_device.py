"""HF-named tensors -> engine params on the engine's devices: the weight-update path.

A checkpoint update is dominated by the layout change: HF linear weights are
`[out, in]`, params `[in, out]` with attention's heads split out (`params.py`,
the row's `from_hf` in the spec table). As a strided numpy copy on one core that
transpose is most of an update's time. Here each tensor goes to its devices in the file's layout (a plain
copy; on CPU none, jax adopts the aligned memmapped bytes) and a small jit per
shape converts it there into a fresh array on the engine's sharding. The heads
split is a reshape of the transposed result: the same bytes.

- On one CPU device with an exact cast (f32 or bf16 into the same dtype, bf16
  into f32), the jit is one C++ call (`kernels/cpu_convert.py`) that reads the
  tensor once, checks it for NaN/Inf while it is in registers and writes it once
  in the params layout: the update costs about a read and copy of the file's
  bytes. A tied head is made in a pass of its own: made in the embedding's copy, that
  copy would follow the transpose's strips instead of streaming.
- Elsewhere (TPU/GPU HBM, a sharded CPU mesh, another cast), XLA transposes and casts,
  and finiteness goes through the update's one pass (`finiteness.py`), over the
  converted values on the device (a cast can overflow); on CPU a source already
  in the engine's dtype is checked on the host just before its conversion,
  which then reads it from cache.

Largest tensors go first. On CPU the new weights are malloc'd while the old
ones still serve; allocated first, the big buffers reuse the holes the
previous generation left, rather than finding them split by smaller buffers
and faulting in fresh pages. The conversion stays in XLA's buffers, not numpy's:
under the engine's raised malloc thresholds (`host_memory.py`) those are reused
from one update to the next, where numpy's huge-page-backed buffers would make
the kernel compact huge pages during the first updates.

An output never shares its input's buffer: the input may view a memmapped
file or a caller's array, either of which can change after the update returns.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from hotswap.checkpoint import hf
from hotswap.kernels import cpu_convert
from hotswap.kernels.qtensor import QTensor, blocks_finite, is_qtensor
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params
from hotswap.model.spec import EMBED, ParamSpec, param_specs
from hotswap.weights import finiteness, quantize

# Host->device copies in flight before waiting for their conversions, in bytes a chip: bounds
# the extra device memory (inputs not yet converted) on backends where device_put copies, and
# what the KV sizing reserves for an update (`weights/place.py` `update_reserve`). 256 MiB
# is 10-25 ms of a chip's host transfers: enough to keep its conversions fed.
IN_FLIGHT_BYTES = 256 << 20


@functools.cache
def _converter(layout: ParamSpec, dtype: np.dtype, sharding):
    """jit: HF-layout array -> params layout (`layout.from_hf`) in `dtype` on `sharding`, a
    fresh buffer. `layout` is a row's `ParamSpec.layout`: one jit per transform and shape."""

    def convert(x):
        y = layout.from_hf(x)
        return (jnp.copy(y) if y is x else y).astype(dtype)  # copy: never hand back x itself

    if isinstance(sharding, (NamedSharding, SingleDeviceSharding)):
        return jax.jit(convert, out_shardings=sharding)
    return jax.jit(convert)  # an unusual sharding type: place_params reshards afterwards if needed


@functools.cache
def _fused_converter(layout: ParamSpec, dtype: np.dtype, sharding):
    """jit: HF-layout array -> (params-layout copy in `dtype` on `sharding`, finite flag) in
    one pass of the C++ kernel (`kernels/cpu_convert.py`): one CPU device, an exact cast."""
    return jax.jit(
        lambda x: cpu_convert.convert(x, layout.shape, layout.transpose, dtype),
        out_shardings=(sharding, sharding),
    )


def lower_conversion(spec: ParamSpec, dtype: np.dtype, sharding) -> jax.stages.Lowered:
    """The program that converts `spec`'s HF tensor on device, lowered from an abstract input
    placed as `hf_to_device` places it (`programs/catalog.py` compiles it ahead of time)."""
    src = jax.ShapeDtypeStruct(spec.hf_shape, dtype, sharding=_source_sharding(sharding, spec))
    return _converter(spec.layout, dtype, sharding).lower(src)


def _source_sharding(sharding, spec: ParamSpec):
    """Where the HF-layout tensor goes first: the target sharding laid out as the HF tensor
    (axes swapped for a transposed leaf, a merged heads dim sharded as its heads), so each
    device converts its own shard and nothing moves between them. None (default placement)
    where the HF layout cannot hold the target's split."""
    if not isinstance(sharding, (NamedSharding, SingleDeviceSharding)):
        return None
    if isinstance(sharding, SingleDeviceSharding) or (not spec.transpose and spec.matrix is None):
        return sharding
    target = tuple(sharding.spec) + (None,) * (len(spec.shape) - len(sharding.spec))
    hf_spec = []
    for dims in spec.hf_dims():
        # a merged dim splits evenly as its major dim does, only if the minor ones are whole
        if any(target[i] is not None for i in dims[1:]):
            return None
        hf_spec.append(target[dims[0]])
    return NamedSharding(sharding.mesh, PartitionSpec(*hf_spec), memory_kind=sharding.memory_kind)


def _put(array: Any, sharding) -> jax.Array:
    """Host or device array -> device, layout and values unchanged (may alias host memory)."""
    if not isinstance(array, (np.ndarray, jax.Array)):
        array = np.asarray(array)
    canonical = jax.dtypes.canonicalize_dtype(array.dtype)
    if canonical != array.dtype:  # float64 without jax_enable_x64: cast here, as jax would (with a warning)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow shows up as a non-finite flag
            array = np.asarray(array).astype(canonical)
    return jax.device_put(array, sharding) if sharding is not None else jax.device_put(array)


def _blocks(q: QTensor, sharding) -> tuple[QTensor, jax.Array]:
    """A host QTensor of GGUF blocks on the device (whole on each of the target's devices:
    block rows are not split), and its finiteness flag (the decoded values, f16 scales
    included, all finite)."""
    where = sharding
    if isinstance(sharding, NamedSharding):
        where = NamedSharding(sharding.mesh, PartitionSpec())
    # A copy of the file's bytes, never a view: XLA:CPU may alias the host array it is given,
    # and a view would keep the whole memory-mapped file (every tensor's pages) resident.
    host = np.array(q.data, copy=True)
    flag = np.bool_(blocks_finite(host, q.fmt, q.k))  # the scales, on the host: no decoded copy
    data = _put(host, where if isinstance(where, (NamedSharding, SingleDeviceSharding)) else None)
    return dataclasses.replace(q, data=data), flag


def _chip_bytes(x: jax.Array) -> int:
    """Bytes of `x` on each chip it is split over (all of it where it is replicated)."""
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


# ---- where the conversion runs ---------------------------------------------------------------


def _on_cpu(sharding) -> bool:
    devices = sharding.device_set if sharding is not None else {jax.devices()[0]}
    return all(d.platform == "cpu" for d in devices)


def _fused(x: jax.Array, dtype: np.dtype, sharding) -> bool:
    """Convert with the C++ kernel, which checks finiteness in the same pass? On one CPU
    device, when the cast is exact (so the values it checks are the params' values), for a
    matrix or vector (the kernel transposes 2-D arrays; stacked experts go through XLA)."""
    return x.ndim <= 2 and _on_cpu(sharding) and cpu_convert.usable(x.dtype, dtype, sharding)


# ---- the update ---------------------------------------------------------------------------


def hf_to_device(
    cfg: ModelConfig,
    tensors: Mapping[str, Any],
    chosen: Mapping[str, ParamSpec],
    abstract: Params,
    *,
    base: Params | None = None,
    check_finite: bool = True,
) -> Params:
    """HF-named `[out, in]` tensors -> params on `abstract`'s shardings and dtypes, a quantized
    row quantized as soon as it is converted (`quantize.serve_leaf`).

    `chosen`: each tensor's spec row, as the plan checked them (`weights/plan.py`; experts
    stacked in `tensors`). With `check_finite`, a NaN/Inf raises NonFiniteWeights naming the
    HF tensor. With `base` (the current params) `tensors` may be any subset; the other leaves
    are the base's, unchanged and uncopied. For tied models a new embedding also rebuilds
    `lm_head`.
    """
    new, head = _convert(cfg, tensors, chosen, abstract, check_finite=check_finite)
    params = hf.empty_tree(cfg) if base is None else hf.copy_tree(base)
    for name, spec in chosen.items():
        hf.set_leaf(params, spec.path, new[name])
    if head is not None:
        params["lm_head"] = head
    # Returned when ready, so the time of an update is the time of its copies, and an
    # error (say, out of device memory) surfaces here, not in the next step.
    return jax.block_until_ready(params)


def check_on_device(
    cfg: ModelConfig, tensors: Mapping[str, Any], chosen: Mapping[str, ParamSpec], abstract: Params
) -> None:
    """`hf_to_device`'s NaN/Inf pass over the converted values with nothing kept: each
    converted tensor is dropped once its flag is dispatched, so the device holds only the
    tensors in flight (`weights/place.py`, in place)."""
    _convert(cfg, tensors, chosen, abstract, check_finite=True, keep=False)


def _convert(
    cfg: ModelConfig,
    tensors: Mapping[str, Any],
    chosen: Mapping[str, ParamSpec],
    abstract: Params,
    *,
    check_finite: bool,
    keep: bool = True,
) -> tuple[dict[str, jax.Array], jax.Array | None]:
    """Convert each chosen tensor onto the device, largest first, with the finiteness pass.
    Returns (converted arrays by HF name, the tied head or None); with `keep=False` no array
    is kept."""
    head_want, head = abstract["lm_head"], None
    head_spec = param_specs(cfg)["lm_head"]
    head_layout = head_spec.layout  # [V, D] -> [D, V]: the embedding's transpose
    new: dict[str, jax.Array] = {}
    dtypes: dict[str, np.dtype] = {}
    check = finiteness.Check(check_finite)
    pending, pending_bytes = [], 0
    for name in sorted(chosen, key=lambda n: -hf.get_leaf(abstract, chosen[n].path).size):  # big first
        spec, want = chosen[name], hf.get_leaf(abstract, chosen[name].path)
        src, dtype = tensors[name], np.dtype(want.dtype)
        if is_qtensor(src):  # a GGUF's blocks: moved as they are, checked as they decode
            out, flag = _blocks(src, want.sharding)
            check.add_flag(name, flag)
            if keep:
                new[name] = out
                if name == EMBED and cfg.tie_word_embeddings:
                    head = out  # the embedding's blocks are the [D, V] head (`gguf_io.blocks_of`)
            dtypes[name] = np.dtype(np.uint8)
            continue
        x = _put(src, _source_sharding(want.sharding, spec))
        if _fused(x, dtype, want.sharding):
            out, flag = _fused_converter(spec.layout, dtype, want.sharding)(x)
            check.add_flag(name, flag)
        else:
            on_host = check.before(name, src, dtype, _on_cpu(want.sharding))
            out = _converter(spec.layout, dtype, want.sharding)(x)
            if not on_host:
                check.add({name: out})  # the converted values: a cast can overflow
        dtypes[name] = out.dtype
        # The tied head now, while big holes are whole (above); unkept, it is a transpose of
        # checked values, with nothing more to check.
        if keep and name == EMBED and cfg.tie_word_embeddings:
            head_dtype = np.dtype(head_want.dtype)
            if _fused(out, head_dtype, head_want.sharding):
                head, _ = _fused_converter(head_layout, head_dtype, head_want.sharding)(out)
            else:
                head = _converter(head_layout, head_dtype, head_want.sharding)(out)
            head = quantize.serve_leaf(cfg, head_spec, head)
        if keep:  # quantized now (a quantized row): its dense form lives only while in flight
            new[name] = quantize.serve_leaf(cfg, spec, out)
        pending.append(out)  # unkept, held until the wait below: bounds what is in flight
        pending_bytes += _chip_bytes(x)
        if pending_bytes > IN_FLIGHT_BYTES:
            jax.block_until_ready(pending)
            pending, pending_bytes = [], 0
        del out, x
    check.raise_first(list(chosen), tensors, dtypes)  # checkpoint order
    return new, head

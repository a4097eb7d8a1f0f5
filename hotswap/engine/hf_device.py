"""HF-named tensors -> engine params on the engine's devices: the weight-update path.

A checkpoint update is dominated by the layout change: HF linear weights are
`[out, in]`, params `[in, out]` (`params.py`). As one strided numpy copy per
tensor that is about a nanosecond per element on one core (0.4 s of a 0.6 s
update of a 100M f32 model). Here a tensor goes to its devices in the file's
layout (a plain copy; on CPU none, jax adopts an aligned host buffer) and a
small jit per shape transposes and casts it there, writing a fresh array on the
engine's sharding: XLA's transpose is vectorised and multi-threaded on CPU, and
runs in HBM on TPU/GPU. Finiteness is one vectorised reduction per tensor, on
the converted values (a cast can overflow).

On CPU, where device memory is host memory, tensors that need no transpose and
big ones (the embedding, its tied head) are converted by numpy instead, in row
slabs that are copied, transposed and checked while in cache. The reason is
the allocator, not arithmetic: under glibc's default thresholds XLA maps each
big output on fresh 4 KiB pages, and faulting those in costs more than the
copy (a 98 MB tied head: 24k faults, ~60 ms from XLA; ~20 ms from numpy,
whose big buffers get huge pages). With the engine's raised thresholds
(`host_memory.py`) both cost the same; without them (another libc,
HOTSWAP_MALLOC_TUNING=0) the numpy route makes a 100M-model update 1.5x faster.

An output never shares its input's buffer: the input may view a memmapped
file or a caller's array, either of which can change after the update returns.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from hotswap.checkpoint import hf
from hotswap.config import ModelConfig
from hotswap.engine.lifecycle import all_finite
from hotswap.engine.params import Params

# Host->device copies in flight before waiting for their conversions: bounds the extra
# device memory (inputs not yet converted) on backends where device_put copies.
_IN_FLIGHT_BYTES = 1 << 30
# On CPU, transposes at least this big run in numpy (see the module doc): glibc serves any
# allocation over 32 MiB (its largest mmap threshold) from freshly mapped pages.
_HOST_TRANSPOSE_BYTES = 32 << 20
# Row slab of the host conversion: small enough to stay in L2 while it is read three ways.
_SLAB_BYTES = 96 << 10


@functools.cache
def _converter(transpose: bool, dtype: np.dtype, sharding):
    """jit: HF-layout array -> params-layout array in `dtype` on `sharding`, a fresh buffer."""

    def convert(x):
        return (x.T if transpose else jnp.copy(x)).astype(dtype)  # copy: never hand back x itself

    if isinstance(sharding, (NamedSharding, SingleDeviceSharding)):
        return jax.jit(convert, out_shardings=sharding)
    return jax.jit(convert)  # an unusual sharding type: place_params reshards afterwards if needed


_finite = jax.jit(all_finite)  # one call per tensor: compiled per shape, so any subset reuses it


def _source_sharding(sharding, transpose: bool):
    """Where the HF-layout tensor goes first: the target sharding with its axes swapped for a
    transposed leaf, so each device transposes its own shard and nothing moves between them."""
    if not isinstance(sharding, (NamedSharding, SingleDeviceSharding)):
        return None
    if not transpose or isinstance(sharding, SingleDeviceSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*reversed(spec)), memory_kind=sharding.memory_kind)


def _put(array: Any, sharding) -> jax.Array:
    """Host or device array -> device, layout and values unchanged (may alias host memory)."""
    if not isinstance(array, (np.ndarray, jax.Array)):
        array = np.asarray(array)
    canonical = jax.dtypes.canonicalize_dtype(array.dtype)
    if canonical != array.dtype:  # float64 without jax_enable_x64: cast here, as jax would (with a warning)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow shows up as a non-finite flag
            array = np.asarray(array).astype(canonical)
    return jax.device_put(array, sharding) if sharding is not None else jax.device_put(array)


# ---- the CPU host path ------------------------------------------------------------------


def _on_cpu(sharding) -> bool:
    devices = sharding.device_set if sharding is not None else {jax.devices()[0]}
    return all(d.platform == "cpu" for d in devices)


def _host_path(array: Any, transpose: bool, want: jax.ShapeDtypeStruct) -> bool:
    """Convert this tensor in numpy? Only a host array bound for CPU devices, and only when
    numpy is the faster converter there: no transpose, or one too big for XLA's allocator."""
    if not isinstance(array, np.ndarray) or not _on_cpu(want.sharding):
        return False
    return not transpose or array.size * np.dtype(want.dtype).itemsize >= _HOST_TRANSPOSE_BYTES


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """At a 64-byte boundary, which jax's CPU client adopts as a device buffer without a copy."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = np.empty(nbytes + 64, np.uint8)
    start = -buf.ctypes.data % 64
    return buf[start : start + nbytes].view(dtype).reshape(shape)


def _host_convert(
    a: np.ndarray, transpose: bool, dtype: np.dtype, *, with_transpose: bool, check: bool
) -> tuple[np.ndarray, np.ndarray | None, bool]:
    """HF-layout `a` -> (params-layout copy in `dtype`, its transpose if asked, all finite?).

    One pass over row slabs of `a`: each slab is cast, written to its place in
    the output (and transposed into the second output: the tied head), and
    checked, while it is in cache.
    """
    rows = a.reshape(a.shape[0], int(np.prod(a.shape[1:], dtype=np.int64)))  # [R, C]
    out = _aligned_empty(a.shape[::-1] if transpose else a.shape, dtype)
    out_rows = out if transpose else out.reshape(rows.shape)
    out_t = _aligned_empty(a.shape[::-1], dtype) if with_transpose else None
    step = max(1, _SLAB_BYTES // max(1, rows.shape[1] * dtype.itemsize))
    finite = True
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is caught by the check
        for i in range(0, rows.shape[0], step):
            slab = rows[i : i + step].astype(dtype, copy=False)  # [r, C]
            if transpose:
                out_rows[:, i : i + step] = slab.T
            else:
                out_rows[i : i + step] = slab
            if out_t is not None:
                out_t[:, i : i + step] = slab.T
            if check and finite:
                finite = bool(np.isfinite(slab).all())
    return out, out_t, finite


def _check_source_on_host(src: Any, dtype: np.dtype, sharding) -> bool:
    """Let numpy check finiteness on the source instead of the device on the output?

    On CPU, for a numpy source already in the engine's dtype (so the same
    values): reading it first pulls it into cache for the transpose that
    follows (~8% faster overall), and leaves no device scalar to fetch.
    """
    return isinstance(src, np.ndarray) and src.dtype == dtype and _on_cpu(sharding)


# ---- the update ---------------------------------------------------------------------------


def hf_to_device(
    cfg: ModelConfig,
    tensors: Mapping[str, Any],
    abstract: Params,
    *,
    base: Params | None = None,
    check_finite: bool = True,
) -> Params:
    """HF-named `[out, in]` tensors -> params on `abstract`'s shardings and dtypes.

    Names, shapes and dtypes are checked (`hf.check_hf_tensors`) before any
    copy. With `check_finite`, a NaN/Inf raises NonFiniteWeights naming the HF
    tensor. With `base` (the current params) `tensors` may be any subset; the
    other leaves are the base's, unchanged and uncopied. For tied models a new
    embedding also rebuilds `lm_head`.
    """
    target = np.dtype(abstract["embed"].dtype)
    chosen = hf.check_hf_tensors(cfg, tensors, target, partial=base is not None)
    head_want = abstract["lm_head"]
    new: dict[str, jax.Array] = {}
    finite: dict[str, Any] = {}  # bools and device scalars
    head = None
    pending, pending_bytes = [], 0
    for name, spec in chosen.items():
        want = hf.get_leaf(abstract, spec.path)
        src, dtype = tensors[name], np.dtype(want.dtype)
        if _host_path(src, spec.transpose, want):
            tied = cfg.tie_word_embeddings and name == hf.EMBED and _on_cpu(head_want.sharding)
            out, out_t, finite[name] = _host_convert(
                src, spec.transpose, dtype, with_transpose=tied, check=check_finite
            )
            new[name] = _put(out, want.sharding)
            if out_t is not None:
                head = _put(out_t, head_want.sharding)
            continue
        if check_finite and _check_source_on_host(src, dtype, want.sharding):
            finite[name] = bool(np.isfinite(src).all())
        x = _put(src, _source_sharding(want.sharding, spec.transpose))
        new[name] = _converter(spec.transpose, dtype, want.sharding)(x)
        if check_finite and name not in finite:
            finite[name] = _finite(new[name])  # on the converted values: a cast can overflow
        pending.append(new[name])
        pending_bytes += x.nbytes
        if pending_bytes > _IN_FLIGHT_BYTES:
            jax.block_until_ready(pending)
            pending, pending_bytes = [], 0
    if check_finite:
        bad = [n for n, ok in zip(finite, jax.device_get(list(finite.values())), strict=True) if not ok]
        if bad:
            raise hf.non_finite_error(bad[0], tensors[bad[0]], np.dtype(new[bad[0]].dtype), more=len(bad) - 1)
    params = hf.empty_tree(cfg) if base is None else hf.copy_tree(base)
    for name, spec in chosen.items():
        hf.set_leaf(params, spec.path, new[name])
    if cfg.tie_word_embeddings and hf.EMBED in chosen:
        if head is None:  # the embedding is on the device: transpose it there
            head = _converter(True, np.dtype(head_want.dtype), head_want.sharding)(params["embed"])
        params["lm_head"] = head
    # Returned when ready, so the time of an update is the time of its copies, and an
    # error (say, out of device memory) surfaces here, not in the next step.
    return jax.block_until_ready(params)

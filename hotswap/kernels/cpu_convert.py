"""An HF tensor into the params layout and checked for NaN/Inf in one pass, on XLA:CPU: a C++
FFI call (`cpu/convert_finite.cc`), the CPU route of a checkpoint update (`weights/hf_device.py`).

An update from an HF directory reads every weight from the file and writes it into a new
buffer, transposing `[out, in]` to `[in, out]` on the way for most tensors (and widening a
bf16 checkpoint for an f32 engine). A numpy
finiteness pass over the file, then XLA's transpose, read every byte twice, and the transpose
ran well below memory speed; the kernel reads each tensor once (16-row strips for a transpose)
over XLA's intra-op threads, checks it while it is in registers, and writes the output once, so
an update costs about what a plain read and copy of the same bytes costs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.kernels import cpu_build

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
# (source, target) pairs the kernel converts: none changes a value (a bf16 widened to f32 is
# exact), so finiteness checked on the source is finiteness of the params.
PAIRS = ((F32, F32), (BF16, BF16), (BF16, F32))


def usable(dtype: np.dtype, target: np.dtype, sharding) -> bool:
    """True when the kernel can convert an array of `dtype` into `target` on `sharding`: one
    of `PAIRS`, one CPU device, and the kernels build here."""
    return (
        (np.dtype(dtype), np.dtype(target)) in PAIRS
        and sharding is not None
        and len(sharding.device_set) == 1
        and all(d.platform == "cpu" for d in sharding.device_set)
        and cpu_build.available()
    )


def convert(
    x: jax.Array, shape: tuple[int, ...], transpose: bool, dtype: np.dtype | None = None
) -> tuple[jax.Array, jax.Array]:
    """(y, ok): y of `shape` and `dtype` (default x's) holding `x.T`'s values (x 2-D) when
    `transpose`, else x's, in a fresh buffer; ok a bool scalar, True when x holds no NaN or
    Inf. Call inside jit."""
    target = cpu_build.register("convert_finite", "HotswapConvertFinite")
    y, ok = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct(shape, dtype or x.dtype), jax.ShapeDtypeStruct((), jnp.uint8)),
    )(x, transpose=np.int64(bool(transpose)))
    return y, ok.astype(bool)


def convert_jnp(
    x: jax.Array, shape: tuple[int, ...], transpose: bool, dtype: np.dtype | None = None
) -> tuple[jax.Array, jax.Array]:
    """The jnp twin of `convert` (the oracle in tests)."""
    y = (x.T if transpose else x).reshape(shape).astype(dtype or x.dtype)
    return jnp.copy(y), jnp.isfinite(x).all()

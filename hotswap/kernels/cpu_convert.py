"""An HF tensor into the params layout and checked for NaN/Inf in one pass, on XLA:CPU: a C++
FFI call (`cpu/convert_finite.cc`), the CPU route of a checkpoint update (`engine/hf_device.py`).

An update from an HF directory reads every weight from the file and writes it into a new
buffer, transposing `[out, in]` to `[in, out]` on the way for most tensors. A numpy
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

DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


def usable(dtype: np.dtype, target: np.dtype, sharding) -> bool:
    """True when the kernel can convert an array of `dtype` into `target` on `sharding`: no
    cast (the check then reads the same values the params get), f32 or bf16, one CPU
    device, and the kernels build here."""
    return (
        np.dtype(dtype) == np.dtype(target)
        and np.dtype(target) in DTYPES
        and sharding is not None
        and len(sharding.device_set) == 1
        and all(d.platform == "cpu" for d in sharding.device_set)
        and cpu_build.available()
    )


def convert(x: jax.Array, shape: tuple[int, ...], transpose: bool) -> tuple[jax.Array, jax.Array]:
    """(y, ok): y of `shape` holding `x.T`'s bytes (x 2-D) when `transpose`, else x's bytes, in
    a fresh buffer; ok a bool scalar, True when x holds no NaN or Inf. Call inside jit."""
    target = cpu_build.register("convert_finite", "HotswapConvertFinite")
    y, ok = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct(shape, x.dtype), jax.ShapeDtypeStruct((), jnp.uint8)),
    )(x, transpose=np.int64(bool(transpose)))
    return y, ok.astype(bool)

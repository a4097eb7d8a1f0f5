"""Whether each weight is free of NaN and Inf, on XLA:CPU: a C++ FFI call (`cpu/all_finite.cc`).

`update_weights` checks every new weight before it swaps them in. The check reads each
weight byte once, so memory bandwidth bounds it, and XLA:CPU's reductions run one array at
a time well below that bound; the kernel shares 1 MB pieces of all the arrays out
over XLA's intra-op threads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hotswap.kernels import cpu_build

DTYPES = (jnp.float32, jnp.bfloat16)


def usable(leaves: list[jax.Array]) -> bool:
    """True when the kernel can check these arrays: the CPU backend, each array on one
    device, f32 or bf16, and the kernels build here."""
    return (
        bool(leaves)
        and jax.default_backend() == "cpu"
        and all(x.dtype in DTYPES and len(x.sharding.device_set) == 1 for x in leaves)
        and cpu_build.available()
    )


def all_finite(leaves: list[jax.Array]) -> jax.Array:
    """bool [len(leaves)]: True where the array has no NaN or Inf (call inside jit)."""
    target = cpu_build.register("all_finite", "HotswapAllFinite")
    ok = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((len(leaves),), jnp.uint8))(*leaves)
    return ok.astype(bool)

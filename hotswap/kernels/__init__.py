"""Attention kernels. `kernels/` imports nothing from `engine/`.

`attention(..., impl=)` is the write-then-read entry point (the Pallas kernel, and
`reference.paged_attention` as its oracle). The engine's CPU paths read the cache as it
was before the step plus the step's own K/V: `reference.decode_attention` /
`prefill_attention` (jnp) and `cpu_attention.paged_attention` (C++), which
`resolve_attention` picks between.

Beside the attention, the CPU backend's other C++ calls (`cpu/`, built by `cpu_build`):
`cpu_matmul` (decode-sized matmuls), `cpu_sampling` (each logits row's argmax and
logsumexp) and `cpu_finite` (the NaN/Inf check of new weights).
"""

from __future__ import annotations

import jax

from hotswap.errors import ConfigError
from hotswap.kernels import reference

IMPLS = ("reference", "pallas", "pallas_compiled")  # attention()'s
# "pallas_compiled": the Pallas kernel compiled by Mosaic whatever the default backend is, for
# TPU programs compiled ahead of time on a CPU host (`hotswap/aot.py`); "pallas" interprets it
# unless the default backend is a TPU.
# Impls that read the cache as it was before the step plus the step's own K/V.
READS_BEFORE_STEP = ("reference", "cpu")
# Of those, the ones whose pages come back untouched: the engine writes the step's K/V in a
# separate donated call. (The C++ kernel writes them itself, into its aliased page output.)
READ_THEN_WRITE = ("reference",)


def attention(q, pages, block_tables, q_positions, kv_lens, *, scale: float, impl: str = "reference"):
    """Causal paged attention; see `reference.paged_attention` for shapes."""
    if impl == "reference":
        return reference.paged_attention(q, pages, block_tables, q_positions, kv_lens, scale=scale)
    if impl in ("pallas", "pallas_compiled"):
        from hotswap.kernels import ragged_paged_attention

        interpret = False if impl == "pallas_compiled" else None
        return ragged_paged_attention.paged_attention(
            q, pages, block_tables, q_positions, kv_lens, scale=scale, interpret=interpret
        )
    raise ValueError(f"unknown attention impl {impl!r}; use one of {IMPLS}")


# The dtypes the C++ attention reads and writes (activations and pages): f32 and bf16, with f32
# softmax and accumulation either way. The C++ matmuls and sampler statistics take f32 only; a
# bf16 step runs its matmuls on XLA's dot (f32 accumulation) and its logits are f32 (model.py).
CPU_DTYPES = ("float32", "bfloat16")


def resolve_attention(impl: str, kv_sharding=None, dtype: str = "float32") -> str:
    """The impl "auto" stands for here: the C++ kernel on the CPU backend when it builds, the
    KV cache sits on one device and its `dtype` is one the kernel takes (`CPU_DTYPES`), else
    the jnp reference. The C++ kernel is an opaque custom call, so GSPMD could not keep a
    head-sharded cache local around it."""
    one_device = kv_sharding is None or len(kv_sharding.device_set) == 1
    on_cpu = jax.default_backend() == "cpu"
    if impl == "cpu" and not (on_cpu and one_device):
        raise ConfigError(
            "attention='cpu' runs on the CPU backend with the KV cache on one device; "
            f"here the backend is {jax.default_backend()!r} and the cache spans "
            f"{1 if kv_sharding is None else len(kv_sharding.device_set)} device(s): use 'auto'"
        )
    if impl == "cpu" and dtype not in CPU_DTYPES:
        raise ConfigError(
            f"attention='cpu' takes dtype {' or '.join(CPU_DTYPES)}, not {dtype!r}: "
            "use attention='auto' (the jnp reference for this dtype) or another dtype"
        )
    if impl != "auto":
        return impl
    if on_cpu and one_device and dtype in CPU_DTYPES:
        from hotswap.kernels import cpu_build

        if cpu_build.available():
            return "cpu"
    return "reference"

"""Attention and the other kernels a step runs. `kernels/` imports nothing from `engine/`.

`backend.Backend` decides, once per engine, which of them a step uses and the page layout they
read: the Pallas kernel (`ragged_paged_attention`, TPU; interpreted elsewhere), the C++ XLA FFI
kernels of the CPU backend (`cpu/`, built by `cpu_build`: `cpu_attention`, `cpu_matmul` for
decode-sized matmuls, `cpu_sampling` for each logits row's argmax and logsumexp), or the jnp
`reference` (the oracle in tests, and the default elsewhere). `finite` is the NaN/Inf check of
new weights (with `cpu_finite`, its C++ path).
"""

"""Attention kernels. `kernels/` imports nothing from `engine/`.

`attention(..., impl=)` is the one entry point the model calls; every
implementation has the signature of `reference.paged_attention`.
"""

from __future__ import annotations

from hotswap.kernels import reference

IMPLS = ("reference", "pallas")


def attention(q, pages, block_tables, q_positions, kv_lens, *, scale: float, impl: str = "reference"):
    """Causal paged attention; see `reference.paged_attention` for shapes."""
    if impl == "reference":
        return reference.paged_attention(q, pages, block_tables, q_positions, kv_lens, scale=scale)
    if impl == "pallas":
        from hotswap.kernels import ragged_paged_attention

        return ragged_paged_attention.paged_attention(
            q, pages, block_tables, q_positions, kv_lens, scale=scale
        )
    raise ValueError(f"unknown attention impl {impl!r}; use one of {IMPLS}")

"""Paged attention for XLA:CPU: a C++ XLA FFI custom call (`cpu/paged_attention.cc`).

The jnp reference gathers every page a row reads into a new buffer and then runs many
tiny dots; on XLA:CPU that was most of a decode step. The C++ kernel reads the keys in
place through the block table with an online softmax, on XLA's intra-op threads. It has
the semantics of `reference.decode_attention` / `prefill_attention` (the cache as it was
before the step, plus the step's own K/V), and then writes the step's K/V itself into the
page buffer it aliases to its output: one custom call per layer, and no separate donated
write call per step (one pass over the step's new K/V instead of two programs).

The kernel is built on first use (`cpu_build.py`); the engine's `attention="auto"` uses
it on the CPU backend when it builds, else the jnp reference.

Paths (`cpu_isa`, picked per call; the engine asks for "auto", the best this CPU runs):
"avx512_bf16" reads bf16 pages as they are and dots them with AVX512_BF16's vdpbf16ps (q is
split once per query into a bf16 high part and a bf16 remainder, and each head's pair of softmax
weights is rounded to bf16 for p.V: `cpu/attention_bf16.h`; f32 pages take the "avx512" fold); "avx512" and "avx2"
widen bf16 pages to f32 and fold with f32 FMAs; "scalar" is plain loops (any CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.kernels import cpu_build, cpu_isa, reference

# The kernel's paths, best first (`kOffered` in cpu/paged_attention.cc).
PATHS = ("avx512_bf16", "avx512", "avx2", "scalar")


def runnable() -> list[str]:
    """The kernel's paths this CPU runs, best first: the ones tests check against the reference."""
    return [p for p in cpu_isa.runnable() if p in PATHS]


def paged_attention(
    q: jax.Array,
    pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    block_tables: jax.Array,
    q_positions: jax.Array,
    chunk_starts: jax.Array,
    kv_lens: jax.Array,
    *,
    scale: float,
    slots: jax.Array | None = None,
    fixed: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    isa: str = "auto",
):
    """Attention of a [B, C] step over the cache before the step plus the step's own K/V.

    q: [B, C, Hq, hd]; pages: [num_pages, page_size, 2*Hkv, hd] (read only); k_new, v_new:
    [B, C, Hkv, hd]; block_tables: int32 [B, P] (only the pages before each chunk are read);
    q_positions: int32 [B, C]; chunk_starts, kv_lens: int32 [B]. Row b's chunk starts at
    chunk_starts[b] and its tokens sit end to end in the flattened [B*C] step (several rows
    of one sequence in a packed prefill; one token per row in decode). Queries at or past
    kv_lens[b] are padding and come back as zeros.

    With `slots` (int32 [B, C], flat page * page_size + offset), the same call then writes
    the step's K/V into `pages` in place and returns (out, pages): the page operand is
    aliased to the second output, so a step that donates its pages pays no copy and no
    separate write call. Without, it returns out.

    `fixed` (deterministic mode): every query folds its keys in 16-key blocks at fixed absolute
    positions, so its output is the same bits whichever chunk, step or prefix hit it came in
    (`RunHeadsFixed` in the kernel); else blocks follow pages and chunk starts.

    `window`, `softcap`: the layer's static sliding window and logit softcap (`reference`
    module doc). A query reads no page wholly before its window: a decode at 2,048 tokens with
    window 512 reads 512 to 512 + page_size keys.

    `isa`: the CPU path (module doc; "auto": the best this CPU runs). A path the CPU lacks is an
    error when the call runs.
    """
    reference.check_window(window, softcap)
    attrs = dict(
        scale=np.float32(scale),
        fixed=bool(fixed),
        window=np.int64(window or 0),  # 0: none
        softcap=np.float32(softcap or 0.0),
        isa=cpu_isa.attribute(isa),
    )
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    args = [q, pages, k_new.astype(q.dtype), v_new.astype(q.dtype)]
    args += [i32(block_tables), i32(q_positions), i32(chunk_starts), i32(kv_lens)]
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    if slots is None:
        target = cpu_build.register("paged_attention", "HotswapPagedAttention")
        return jax.ffi.ffi_call(target, out)(*args, **attrs)
    target = cpu_build.register("paged_attention", "HotswapPagedAttentionWrite")
    pages_out = jax.ShapeDtypeStruct(pages.shape, pages.dtype)
    call = jax.ffi.ffi_call(target, (out, pages_out), input_output_aliases={1: 1})
    return call(*args, i32(slots), **attrs)

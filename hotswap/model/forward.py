"""Llama-family forward pass (Llama 2/3, Mistral, Qwen2/2.5, Qwen3; Qwen3-MoE and Mixtral with
sparse MLPs, `moe.py`) as pure functions; Gemma's layer is its own module (`gemma.py`), entered
from here.

Params are always an argument (layout in `params.py`), never closed over, so a
weight swap with the same shapes reuses every compiled step. Layers are a
Python loop (unrolled) over per-layer arrays, not `lax.scan` over stacked weights: each
layer's weights and KV buffer are arrays of their own (donated one by one, swapped one by
one), and XLA:CPU runs the unrolled program several times faster than the scan.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from hotswap.kernels import reference
from hotswap.kernels.backend import Backend, jnp_matmuls, jnp_mean_square
from hotswap.kernels.qtensor import take_rows
from hotswap.model import gemma, lora, moe
from hotswap.model.batch import Batch
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params
from hotswap.model.rope import apply_rope, rope_inv_freq, rope_tables


def rms_norm(x: jax.Array, w: jax.Array, eps: float, mean_square=jnp_mean_square) -> jax.Array:
    """`mean_square`: the Backend's (`Backend.mean_square`), [..., D] f32 -> [..., 1]."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(mean_square(xf) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def _qkv(lp: dict, cfg: ModelConfig, h: jax.Array, rope, mms=jnp_matmuls, ms=jnp_mean_square):
    """h: [..., D] -> q [..., Hq, hd], k/v [..., Hkv, hd] with bias, qk-norm and rope applied.
    `mms` is the matmul routine (`Backend.matmuls`), `ms` the norms' mean of squares
    (`Backend.mean_square`); wq [D, Hq, hd], wk/wv [D, Hkv, hd]."""
    q, k, v = lora.add(lp, h, ("wq", "wk", "wv"), mms(h, (lp["wq"], lp["wk"], lp["wv"])))
    if cfg.qkv_bias:  # biases are flat [H*hd], as checkpoints store them
        q = q + lp["bq"].reshape(cfg.num_heads, cfg.head_dim)
        k = k + lp["bk"].reshape(cfg.num_kv_heads, cfg.head_dim)
        v = v + lp["bv"].reshape(cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps, ms)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps, ms)
    return apply_rope(q, rope), apply_rope(k, rope), v


def _mlp(lp: dict, cfg: ModelConfig, x: jax.Array, mms=jnp_matmuls, ms=jnp_mean_square, backend=None):
    """(x + MLP(x), the experts each token was routed to [..., k], or None in a dense layer).
    `backend` runs a sparse layer's router and experts (`moe.sparse_mlp`; None: XLA's)."""
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps, ms)
    if "router" in lp:  # a sparse layer (model/moe.py)
        y, routed = moe.sparse_mlp(lp, cfg, h, backend)
        return x + y, routed
    gate, up = lora.add(lp, h, ("w_gate", "w_up"), mms(h, (lp["w_gate"], lp["w_up"])))
    act = jax.nn.silu(gate) * up
    return x + lora.add(lp, act, ("w_down",), mms(act, (lp["w_down"],)))[0], None


def forward_paged(
    params: Params, pages: tuple[jax.Array, ...], batch: Batch, *, cfg: ModelConfig, backend: Backend
):
    """One engine step over `batch` ([B, C] tokens: a decode batch or a packed prefill, batch.py).

    Returns (final hidden [B, C, D], new_kv, pages, routed) where new_kv is this step's (K, V)
    per layer, each [B, C, Hkv, hd], and routed the experts each token went to in each sparse
    layer, [B, C, len(cfg.moe_layers), k] int32 (None for a dense model).

    With a `read_then_write` backend (the jnp reference), attention reads the cache as it was
    before the step plus the step's own K/V, and `pages` come back untouched; the caller writes
    new_kv with `write_pages` in a separate donated call. Fusing XLA's scatter with the
    reads in one CPU program makes XLA copy every layer's whole page buffer each step. The C++ kernel reads the same way, then writes the step's K/V itself into
    the page buffer it aliases to its output; Pallas writes first and reads the
    updated pages (both custom calls, so nothing fuses across them). Both return the
    updated `pages`.
    """
    if cfg.is_gemma:  # dense: no routing record
        return (*gemma.forward_paged(params, pages, batch, cfg=cfg, backend=backend), None)
    rope = rope_tables(batch.positions, rope_inv_freq(cfg))
    x = take_rows(params["embed"], batch.tokens, cfg.dtype)  # [B, C, D]: a dense table, or a GGUF's blocks
    new_kv, new_pages, routed = [], [], []
    adapters = params.get("lora")  # adapters served by name: each row's own (model/lora.py)
    mask = None if adapters is None else lora.row_mask(batch.adapters, adapters["col_slot"], x.dtype)
    for i, (lp, layer_pages) in enumerate(zip(params["layers"], pages, strict=True)):
        if adapters is not None:
            lp = lora.with_layer(lp, adapters["layers"][i], mask)
        window = cfg.layer_window(i)  # Mistral's sliding window, else None
        seen = batch if window is None else batch.windowed()  # the window pool's pages
        x, kv, layer_pages, experts = _layer(
            lp, x, layer_pages, seen, rope, window=window, cfg=cfg, backend=backend
        )
        new_kv.append(kv)
        new_pages.append(layer_pages)
        if experts is not None:
            routed.append(experts)
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, backend.mean_square)
    return h, tuple(new_kv), tuple(new_pages), jnp.stack(routed, axis=-2) if routed else None


@partial(jax.jit, static_argnames=("window", "cfg", "backend"))
def _layer(lp: dict, x, layer_pages, batch: Batch, rope, *, window, cfg: ModelConfig, backend: Backend):
    """One decoder layer of `forward_paged`: (x, (k, v), the layer's pages after the step, the
    routed experts [B, C, k] or None).

    A jit of its own inside the step: every layer has the same shapes, so JAX traces and
    lowers it once per step shape instead of once per layer, and XLA inlines the calls
    before it optimizes, so the compiled step is the same. Start-up (which traces every
    bucket even when the compiled programs come from the persistent cache) pays for one
    layer, not `num_layers`."""
    mms, ms = backend.matmuls, backend.mean_square
    with jax.named_scope("layer"):
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, ms)
        q, k, v = _qkv(lp, cfg, h, rope, mms, ms)
        scale = 1.0 / math.sqrt(cfg.head_dim)
        o, layer_pages = backend.attend(q, k, v, layer_pages, batch, scale, window=window)
        x = x + lora.add(lp, o, ("wo",), mms(o, (lp["wo"],), 2))[0]  # [B, C, Hq, hd] x [Hq, hd, D]
        x, routed = _mlp(lp, cfg, x, mms, ms, backend)
        return x, (k, v), layer_pages, routed


def write_pages(pages, new_kv, batch: Batch, *, cfg: ModelConfig, backend: Backend):
    """Write a step's K/V (per layer, [B, C, Hkv, hd]) into the page buffers (donate `pages`):
    a sliding-window layer's at the window pool's slots (`Batch.windowed`)."""
    return tuple(
        backend.write(p, k, v, batch.slots if cfg.layer_window(i) is None else batch.window_slots)
        for i, (p, (k, v)) in enumerate(zip(pages, new_kv, strict=True))
    )


def logits_from_hidden(
    params: Params, h: jax.Array, mms=jnp_matmuls, softcap: float | None = None
) -> jax.Array:
    """h [..., D] -> f32 logits [..., V]. `mms` as in `_qkv`: the [D, V] head is a large share of a
    small model's weight bytes, and at a few rows reading it is the cost, which the threaded
    GEMV does closer to memory bandwidth than XLA's dot. A 16-bit head accumulates and emits f32:
    a bf16 logit keeps 8 bits, so a logit of 20 would be off by up to 0.06 nats.
    `softcap` (`cfg.final_logit_softcapping`, Gemma 2): logits = softcap * tanh(logits / softcap)."""
    logits = mms(h, (params["lm_head"],), out_dtype=jnp.float32)[0]
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    return logits


def forward_dense(
    params: Params, tokens: jax.Array, lengths: jax.Array, *, cfg: ModelConfig, backend: Backend | None = None
) -> jax.Array:
    """Cache-free causal forward for scoring and training. tokens: [B, L] -> logits [B, L, V] f32.
    `backend`: the engine's, whose scoring kernels run (`Backend.dense_matmuls`,
    `causal_attention`: the step's own in deterministic mode); None: XLA's dot and the jnp
    attention, as a trainer differentiates."""
    mms = jnp_matmuls if backend is None else backend.dense_matmuls
    if cfg.is_gemma:
        h = gemma.dense_hidden(params, tokens, lengths, cfg=cfg, backend=backend)
        return logits_from_hidden(params, h, mms, cfg.final_logit_softcapping)
    ms = jnp_mean_square if backend is None else backend.mean_square
    attention = reference.dense_causal_attention if backend is None else backend.causal_attention
    scale = 1.0 / math.sqrt(cfg.head_dim)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    rope = rope_tables(positions, rope_inv_freq(cfg))
    x = take_rows(params["embed"], tokens, cfg.dtype)
    for i, lp in enumerate(params["layers"]):
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, ms)
        q, k, v = _qkv(lp, cfg, h, rope, mms, ms)
        o = attention(q, k, v, lengths, scale=scale, window=cfg.layer_window(i))
        x = x + mms(o, (lp["wo"],), 2)[0]  # [B, L, Hq, hd] x [Hq, hd, D]
        x, _ = _mlp(lp, cfg, x, mms, ms, backend)
    return logits_from_hidden(params, rms_norm(x, params["final_norm"], cfg.rms_norm_eps, ms), mms)


def token_logprobs(
    params: Params,
    tokens: jax.Array,
    lengths: jax.Array,
    temperature=1.0,
    *,
    cfg: ModelConfig,
    backend: Backend | None = None,
) -> jax.Array:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) for every t: [B, L-1] f32, under the raw
    distribution or, with `temperature` (traced: any value, one compile), softmax(logits / T).
    `backend` as in `forward_dense` (and its `token_logprobs`: the sampler's in deterministic mode)."""
    logits = forward_dense(params, tokens, lengths, cfg=cfg, backend=backend)[:, :-1] / temperature
    if backend is not None:
        return backend.token_logprobs(logits, tokens[:, 1:])
    lp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]


token_logprobs_jit = jax.jit(token_logprobs, static_argnames=("cfg", "backend"))

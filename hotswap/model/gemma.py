"""Gemma 2 / Gemma 3 (text) forward pass: the Gemma decoder layer beside `forward.py`'s Llama one.

What differs from the Llama family, as HF's Gemma2/Gemma3 modeling computes it:
- RMSNorm scales by (1 + w), in f32, then casts back;
- a norm after attention and after the MLP, each before its residual add ("sandwich" norms:
  params `post_attn_norm` and `post_mlp_norm`; `mlp_norm` is the pre-MLP norm);
- embeddings times sqrt(hidden), the factor rounded to the activations' dtype first;
- GeGLU: gelu (tanh approximation) on the gate;
- attention scale query_pre_attn_scalar**-0.5, per-layer windows (`ModelConfig.layer_window`)
  and Gemma 2's attention-logit softcap, both static per layer, passed to the Backend;
- Gemma 3: q/k norms ((1 + w) too) and two rope tables, the sliding layers' (their own base,
  unscaled) and the full layers' (rope_theta with the config's scaling);
- the final-logit softcap is applied where the logits are made (`forward.logits_from_hidden`).

Entry points mirror `forward.py`'s, which dispatches here for `cfg.is_gemma`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from hotswap.kernels import reference
from hotswap.kernels.backend import Backend, jnp_matmuls, jnp_mean_square
from hotswap.kernels.qtensor import take_rows
from hotswap.model import lora
from hotswap.model.batch import Batch
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params
from hotswap.model.rope import apply_rope, rope_inv_freq, rope_tables


def rms_norm(x: jax.Array, w: jax.Array, eps: float, mean_square=jnp_mean_square) -> jax.Array:
    """Gemma's RMSNorm: x / rms(x) * (1 + w), in f32 (HF: `output * (1.0 + self.weight.float())`)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(mean_square(xf) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def scaled_embed(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """[..., D] embeddings times sqrt(hidden), the factor in the embeddings' dtype as HF casts it."""
    x = take_rows(params["embed"], tokens, cfg.dtype)
    return x * jnp.asarray(cfg.hidden_size**0.5, dtype=x.dtype)


def ropes(positions: jax.Array, cfg: ModelConfig) -> dict[bool, tuple[jax.Array, jax.Array]]:
    """{sliding: (cos, sin)}: the full layers' table and the sliding layers' (the same table
    unless the sliding layers have a base of their own, Gemma 3). Once per step, as `rope_tables`."""
    full = rope_tables(positions, rope_inv_freq(cfg))
    if cfg.rope_local_base_freq is None:
        return {False: full, True: full}
    local = rope_tables(positions, rope_inv_freq(cfg, cfg.rope_local_base_freq, scaled=False))
    return {False: full, True: local}


def attention_scale(cfg: ModelConfig) -> float:
    return cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else cfg.head_dim**-0.5


def _qkv(lp: dict, cfg: ModelConfig, h: jax.Array, rope, mms, ms):
    """h: [..., D] -> q [..., Hq, hd], k/v [..., Hkv, hd], q/k normed (Gemma 3) and rotated."""
    q, k, v = lora.add(lp, h, ("wq", "wk", "wv"), mms(h, (lp["wq"], lp["wk"], lp["wv"])))
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps, ms)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps, ms)
    return apply_rope(q, rope), apply_rope(k, rope), v


def _attn_out(lp: dict, cfg: ModelConfig, x: jax.Array, o: jax.Array, mms, ms) -> jax.Array:
    """Residual add of the attention output o [..., Hq, hd] through wo and the post-attention norm."""
    out = lora.add(lp, o, ("wo",), mms(o, (lp["wo"],), 2))[0]
    return x + rms_norm(out, lp["post_attn_norm"], cfg.rms_norm_eps, ms)


def _mlp(lp: dict, cfg: ModelConfig, x: jax.Array, mms, ms) -> jax.Array:
    """x + post_mlp_norm(down(gelu_tanh(gate(h)) * up(h))), h = mlp_norm(x). The gelu runs in
    f32 and rounds once, as torch's does on 16-bit tensors."""
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps, ms)
    gate, up = lora.add(lp, h, ("w_gate", "w_up"), mms(h, (lp["w_gate"], lp["w_up"])))
    act = jax.nn.gelu(gate.astype(jnp.float32), approximate=True).astype(gate.dtype) * up
    down = lora.add(lp, act, ("w_down",), mms(act, (lp["w_down"],)))[0]
    return x + rms_norm(down, lp["post_mlp_norm"], cfg.rms_norm_eps, ms)


def forward_paged(
    params: Params, pages: tuple[jax.Array, ...], batch: Batch, *, cfg: ModelConfig, backend: Backend
):
    """`forward.forward_paged` for Gemma: (final hidden [B, C, D], new_kv, pages)."""
    tables = ropes(batch.positions, cfg)
    x = scaled_embed(params, batch.tokens, cfg)  # [B, C, D]
    new_kv, new_pages = [], []
    adapters = params.get("lora")  # adapters served by name: each row's own (model/lora.py)
    mask = None if adapters is None else lora.row_mask(batch.adapters, adapters["col_slot"], x.dtype)
    for i, (lp, layer_pages) in enumerate(zip(params["layers"], pages, strict=True)):
        if adapters is not None:
            lp = lora.with_layer(lp, adapters["layers"][i], mask)
        window = cfg.layer_window(i)
        seen = batch if window is None else batch.windowed()  # the window pool's pages
        x, kv, layer_pages = _layer(
            lp, x, layer_pages, seen, tables[window is not None], window=window, cfg=cfg, backend=backend
        )
        new_kv.append(kv)
        new_pages.append(layer_pages)
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, backend.mean_square)
    return h, tuple(new_kv), tuple(new_pages)


@partial(jax.jit, static_argnames=("window", "cfg", "backend"))
def _layer(lp: dict, x, layer_pages, batch: Batch, rope, *, window, cfg: ModelConfig, backend: Backend):
    """One Gemma decoder layer of `forward_paged` (a jit of its own, as `forward._layer`: one
    trace per step shape and window, sliding and full)."""
    mms, ms = backend.matmuls, backend.mean_square
    with jax.named_scope("layer"):
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, ms)
        q, k, v = _qkv(lp, cfg, h, rope, mms, ms)
        o, layer_pages = backend.attend(
            q,
            k,
            v,
            layer_pages,
            batch,
            attention_scale(cfg),
            window=window,
            softcap=cfg.attn_logit_softcapping,
        )
        x = _attn_out(lp, cfg, x, o, mms, ms)  # [B, C, Hq, hd] x [Hq, hd, D]
        return _mlp(lp, cfg, x, mms, ms), (k, v), layer_pages


def dense_hidden(
    params: Params, tokens: jax.Array, lengths: jax.Array, *, cfg: ModelConfig, backend: Backend | None
) -> jax.Array:
    """`forward.forward_dense`'s cache-free pass for Gemma up to the final norm: [B, L, D]."""
    mms = jnp_matmuls if backend is None else backend.dense_matmuls
    ms = jnp_mean_square if backend is None else backend.mean_square
    attention = reference.dense_causal_attention if backend is None else backend.causal_attention
    scale = attention_scale(cfg)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    tables = ropes(positions, cfg)
    x = scaled_embed(params, tokens, cfg)
    for i, lp in enumerate(params["layers"]):
        window = cfg.layer_window(i)
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, ms)
        q, k, v = _qkv(lp, cfg, h, tables[window is not None], mms, ms)
        o = attention(q, k, v, lengths, scale=scale, window=window, softcap=cfg.attn_logit_softcapping)
        x = _mlp(lp, cfg, _attn_out(lp, cfg, x, o, mms, ms), mms, ms)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps, ms)

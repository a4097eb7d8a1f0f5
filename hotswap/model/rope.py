"""Rotary position embeddings (HF's rotate-half convention): inverse frequencies, the per-step
cos/sin tables, and the rotation. Shared by every family (`forward.py`, `gemma.py`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.model.config import ModelConfig, RopeScaling


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None, scaled: bool = True) -> np.ndarray:
    """Inverse frequencies [hd/2] for base `theta` (default `cfg.rope_theta`), with the config's
    scaling when `scaled` (as HF computes them). Gemma 3's sliding layers: their own base, unscaled."""
    hd = cfg.head_dim
    base = cfg.rope_theta if theta is None else theta
    inv = 1.0 / (base ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd))
    inv = inv.astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None or not scaled:
        return inv
    if rs.rope_type == "linear":
        return (inv / np.float32(rs.factor)).astype(np.float32)
    return _llama3(inv, rs)


def _llama3(inv: np.ndarray, rs: RopeScaling) -> np.ndarray:
    old = rs.original_max_position_embeddings
    low_wl, high_wl = old / rs.low_freq_factor, old / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wl, inv / rs.factor, inv)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., 1, hd] for positions [...]: computed once per step, shared by every layer."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., 1, hd]
    # The barrier keeps the tables one array each: otherwise XLA fuses cos and sin into every
    # layer's q and k rotation and evaluates them per head and per layer: transcendental work
    # that grows with the model's depth instead of once per step.
    return jax.lax.optimization_barrier((jnp.cos(emb), jnp.sin(emb)))


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """x: [..., H, hd]; rope from `rope_tables`. HF's rotate-half convention."""
    cos, sin = rope
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)

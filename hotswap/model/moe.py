"""The sparse MLP of a mixture-of-experts layer (Qwen3-MoE, Mixtral) as grouped matmuls.

Each token's router scores pick `k` of the layer's `E` experts (`route`, HF's rule: softmax over
all experts in f32, top-k, optionally renormalised); the token's MLP output is the routing
weighted sum of those experts' SwiGLU MLPs. The experts' weights are stacked leaves
(`model/spec.py`: gate/up `[E, D, F]`, down `[E, F, D]`).

Two ways to run the experts, chosen by the (static) number of token-expert pairs N = T*k:
- `_grouped`: the pairs sorted by expert, then one grouped matmul per projection over the
  contiguous groups (`group_sizes` from the routing; `kernels/grouped_matmul.py`, chosen by the
  Backend: tiles on CPU, the Pallas megablox kernel on TPU, XLA's `ragged_dot` elsewhere): no
  all-experts compute and no per-expert loop.
  The shape of a prefill.
- the routed experts (`kernels/routed_experts.py`, chosen by the Backend): for few pairs
  (N <= E, a decode step), each pair's expert rows applied to its token and the k outputs
  summed with the routing weights. On one CPU device a C++ kernel reads the routed experts'
  rows in place from the stacks (`kernels/cpu_experts.py`), elsewhere each pair's matrices are
  sliced out; either way the step reads the routed experts' bytes only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hotswap.kernels import grouped_matmul, routed_experts
from hotswap.kernels.backend import jnp_matmuls
from hotswap.model.config import ModelConfig
from hotswap.model.sharding import RULES

EXPERTS = ("experts_gate", "experts_up", "experts_down")  # the stacked leaves, [E, ...] each


def route(h: jax.Array, router: jax.Array, cfg: ModelConfig, mms=jnp_matmuls) -> tuple[jax.Array, jax.Array]:
    """h [T, D] -> (weights [T, k] f32, experts [T, k] int32), experts by descending score.

    As HF: the scores are the router's matmul in the model's dtype, the softmax over all `E`
    experts and the top-k in f32, then (`norm_topk_prob`) the k probabilities renormalised."""
    logits = mms(h, (router,))[0].astype(jnp.float32)  # [T, E]
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def _grouped(lp: dict, x: jax.Array, experts: jax.Array, num_experts: int, gmm) -> jax.Array:
    """x [N, D] (pair n's token), experts [N] -> each pair's expert MLP output [N, D]."""
    order = jnp.argsort(experts, stable=True)  # [N] pairs grouped by expert
    sizes = jnp.bincount(experts, length=num_experts).astype(jnp.int32)  # [E]
    xs = x[order]
    gate, up = gmm(xs, lp["experts_gate"], sizes), gmm(xs, lp["experts_up"], sizes)  # [N, F]
    ys = gmm(_swiglu(gate, up), lp["experts_down"], sizes)  # [N, D]
    return jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)  # back to pair order


def _combine(lp: dict, cfg: ModelConfig, h: jax.Array, weights, experts, gmm, routed, first=0) -> jax.Array:
    """h [T, D], the routing ([T, k] each) -> the weighted sum of each token's experts' outputs
    [T, D] f32, over the experts [first, first + E_here) whose stacked weights `lp` holds
    (all of them, or one device's under expert parallelism); pairs routed elsewhere add 0."""
    k, here = cfg.num_experts_per_tok, lp["experts_gate"].shape[0]
    local = experts - first
    mine = (local >= 0) & (local < here)  # [T, k]
    # The routing weights as HF applies them: rounded to the activations' dtype (Qwen3-MoE) or
    # in f32 (Mixtral); the k weighted outputs summed in f32.
    if cfg.arch != "mixtral":
        weights = weights.astype(h.dtype)
    weights = jnp.where(mine, weights.astype(jnp.float32), 0.0)
    if h.shape[0] * k <= cfg.num_experts:  # few pairs: a decode step's
        # Pairs routed elsewhere read the last local expert, weighted 0.
        return routed(
            h, jnp.minimum(jnp.where(mine, local, here), here - 1), weights, *(lp[e] for e in EXPERTS)
        )
    pairs = jnp.where(mine, local, here).reshape(-1)  # [N = T*k]; elsewhere: past the last group
    x = jnp.repeat(h, k, axis=0)  # [N, D], token t's pairs at t*k ... t*k+k-1
    ys = _grouped(lp, x, pairs, here, gmm)  # rows past the groups' total come back 0
    return jnp.sum(ys.reshape(-1, k, h.shape[-1]).astype(jnp.float32) * weights[..., None], axis=1)


def sparse_mlp(lp: dict, cfg: ModelConfig, h: jax.Array, backend=None) -> tuple[jax.Array, jax.Array]:
    """h [..., D] (the normed residual) -> (MLP output [..., D], routed experts [..., k] int32).

    `backend` (None: XLA's dot and ragged_dot) runs the router (`Backend.matmuls`) and the
    experts (`Backend.grouped_matmul`, or `Backend.routed_experts` for few pairs). On a mesh the
    experts are sharded by expert (`sharding.RULES["expert"]`) and each device runs its own: the
    residual stream is replicated between layers (tensor parallelism), so every device already
    holds every token and routes it itself; it computes the pairs routed to its experts, and one
    all-reduce of [T, D] sums the devices' parts, as the dense MLP's all-reduce does. No token
    moves."""
    mms = jnp_matmuls if backend is None else backend.matmuls
    gmm = grouped_matmul.ragged if backend is None else backend.grouped_matmul
    routed = functools.partial(routed_experts.sliced, mms=mms) if backend is None else backend.routed_experts
    lead, d = h.shape[:-1], h.shape[-1]
    flat = h.reshape(-1, d)  # [T, D]
    weights, experts = route(flat, lp["router"], cfg, mms)
    stacked = {key: lp[key] for key in EXPERTS}
    if backend is None or backend.mesh is None:
        out = _combine(stacked, cfg, flat, weights, experts, gmm, routed)
    else:
        axis = RULES["expert"]

        def here(lpe, flat, weights, experts):
            first = jax.lax.axis_index(axis) * lpe["experts_gate"].shape[0]
            return jax.lax.psum(_combine(lpe, cfg, flat, weights, experts, gmm, routed, first), axis)

        out = jax.shard_map(
            here,
            mesh=backend.mesh,
            in_specs=(dict.fromkeys(EXPERTS, P(axis)), P(), P(), P()),
            out_specs=P(),
            check_vma=False,
        )(stacked, flat, weights, experts)
    return out.astype(h.dtype).reshape(*lead, d), experts.reshape(*lead, cfg.num_experts_per_tok)

"""The params pytree layout, in one place.

Params are a plain nested dict of arrays, passed to every jitted step as an
argument (never closed over). Matrices are stored `[in, out]` and used as
`x @ W`, which is 3-4x faster on CPU than `x @ W.T` (DESIGN "Numbers to know").
The LM head is always its own `[D, V]` array; for tied-embedding models it is a
copy of `embed.T` made at load time, because an untied `[D, V]` head is the
fast layout and keeps the forward pass free of a tie branch.

    {
      "embed":      [V, D],
      "layers": [   # a Python list: layers are unrolled, not scanned
        {"attn_norm": [D],
         "wq": [D, Hq*hd], "wk": [D, Hkv*hd], "wv": [D, Hkv*hd], "wo": [Hq*hd, D],
         "bq": [Hq*hd], "bk": [Hkv*hd], "bv": [Hkv*hd],     # qwen2 only
         "q_norm": [hd], "k_norm": [hd],                     # qwen3 only
         "mlp_norm": [D],
         "w_gate": [D, F], "w_up": [D, F], "w_down": [F, D]},
        ...
      ],
      "final_norm": [D],
      "lm_head":    [D, V],
    }
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from hotswap.config import ModelConfig

Params = dict[str, Any]  # nested dict of jax/numpy arrays, layout above


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, f, q, kv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    shapes = {
        "attn_norm": (d,),
        "wq": (d, q),
        "wk": (d, kv),
        "wv": (d, kv),
        "wo": (q, d),
        "mlp_norm": (d,),
        "w_gate": (d, f),
        "w_up": (d, f),
        "w_down": (f, d),
    }
    if cfg.qkv_bias:
        shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
    if cfg.qk_norm:
        shapes.update(q_norm=(hd,), k_norm=(hd,))
    return shapes


def param_shapes(cfg: ModelConfig) -> Params:
    """Nested dict of shape tuples with the same structure as the params."""
    return {
        "embed": (cfg.vocab_size, cfg.hidden_size),
        "layers": [layer_shapes(cfg) for _ in range(cfg.num_layers)],
        "final_norm": (cfg.hidden_size,),
        "lm_head": (cfg.hidden_size, cfg.vocab_size),
    }


def abstract_params(cfg: ModelConfig, dtype: str | None = None) -> Params:
    """ShapeDtypeStruct tree: what every weight update is validated against."""
    dt = np.dtype(jax.numpy.dtype(dtype or cfg.dtype))
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, dt),
        param_shapes(cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def param_paths(params: Params) -> list[tuple[str, Any]]:
    """Flatten to ("layers.3.wq", leaf) pairs, in a stable order, for error messages."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return [(path_name(path), leaf) for path, leaf in flat]


def path_name(path) -> str:
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        else:
            parts.append(str(k))
    return ".".join(parts)

"""The params pytree: its layout, and the trees built from the spec table (`spec.py`).

Params are a plain nested dict of arrays, passed to every jitted step as an
argument (never closed over). Matrices are stored `[in, out]` and used as
`x @ W`: on XLA:CPU a transposed right operand (`x @ W.T`, HF's `[out, in]`) takes a
several times slower dot, so the transpose is paid once at load (docs/en/benchmarks.md).
The attention projections keep their heads as an axis (`[D, H, hd]`, o `[Hq, hd,
D]`): the model contracts them in that layout, tensor parallelism splits that axis,
and it is the layout of Tunix's Flax models, whose states map here leaf to leaf.
The LM head is always its own `[D, V]` array; for tied-embedding models it is a
copy of `embed.T` made at load time, because an untied `[D, V]` head is the
fast layout and keeps the forward pass free of a tie branch.

    {
      "embed":      [V, D],
      "layers": [   # a Python list: layers are unrolled, not scanned
        {"attn_norm": [D],
         "wq": [D, Hq, hd], "wk": [D, Hkv, hd], "wv": [D, Hkv, hd], "wo": [Hq, hd, D],
         "bq": [Hq*hd], "bk": [Hkv*hd], "bv": [Hkv*hd],     # qwen2 only
         "q_norm": [hd], "k_norm": [hd],                     # qwen3 only
         "mlp_norm": [D],
         "w_gate": [D, F], "w_up": [D, F], "w_down": [F, D]},
        ...
      ],
      "final_norm": [D],
      "lm_head":    [D, V],
    }

Each leaf's shape, logical axes and HF name are one row of `spec.py`; the trees
here (`param_shapes`, `abstract_params`) are maps over that table.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from hotswap.model.config import ModelConfig
from hotswap.model.spec import Params, is_spec, param_specs, path_name

__all__ = ["Params", "abstract_params", "param_paths", "param_shapes", "path_name"]


def param_shapes(cfg: ModelConfig) -> Params:
    """Nested dict of shape tuples with the same structure as the params."""
    return jax.tree.map(lambda s: s.shape, param_specs(cfg), is_leaf=is_spec)


def abstract_params(cfg: ModelConfig, dtype: str | None = None) -> Params:
    """ShapeDtypeStruct tree: what every weight update is validated against."""
    dt = np.dtype(jax.numpy.dtype(dtype or cfg.dtype))
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dt), param_specs(cfg), is_leaf=is_spec)


def param_paths(params: Params) -> list[tuple[str, Any]]:
    """Flatten to ("layers.3.wq", leaf) pairs, in a stable order, for error messages."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return [(path_name(path), leaf) for path, leaf in flat]

"""LoRA adapters: their forms' readers (rows of `readers.READERS`) and their placing (`stage`).
An adapter goes through the one pipeline: read -> plan (`model/validate.lora_tensors`, by the
source's own names) -> one finiteness pass -> factors placed on the devices of the weights
they adapt (merged into the base, `place.py` `merge`, or written into a named slot).

Forms, told apart by their names:

- PEFT (`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` `[r, in]`, `lora_B`
  `[out, r]`): a directory with `adapter_config.json` (r, lora_alpha, target_modules) and
  `adapter_model.safetensors`, safetensors bytes, or a mapping of such names;
- a Flax NNX state of `nnx.LoRAParam` leaves, as qwix names them on Tunix's models
  (`layers.3.attn.q_proj.w_lora_a` `[D, r]`, `..._lora_b` `[r, Hq, hd]`): what Tunix's
  `RLCluster.sync_weights` sends when the actor trains LoRA;
- a params-layout tree `{"layers": [{"wq": {"lora_a": [D, r], "lora_b": [r, Hq, hd]}, ...}]}`.

Whatever the form, the staged factors are the params layout's (`ParamSpec.lora_shapes`):
A `[*in, r]` f32 and B `[r, *out]` f32 with the adapter's scale (alpha / r; alpha / sqrt(r) for
rsLoRA) folded in, so A·B reshaped is the row's delta. A `.bin` adapter (pickle) is refused,
never unpickled.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.checkpoint.safetensors_io import read_safetensors
from hotswap.errors import CheckpointError, ConfigError, PickleRefused, WeightsMismatch
from hotswap.model.lora import Factors, factor_shardings
from hotswap.model.params import Params
from hotswap.weights import finiteness

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"


@dataclasses.dataclass(frozen=True)
class AdapterSource:
    """An adapter as read, not converted: its tensors as `form` names them (`validate.LORA_FORMS`)
    and what its source states of its scale (`adapter_config.json`; None: the caller's
    `lora_alpha`)."""

    tensors: Mapping[str, Any]
    form: str
    alpha: float | None = None
    rslora: bool = False
    where: str = "adapter"


def _is_lora_param(var: Any) -> bool:
    return any(c.__name__ == "LoRAParam" and c.__module__.startswith("flax") for c in type(var).__mro__)


def _nnx_flat(source: Any) -> dict[str, Any]:
    from flax import nnx  # the [tunix] extra: only reached for a flax source

    state = nnx.state(source) if isinstance(source, nnx.Module) else source
    if not isinstance(state, nnx.State):
        return {}
    return {".".join(str(getattr(k, "key", k)) for k in p): v for p, v in nnx.to_flat_state(state)}


def is_nnx_lora(source: Any) -> bool:
    """An NNX state (or module) whose variables are all `nnx.LoRAParam`s (Tunix's LoRA sync)."""
    flat = _nnx_flat(source)
    return bool(flat) and all(_is_lora_param(v) for v in flat.values())


def from_nnx(source: Any) -> AdapterSource:
    """An NNX state of `nnx.LoRAParam` leaves (`is_nnx_lora`), its factors by qwix's names."""
    flat = _nnx_flat(source)
    values = {n: v.get_value() if hasattr(v, "get_value") else v.value for n, v in flat.items()}
    return AdapterSource(values, "nnx", where="nnx state")


def _params_flat(source: Mapping) -> dict[str, Any] | None:
    """`{"layers": [{"wq": {"lora_a", "lora_b"}, ...}]}` (no embedding) flattened, else None."""
    layers = source.get("layers")
    if "embed" in source or not isinstance(layers, (list, tuple)):
        return None
    flat = {}
    for i, layer in enumerate(layers):
        for key, pair in (layer or {}).items():
            if not isinstance(pair, Mapping):
                return None
            for factor, x in pair.items():
                flat[f"layers.{i}.{key}.{factor}"] = x
    return flat or None


def is_params_adapter(source: Mapping) -> bool:
    """A params-layout adapter: `{"layers": [{"wq": {"lora_a", "lora_b"}, ...}]}`."""
    return _params_flat(source) is not None


def from_params_tree(source: Mapping) -> AdapterSource:
    return AdapterSource(_params_flat(source), "params", where="adapter tree")


def peft_dir(path: Path) -> tuple[AdapterSource, list[str]]:
    """`adapter_config.json` + `adapter_model.safetensors`, as PEFT's `save_pretrained` writes
    them -> (the adapter, its config's target_modules)."""
    where = str(path / ADAPTER_CONFIG)
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: not a readable adapter config ({e})") from e
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise WeightsMismatch(
            f"{where}: peft_type {config.get('peft_type')!r}; only LORA adapters are served"
        )
    if config.get("use_dora"):
        raise WeightsMismatch(f"{where}: use_dora=true; DoRA adapters are not served (plain LoRA only)")
    file = path / ADAPTER_FILE
    if not file.exists():
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise PickleRefused(
                f"{path}: adapter_model.bin is a pickle and is never unpickled; save the adapter with "
                "save_pretrained(safe_serialization=True)"
            )
        raise CheckpointError(f"{path}: no {ADAPTER_FILE}")
    targets = config.get("target_modules") or []
    return AdapterSource(
        read_safetensors(file),
        "peft",
        alpha=float(config["lora_alpha"]) if config.get("lora_alpha") is not None else None,
        rslora=bool(config.get("use_rslora")),
        where=where,
    ), [targets] if isinstance(targets, str) else list(targets)


def stage(
    adapter: AdapterSource,
    chosen: Mapping[str, tuple],
    abstract: Params,
    *,
    lora_alpha: float | None = None,
    check_finite: bool = True,
) -> Factors:
    """An adapter as its plan checked it (`chosen`: params name -> (row, A name, B name, rank,
    part), `weights/plan.py`), checked for NaN/Inf and placed: params name -> (A `[*in, r]`,
    B `[r, *out]` scaled), f32, on the adapted weights' devices."""
    alpha = adapter.alpha
    if alpha is None:
        alpha = lora_alpha
    elif lora_alpha is not None and float(lora_alpha) != alpha:
        raise ConfigError(f"lora_alpha={lora_alpha} but {adapter.where} says lora_alpha={alpha}")
    if alpha is None:
        raise ConfigError(
            f"{adapter.where}: a LoRA adapter's scale is alpha / r, and this source does not state its "
            "alpha; pass lora_alpha"
        )
    check = finiteness.Check(check_finite)
    pairs = sorted({n for _, a, b, _, _ in chosen.values() for n in (a, b)})  # a stacked pair once
    check.add({n: adapter.tensors[n] for n in pairs})
    check.raise_first(pairs)
    names = sorted(chosen)
    plan, shardings = [], []
    for name in names:
        spec, _, _, rank, part = chosen[name]
        a_shape, b_shape = spec.lora_shapes(rank)
        scale = float(alpha) / (math.sqrt(rank) if adapter.rslora else rank)
        plan.append((a_shape, b_shape, scale, part))
        shardings.extend(factor_shardings(_leaf(abstract, spec.path).sharding, len(a_shape) - 1))
    # A stacked pair's A and B are sources of each of its rows (jit passes one buffer twice).
    sources = [adapter.tensors[n] for name in names for n in chosen[name][1:3]]
    sources = [x if isinstance(x, jax.Array) else np.asarray(x) for x in sources]
    placed = _converter(tuple(plan), adapter.form == "peft", tuple(shardings))(sources)
    return {name: (placed[2 * i], placed[2 * i + 1]) for i, name in enumerate(names)}


@functools.cache
def _converter(plan: tuple, peft: bool, shardings: tuple):
    """One jit per adapter shape: source factors -> params-layout f32 factors on `shardings`
    (a device-side move: on CPU `jax.device_put` between device shardings goes through the host,
    which Tunix's transfer guard refuses during a sync). PEFT's torch Linear weights are A
    `[r, in]`, B `[out, r]`: transposed here. A row of a stacked pair (`part` not None) takes
    its B[:, part]."""

    def convert(xs):
        out = []
        for i, (a_shape, b_shape, scale, part) in enumerate(plan):
            a, b = (x.astype(jnp.float32) for x in xs[2 * i : 2 * i + 2])
            if peft:
                a, b = a.T, b.T
            if part is not None:
                b = b[:, part]
            out += [a.reshape(a_shape), b.reshape(b_shape) * np.float32(scale)]
        return out

    if all(s is not None for s in shardings):
        return jax.jit(convert, out_shardings=list(shardings))
    return jax.jit(convert)


def _leaf(tree: Params, path) -> Any:
    for k in path:
        tree = tree[k]
    return tree

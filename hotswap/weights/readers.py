"""Stage 1 of the ingest pipeline: `read(source) -> Opened`, from one table of readers.

Each row of `READERS` is one form a weight source takes; the first row whose `matches` says
yes opens it. Opening reads what the source says about itself (names, shapes, dtypes, a
stated config), never converts, and moves no weight bytes a validator could still refuse:
a transfer offer's manifest and an orbax checkpoint's metadata are read here, their arrays
fetched by `place.py` once `plan.py` has passed them. Adapters are rows like any other.

| row           | form                                                        | holds          |
|---------------|-------------------------------------------------------------|----------------|
| nnx_lora      | Flax NNX state/module of `nnx.LoRAParam` leaves (qwix)      | adapter (nnx)  |
| nnx           | Flax NNX state/module of the served family                  | nnx            |
| transfer_offers | a `TransferRef` of one offer per engine process           | layout + fetch |
| transfer      | `TransferRef` another JAX process published                 | layout + fetch |
| gguf          | a `.gguf` file (llama.cpp), dequantized (cached, `converted.py`), or its blocks kept (`quantization="gguf"`) | hf        |
| peft_dir      | a directory with `adapter_config.json` (PEFT)               | adapter (peft) |
| hf_dir        | a directory with `config.json` / `*.safetensors`            | hf             |
| orbax_dir     | an orbax checkpoint directory of the params tree            | layout + fetch |
| adapter       | a `weights.lora.AdapterSource` (what the multi-host driver sends) | adapter |
| bytes         | safetensors bytes (REST bodies, chunks): PEFT names or HF   | adapter / hf   |
| params_tree   | `{"embed", "layers", ...}` in the params layout             | tree           |
| adapter_tree  | `{"layers": [{"wq": {"lora_a", "lora_b"}}]}`                | adapter (params) |
| peft_tensors  | a mapping of PEFT-named tensors                             | adapter (peft) |
| hf_tensors    | a mapping of HF-named tensors (as a trainer saves them)     | hf             |

Paths resolve under the allowed weights root when one is set. Nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hotswap.checkpoint import gguf_io, hf, orbax_io, payload
from hotswap.errors import CheckpointError, ConfigError, WeightsMismatch
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params
from hotswap.weights import lora_forms, transfer


@dataclasses.dataclass(frozen=True)
class Opened:
    """A source opened by its reader row (`form`), nothing converted. Exactly one of:

    - `tensors`: HF-named tensors (views of the file or payload), checked by HF names;
    - `tree`: a params tree, checked by params names;
    - `nnx`: an NNX state's variables by NNX path, checked by NNX names;
    - `adapter`: a LoRA adapter's tensors as its form names them;
    - `layout` + `fetch`: params names -> (shape, dtype) of arrays not yet moved, and the call
      that moves them onto `abstract` (a transfer offer; an orbax checkpoint, `cast_floats`).
    """

    form: str
    where: str  # the source as errors name it
    tensors: Mapping[str, Any] | None = None
    tree: Params | None = None
    nnx: Mapping[str, Any] | None = None
    adapter: lora_forms.AdapterSource | None = None
    layout: Mapping[str, tuple[tuple[int, ...], Any]] | None = None
    ordered: bool = False  # the layout's order must be the engine's flatten order (a transfer)
    cast_floats: bool = False  # a float in the layout stands for the engine's (orbax casts it)
    fetch: Callable[[Params], Params] | None = None
    stated: tuple[str, ModelConfig] | None = None  # (where, config) the source states of itself
    adapter_targets: tuple[str, ...] = ()  # a PEFT config's target_modules
    # The validator's WeightsMismatch in the source's own naming (a GGUF's tensor names).
    rename: Callable[[WeightsMismatch], WeightsMismatch] | None = None


# How a multi-process engine (`engine/multihost.py`) gets a source to every process: each
# opens the path itself (a shared filesystem or bucket); each opens its own offer of a
# per-process transfer; or process 0 reads and checks it and broadcasts its tensors.
ACROSS = ("path", "offers", "broadcast")


@dataclasses.dataclass(frozen=True)
class Reader:
    name: str
    matches: Callable[[Any, Path | None], bool]  # (source, its resolved path or None)
    open: Callable[..., Opened]  # (source, path, cfg, abstract) -> Opened
    across: str = "broadcast"  # one of ACROSS


def _is_flax(obj: Any) -> bool:
    """An `nnx.State` or `nnx.Module`, told apart without importing flax (an optional extra)."""
    return any(c.__module__.startswith("flax.nnx") for c in type(obj).__mro__)


def _is_params_tree(obj: Any) -> bool:
    return isinstance(obj, Mapping) and "layers" in obj and "embed" in obj


def _str_keyed(obj: Any) -> bool:
    return isinstance(obj, Mapping) and all(isinstance(k, str) for k in obj)


def _is_peft(names) -> bool:
    return any(".lora_A." in n or ".lora_B." in n for n in names)


def wire_tensors(
    chunk: bytes | bytearray | memoryview | list | Mapping[str, Any],
    content_type: str = "application/octet-stream",
) -> Mapping[str, Any]:
    """The tensors of an update as it arrives: body bytes (safetensors or JSON, by
    `content_type`) or a parsed JSON `tensors` list are decoded here, the one place an update
    payload is decoded; a mapping of tensors is used as it is."""
    if isinstance(chunk, (bytearray, memoryview)):
        chunk = bytes(chunk)  # the decoded arrays view it: a caller's buffer may change later
    if isinstance(chunk, (bytes, list)):
        return payload.decode_payload(chunk, content_type)
    if not _str_keyed(chunk):
        raise WeightsMismatch("a tensor mapping must be keyed by HF tensor names (str)")
    return chunk


# ---- the rows' open functions: (source, path, cfg, abstract) -> Opened -------------------------


def _open_nnx_lora(source, path, cfg, abstract) -> Opened:
    return Opened("nnx_lora", "nnx state", adapter=lora_forms.from_nnx(source))


def _open_nnx(source, path, cfg, abstract) -> Opened:
    from hotswap.weights import nnx as nnx_params  # the [tunix] extra: flax

    return Opened("nnx", "nnx state", nnx=nnx_params.flat_values(source, cfg))


def _open_transfer(source: transfer.TransferRef, path, cfg, abstract) -> Opened:
    if abstract is None:
        raise ConfigError("a transfer pull needs the engine's abstract params (its shardings)")
    offer = transfer.open_offer(source, abstract)
    return Opened("transfer", offer.where, layout=offer.layout, ordered=True, fetch=offer.fetch)


def _open_gguf(source, path: Path, cfg, abstract) -> Opened:
    f = gguf_io.GGUFFile(path)
    theirs = gguf_io.model_config(f, dtype=cfg.dtype)
    return Opened(
        "gguf",
        str(path),
        # Served as its blocks (`quantization="gguf"`), else dequantized once and cached.
        tensors=gguf_io.hf_tensors(f, theirs, hf.np_dtype(cfg.dtype), blocks=True)
        if cfg.quantization == "gguf"
        else gguf_io.cached_hf_tensors(f, theirs),
        stated=(str(path), theirs),
        rename=lambda e: gguf_io.in_gguf_terms(f, e),
    )


def _open_peft_dir(source, path: Path, cfg, abstract) -> Opened:
    adapter, targets = lora_forms.peft_dir(path)
    return Opened("peft_dir", adapter.where, adapter=adapter, adapter_targets=tuple(targets))


def _open_hf_dir(source, path: Path, cfg, abstract) -> Opened:
    stated = None
    if (path / "config.json").exists():
        stated = (f"{path}/config.json", ModelConfig.from_dir(path))
    return Opened("hf_dir", str(path), tensors=hf.read_hf_tensors(path), stated=stated)


def _open_orbax(source, path: Path, cfg, abstract) -> Opened:
    layout = orbax_io.read_layout(path)
    return Opened(
        "orbax_dir",
        f"orbax checkpoint {str(path)!r}: ",
        layout=layout,
        cast_floats=True,
        fetch=lambda target: orbax_io.restore_params(path, target),
    )


def _open_bytes(source, path, cfg, abstract) -> Opened:
    tensors = wire_tensors(source)
    if _is_peft(tensors):
        return Opened("bytes", "payload", adapter=lora_forms.AdapterSource(tensors, "peft", where="payload"))
    return Opened("bytes", "payload", tensors=tensors)


def _open_adapter(source: lora_forms.AdapterSource, path, cfg, abstract) -> Opened:
    return Opened("adapter", source.where, adapter=source)


def _open_params_tree(source, path, cfg, abstract) -> Opened:
    return Opened("params_tree", "params tree", tree=source)


def _open_adapter_tree(source, path, cfg, abstract) -> Opened:
    return Opened("adapter_tree", "adapter tree", adapter=lora_forms.from_params_tree(source))


def _open_peft_tensors(source, path, cfg, abstract) -> Opened:
    return Opened(
        "peft_tensors", "tensors", adapter=lora_forms.AdapterSource(source, "peft", where="tensors")
    )


def _open_hf_tensors(source, path, cfg, abstract) -> Opened:
    return Opened("hf_tensors", "tensors", tensors=wire_tensors(source))


def _is_dir(path: Path | None) -> bool:
    if path is None:
        return False
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (expected an HF or orbax checkpoint directory)")
    return True


READERS: tuple[Reader, ...] = (
    Reader("nnx_lora", lambda s, p: _is_flax(s) and lora_forms.is_nnx_lora(s), _open_nnx_lora),
    Reader("nnx", lambda s, p: _is_flax(s), _open_nnx),
    Reader(
        "transfer_offers",
        lambda s, p: isinstance(s, transfer.TransferRef) and s.processes > 1,
        _open_transfer,
        across="offers",
    ),
    Reader("transfer", lambda s, p: isinstance(s, transfer.TransferRef), _open_transfer),
    Reader("gguf", lambda s, p: p is not None and gguf_io.is_gguf(p), _open_gguf, across="path"),
    Reader(
        "peft_dir",
        lambda s, p: _is_dir(p) and (p / lora_forms.ADAPTER_CONFIG).exists(),
        _open_peft_dir,
        across="path",
    ),
    Reader(
        "hf_dir",
        lambda s, p: _is_dir(p) and ((p / "config.json").exists() or any(p.glob("*.safetensors"))),
        _open_hf_dir,
        across="path",
    ),
    Reader("orbax_dir", lambda s, p: _is_dir(p), _open_orbax, across="path"),
    Reader("adapter", lambda s, p: isinstance(s, lora_forms.AdapterSource), _open_adapter),
    Reader("bytes", lambda s, p: isinstance(s, (bytes, bytearray, memoryview)), _open_bytes),
    Reader("params_tree", lambda s, p: _is_params_tree(s), _open_params_tree),
    Reader(
        "adapter_tree", lambda s, p: _str_keyed(s) and lora_forms.is_params_adapter(s), _open_adapter_tree
    ),
    Reader("peft_tensors", lambda s, p: _str_keyed(s) and _is_peft(s), _open_peft_tensors),
    Reader("hf_tensors", lambda s, p: isinstance(s, Mapping), _open_hf_tensors),
)


def resolve_path(source: Any, weights_root: str | os.PathLike | None) -> Path | None:
    """A path source resolved (under `weights_root` when one is set; None: any path, as
    in-process callers own the filesystem); None for every other source."""
    if isinstance(source, (str, os.PathLike)):
        return orbax_io.resolve_weights_path(source, weights_root)
    return None


def row_for(source: Any, path: Path | None) -> Reader:
    """The first row of `READERS` that matches `source` (`path`: `resolve_path`'s)."""
    for row in READERS:
        if row.matches(source, path):
            return row
    raise ConfigError(
        f"unsupported weight source {type(source).__name__}: pass a params pytree, a dict of HF-named "
        "tensors, a checkpoint directory or .gguf file path, safetensors bytes, a LoRA adapter, an NNX "
        "state, or a hotswap.weights.transfer.TransferRef"
    )


def read(
    source: Any,
    cfg: ModelConfig,
    *,
    weights_root: str | os.PathLike | None = None,
    abstract: Params | None = None,
) -> Opened:
    """Stage 1: the row of `READERS` that matches `source` opens it."""
    path = resolve_path(source, weights_root)
    return row_for(source, path).open(source, path, cfg, abstract)

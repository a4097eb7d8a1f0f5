"""The LoRA adapters an engine serves by name: which name holds which buffer slot, under which
identity, as part of the engine state.

`Adapters` is a value in `EngineState.adapters` (None: `enable_lora` off): the loaded adapters
(name -> slot, id, version, rank) and the device buffers the step reads (`model/lora.py`:
A `[*in, max_loras * max_lora_rank]`, B `[max_loras * max_lora_rank, *out]` per adaptable row,
and the column -> slot map of the row mask). Loading writes the factors into a slot in place
(`lora.write_slot`, donated: the step's compiled shapes never change); each load of a name gets
the next adapter version, and every KV page and prefix entry written for its requests records
(adapter id, adapter version) (`prefix.py`), so a reload's requests never read the old load's
cached prefixes, while other adapters' stay.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from hotswap.errors import RequestError
from hotswap.model import lora
from hotswap.model.config import ModelConfig
from hotswap.model.lora import Factors
from hotswap.model.params import Params
from hotswap.model.spec import param_specs

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


class AdapterError(RequestError):
    """A LoRA adapter call that cannot be served: past max_loras, an unknown or bad name."""

    code = "lora_adapter"


class AdapterNotFound(AdapterError):
    """A request or an unload names an adapter that is not loaded."""

    status = 404
    code = "model_not_found"


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`: `LLM.generate(..., lora_request=)`
    serves the prompt with this adapter, loading it from `lora_path` on first use (a later
    request with another path reloads it). `lora_int_id` is accepted for vLLM's signature; the
    engine keys adapters by name."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


@dataclasses.dataclass(frozen=True)
class Loaded:
    """One adapter served by name. `id` is fixed for the name; `version` counts its loads."""

    name: str
    id: int
    version: int
    slot: int
    rank: int
    source: str

    @property
    def identity(self) -> tuple[int, int]:
        """What a KV page computed for it records (prefix.py)."""
        return (self.id, self.version)


@dataclasses.dataclass(frozen=True)
class Adapters:
    loaded: tuple[Loaded, ...]
    buffers: dict[str, Any]  # {"layers": lora.Buffers, "col_slot": int32 [L*R]}, on the device
    max_loras: int
    max_rank: int
    next_id: int = 1

    @staticmethod
    def empty(cfg: ModelConfig, abstract: Params, max_loras: int, max_rank: int) -> Adapters:
        dtype = abstract["embed"].dtype
        layers = lora.empty_buffers(
            param_specs(cfg)["layers"], abstract["layers"], max_loras, max_rank, dtype
        )
        col_slot = jnp.asarray(lora.col_slots(max_loras, max_rank))
        return Adapters((), {"layers": layers, "col_slot": col_slot}, max_loras, max_rank)

    def get(self, name: str) -> Loaded:
        for a in self.loaded:
            if a.name == name:
                return a
        raise AdapterNotFound(
            f"no LoRA adapter {name!r} is loaded (loaded: {', '.join(a.name for a in self.loaded) or 'none'})"
        )

    def has(self, name: str) -> bool:
        return any(a.name == name for a in self.loaded)

    def check_room(self, name: str) -> None:
        """A new name needs a free slot: refuse before anything is read or written."""
        if not NAME.match(name):
            raise AdapterError(f"lora_name {name!r}: use letters, digits and ._:/- (at most 128)")
        if not self.has(name) and len(self.loaded) >= self.max_loras:
            raise AdapterError(
                f"lora_name {name!r}: max_loras={self.max_loras} adapters are loaded "
                f"({', '.join(a.name for a in self.loaded)}); unload one first"
            )

    def load(self, name: str, factors: Factors, source: str) -> Adapters:
        """Write `factors` (params name -> (A, B), model/lora.py) into `name`'s slot (a free one
        for a new name): the old value's buffers are donated to the new one."""
        self.check_room(name)
        old = next((a for a in self.loaded if a.name == name), None)
        used = {a.slot for a in self.loaded}
        slot = old.slot if old else min(set(range(self.max_loras)) - used)
        rank = max(a.shape[-1] for a, _ in factors.values())
        per_layer = [{} for _ in self.buffers["layers"]]
        for pname, pair in factors.items():
            _, i, key = pname.split(".")
            per_layer[int(i)][key] = pair
        layers = lora.write_slot(self.buffers["layers"], jnp.int32(slot), per_layer, max_rank=self.max_rank)
        entry = Loaded(
            name,
            old.id if old else self.next_id,
            (old.version + 1) if old else 1,
            slot,
            int(rank),
            source,
        )
        rest = tuple(a for a in self.loaded if a.name != name)
        return dataclasses.replace(
            self,
            loaded=(*rest, entry),
            buffers={**self.buffers, "layers": layers},
            next_id=self.next_id + (0 if old else 1),
        )

    def unload(self, name: str) -> Adapters:
        """Forget `name`: its slot is free for the next load (which overwrites every column)."""
        self.get(name)
        return dataclasses.replace(self, loaded=tuple(a for a in self.loaded if a.name != name))

    def slots(self) -> np.ndarray:
        return np.array([a.slot for a in self.loaded], np.int32)

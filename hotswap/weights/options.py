"""UpdateOptions: how one weight update runs, written once and carried as one value.

`LLM.update_weights`, `Engine.update_weights`, the REST routes, the multi-host driver and
Tunix's `HotswapRollout` all take one of these (or build it from their own field names) and
hand it down unchanged: the ingest pipeline (`weights/pipeline.py`) reads `partial`,
`base_version`, `check_finite` and `lora_alpha`; the engine reads `policy` (its row in
`engine/policies.py`, checked there, the one table of policies), `version`, `base_version`
(checked under its lock) and `drain_timeout_s`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hotswap.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class UpdateOptions:
    # What happens to requests in flight (`engine/policies.py`: drain, abort, recompute, keep, reject).
    policy: str = "drain"
    # The version the new weights serve as; None: the current one + 1. Must grow.
    version: int | None = None
    # Only the tensors the source brings are replaced; the others keep their serving values.
    partial: bool = False
    # A delta: the weights version the source's tensors apply to. Any other serving version is
    # refused (BaseVersionMismatch, 409) before anything changes; HF-named tensors are then a
    # partial update (only the changed ones), and `hotswap.weights.delta.Rows` entries may
    # carry changed rows only.
    base_version: int | None = None
    # How long a `drain` waits for in-flight requests; None: the engine's `drain_timeout_s`.
    drain_timeout_s: float | None = None
    # One NaN/Inf pass over the new tensors before anything serving is touched.
    check_finite: bool = True
    # A LoRA adapter's alpha where its source does not state it (PEFT dirs do).
    lora_alpha: float | None = None

    def __post_init__(self):
        if not isinstance(self.policy, str):
            raise ConfigError(f"update policy must be a name (str), got {type(self.policy).__name__}")
        if self.version is not None and (isinstance(self.version, bool) or not isinstance(self.version, int)):
            raise ConfigError(f"version must be an int, got {self.version!r}")
        if self.base_version is not None and (
            isinstance(self.base_version, bool) or not isinstance(self.base_version, int)
        ):
            raise ConfigError(f"base_version must be an int, got {self.base_version!r}")
        if self.drain_timeout_s is not None and not (self.drain_timeout_s >= 0):
            raise ConfigError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s!r}")
        if self.lora_alpha is not None and not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ConfigError(f"lora_alpha must be a positive number, got {self.lora_alpha!r}")

    @classmethod
    def of(cls, options: UpdateOptions | None = None, **fields: Any) -> UpdateOptions:
        """`options` with `fields` replaced (the keyword form of `LLM.update_weights`); an unknown
        field name is a ConfigError that lists the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigError(f"unknown update option(s) {unknown}; known: {sorted(known)}")
        return dataclasses.replace(options or cls(), **fields)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (what the multi-host driver sends its followers)."""
        return dataclasses.asdict(self)

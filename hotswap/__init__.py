"""hotswap: a JAX inference engine whose hot weight updates can never serve stale KV.

The public names load lazily so that `hotswap.errors` and `hotswap.api.http_errors`
import without jax (for HTTP clients and tooling).
"""

from __future__ import annotations

import importlib

_LAZY = {
    "LLM": "hotswap.engine.llm",
    "Engine": "hotswap.engine.engine",
    "SamplingParams": "hotswap.engine.sampling",
    "StructuredOutputs": "hotswap.engine.structured",
    "LoRARequest": "hotswap.engine.adapters",
    "RequestOutput": "hotswap.engine.outputs",
    "CompletionOutput": "hotswap.engine.outputs",
    "UpdateOptions": "hotswap.weights.options",
    "EngineArgs": "hotswap.args",
    "EngineConfig": "hotswap.engine_config",
    "ModelConfig": "hotswap.model.config",
}

__all__ = list(_LAZY)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hotswap' has no attribute {name!r}")

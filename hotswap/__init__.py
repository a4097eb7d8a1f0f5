"""hotswap: a JAX inference engine whose hot weight updates can never serve stale KV."""

from hotswap.config import EngineConfig, ModelConfig
from hotswap.engine.engine import Engine
from hotswap.engine.llm import LLM
from hotswap.engine.outputs import CompletionOutput, RequestOutput
from hotswap.engine.sampling import SamplingParams

__all__ = [
    "LLM",
    "Engine",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineConfig",
    "ModelConfig",
]
__version__ = "0.1.0"

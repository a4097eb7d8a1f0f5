"""The engine's resolved configuration (frozen, validated): what `EngineArgs` resolves into."""

from __future__ import annotations

import dataclasses
import math

from hotswap.args import ATTENTION_IMPLS, WEIGHT_UPDATE_STAGINGS, EngineArgs, defaults
from hotswap.errors import ConfigError

__all__ = ["ATTENTION_IMPLS", "EngineConfig", "check_pages_fit", "default_dtype"]
_ARGS = defaults()  # the options' defaults are written once, in hotswap/args.py


def default_dtype(platform: str) -> str | None:
    """The serving dtype when the user names none, for a JAX platform ("tpu", "gpu", "cpu").

    On TPU, bfloat16: the MXU multiplies bf16 natively and a decode step reads half the HBM
    bytes of f32 weights and KV (activations, KV pages and weights all follow the params'
    dtype; logits, softmax, sampling statistics, RMSNorm and rope accumulate in f32, see
    docs/en/python_api.md "dtype"). Elsewhere None: the checkpoint's own dtype.
    """
    return "bfloat16" if platform == "tpu" else None


def check_pages_fit(num_pages: int, page_size: int, max_model_len: int) -> None:
    """A pool of `num_pages` must hold one `max_model_len` sequence beside the null page (page 0)."""
    pages_per_seq = math.ceil(max_model_len / page_size)
    if pages_per_seq > num_pages - 1:
        raise ConfigError(
            f"num_pages={num_pages} cannot hold one max_model_len={max_model_len} sequence "
            f"({pages_per_seq} pages of {page_size} plus the null page)"
        )


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine knobs, named as in vLLM so users feel at home; their meaning is in `EngineArgs`.

    `num_pages` and `max_model_len` are resolved values here (`EngineArgs` leaves them to be
    sized from the model and the devices); their defaults serve tests and tools that build an
    engine directly.
    """

    page_size: int = _ARGS["page_size"]
    num_pages: int = 512
    # programs/kv_sizing.py decides with it when LLM sizes the cache itself; CPU keeps its own rule.
    gpu_memory_utilization: float = _ARGS["gpu_memory_utilization"]
    max_model_len: int = 1024
    max_num_seqs: int = _ARGS["max_num_seqs"]
    max_num_batched_tokens: int = _ARGS["max_num_batched_tokens"]
    enable_prefix_caching: bool = _ARGS["enable_prefix_caching"]
    weight_update_staging: str = _ARGS["weight_update_staging"]  # weights/in_place.py `resolve`
    # sliding-window layers' pages: a pool bounded by the window, or as many as the full layers'
    # (programs/kv_sizing.py `window_pages` decides how many from this)
    disable_hybrid_kv_cache_manager: bool = _ARGS["disable_hybrid_kv_cache_manager"]
    attention: str = _ARGS["attention"]  # resolved once by the Engine (kernels/backend.py)
    deterministic: bool = _ARGS["deterministic"]  # batch-invariant kernels (kernels/backend.py)
    max_waiting: int = _ARGS["max_waiting"]  # backpressure: QueueFull beyond this
    drain_timeout_s: float = _ARGS["drain_timeout_s"]
    max_version_lag: int | None = _ARGS["max_version_lag"]
    # JAX's persistent compilation cache under hotswap's cache dir (programs/compile_cache.py).
    compilation_cache: bool = _ARGS["compilation_cache"]
    # Adapters served by name (model/lora.py): stacked buffers of max_loras x max_lora_rank.
    enable_lora: bool = _ARGS["enable_lora"]
    max_loras: int = _ARGS["max_loras"]
    max_lora_rank: int = _ARGS["max_lora_rank"]

    enable_return_routed_experts: bool = _ARGS["enable_return_routed_experts"]

    def __post_init__(self):
        for name in (
            "page_size",
            "num_pages",
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_loras",
            "max_lora_rank",
        ):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_version_lag is not None and int(self.max_version_lag) < 0:
            raise ConfigError(f"max_version_lag must be >= 0 (or None), got {self.max_version_lag}")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_pages < 2:
            raise ConfigError("num_pages must be >= 2 (page 0 is the null page)")
        if self.weight_update_staging not in WEIGHT_UPDATE_STAGINGS:
            raise ConfigError(
                f"weight_update_staging={self.weight_update_staging!r}; use one of {', '.join(WEIGHT_UPDATE_STAGINGS)}"
            )
        if self.attention not in ATTENTION_IMPLS:
            raise ConfigError(f"attention={self.attention!r}; use one of {', '.join(ATTENTION_IMPLS)}")
        check_pages_fit(self.num_pages, self.page_size, self.max_model_len)

    @classmethod
    def of(
        cls, args: EngineArgs, *, num_pages: int, max_model_len: int, attention: str | None = None
    ) -> EngineConfig:
        """The config of `args` once the model and the devices are known: the pool's size, the
        sequence bound, and (for a probe) the kernel the backend resolved `attention` to."""
        return cls(
            page_size=args.page_size,
            num_pages=num_pages,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            weight_update_staging=args.weight_update_staging,
            disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
            attention=attention or args.attention,
            deterministic=args.deterministic,
            max_waiting=args.max_waiting,
            drain_timeout_s=args.drain_timeout_s,
            max_version_lag=args.max_version_lag,
            compilation_cache=args.compilation_cache,
            enable_lora=args.enable_lora,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            enable_return_routed_experts=args.enable_return_routed_experts,
        )

    @property
    def pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)

"""The engine's resolved configuration (frozen, validated): what `EngineArgs` resolves into."""

from __future__ import annotations

import dataclasses
import math

from hotswap.errors import ConfigError


def default_dtype(platform: str) -> str | None:
    """The serving dtype when the user names none, for a JAX platform ("tpu", "gpu", "cpu").

    On TPU, bfloat16: the MXU multiplies bf16 natively and a decode step reads half the HBM
    bytes of f32 weights and KV (activations, KV pages and weights all follow the params'
    dtype; logits, softmax, sampling statistics, RMSNorm and rope accumulate in f32, see
    docs/en/python_api.md "dtype"). Elsewhere None: the checkpoint's own dtype.
    """
    return "bfloat16" if platform == "tpu" else None


ATTENTION_IMPLS = ("auto", "reference", "cpu", "pallas")


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
    """Engine knobs, named as in vLLM so users feel at home."""

    page_size: int = 16
    num_pages: int = 512
    # The fraction of an accelerator's free memory that params, KV cache and step temporaries
    # may take when LLM sizes the cache itself (num_pages=None): vLLM's name and default.
    # programs/kv_sizing.py decides; CPU keeps its own rule.
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 1024
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    enable_prefix_caching: bool = True
    # "auto": the Pallas kernel on TPU, the C++ kernels on one CPU device (when they build),
    # else "reference" (jnp). The Engine resolves it once (kernels/backend.py `Backend.choose`).
    attention: str = "auto"
    max_waiting: int = 1024  # backpressure: QueueFull beyond this
    drain_timeout_s: float = 60.0
    # Staleness bound under the `keep` policy (AReaL's max_head_offpolicyness): a running sequence
    # whose oldest KV is more than this many versions behind the weights is recomputed. None: no bound.
    max_version_lag: int | None = None
    # JAX's persistent compilation cache under hotswap's cache dir (programs/compile_cache.py).
    compilation_cache: bool = True

    def __post_init__(self):
        for name in ("page_size", "num_pages", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_version_lag is not None and int(self.max_version_lag) < 0:
            raise ConfigError(f"max_version_lag must be >= 0 (or None), got {self.max_version_lag}")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_pages < 2:
            raise ConfigError("num_pages must be >= 2 (page 0 is the null page)")
        if self.attention not in ATTENTION_IMPLS:
            raise ConfigError(f"attention={self.attention!r}; use one of {', '.join(ATTENTION_IMPLS)}")
        check_pages_fit(self.num_pages, self.page_size, self.max_model_len)

    @property
    def pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)

"""Typed, frozen configuration: the model (from HF config.json) and the engine."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from hotswap.errors import ConfigError

# HF `architectures[0]` -> our family name. Two similar families are cheaper to
# read than a registry, so the differences are plain fields below.
_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
_DTYPES = {"float32", "bfloat16", "float16"}


def default_dtype(platform: str) -> str | None:
    """The serving dtype when the user names none, for a JAX platform ("tpu", "gpu", "cpu").

    On TPU, bfloat16: the MXU multiplies bf16 natively and a decode step reads half the HBM
    bytes of f32 weights and KV (activations, KV pages and weights all follow the params'
    dtype; logits, softmax, sampling statistics, RMSNorm and rope accumulate in f32, see
    docs/en/python_api.md "dtype"). Elsewhere None: the checkpoint's own dtype.
    """
    return "bfloat16" if platform == "tpu" else None


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (the only rope scaling supported)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"config field {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.dtype not in _DTYPES:
            raise ConfigError(f"torch_dtype {self.dtype!r} unsupported; use one of {sorted(_DTYPES)}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict, dtype: str | None = None) -> ModelConfig:
        """Pure function of an HF config.json dict. Raises ConfigError naming the field."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if archs:
            if archs[0] not in _ARCHS:
                raise ConfigError(
                    f"architectures[0]={archs[0]!r} is not supported; supported: {sorted(_ARCHS)}"
                )
            arch = _ARCHS[archs[0]]
        elif model_type in _MODEL_TYPES:
            arch = model_type
        else:
            raise ConfigError(
                f"model_type={model_type!r} is not supported; supported: {sorted(_MODEL_TYPES)}"
            )

        def need(key):
            if key not in cfg:
                raise ConfigError(f"config.json is missing required field {key!r}")
            return cfg[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = cfg.get("head_dim") or hidden // heads

        # transformers 5 moved rope settings into `rope_parameters`; 4.x used
        # top-level `rope_theta` + `rope_scaling`. Accept both.
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or (
            rope if rope.get("rope_type") not in (None, "default") else None
        )
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_scaling = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                rope_scaling = RopeScaling(
                    factor=float(scaling["factor"]),
                    low_freq_factor=float(scaling["low_freq_factor"]),
                    high_freq_factor=float(scaling["high_freq_factor"]),
                    original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                )
            elif kind not in (None, "default"):
                raise ConfigError(f"rope_scaling type {kind!r} is not supported (only 'llama3')")

        if cfg.get("attention_bias") and arch in ("llama", "mistral", "qwen3"):
            raise ConfigError(f"attention_bias=true is not supported for {arch}")
        if cfg.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act={act!r} is not supported (only 'silu')")
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        window = cfg.get("sliding_window")
        uses_window = cfg.get("use_sliding_window", arch == "mistral")
        if uses_window and window is not None and int(window) < max_pos:
            raise ConfigError(f"sliding_window={window} < max_position_embeddings={max_pos} is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        src_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            arch=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            max_position_embeddings=max_pos,
            dtype=dtype or str(src_dtype),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str | None = None) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"{path} not found") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_hf(data, dtype=dtype)


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
    # engine/kv_sizing.py decides; CPU keeps its own rule.
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
    # JAX's persistent compilation cache under hotswap's cache dir (engine/compile_cache.py).
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

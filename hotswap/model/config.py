"""The model's configuration: one frozen value from an HF config.json (GGUF metadata and NNX
configs are read into the same dict form), with the family differences as plain fields."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hotswap.errors import ConfigError

# HF `architectures[0]` -> our family name. Two similar families are cheaper to
# read than a registry, so the differences are plain fields below.
_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"}
_DTYPES = {"float32", "bfloat16", "float16"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (the only rope scaling supported)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "qwen3_moe" | "mixtral"
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
    # Mixture of experts (model/moe.py): 0 experts is a dense model. A layer is sparse unless it
    # is in `mlp_only_layers` or off the `decoder_sparse_step` grid (HF Qwen3-MoE's rule).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

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
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ConfigError(
                    f"moe_intermediate_size ({self.moe_intermediate_size}) and decoder_sparse_step "
                    f"({self.decoder_sparse_step}) must be > 0"
                )

    def is_moe_layer(self, i: int) -> bool:
        """Layer `i` routes its MLP through experts (HF Qwen3-MoE's rule; Mixtral: every layer)."""
        return (
            self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The sparse layers, in order: the second axis of a routing record."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

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

        if cfg.get("attention_bias") and arch != "qwen2":
            raise ConfigError(f"attention_bias=true is not supported for {arch}")
        if cfg.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act={act!r} is not supported (only 'silu')")
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        window = cfg.get("sliding_window")
        uses_window = cfg.get("use_sliding_window", arch in ("mistral", "mixtral"))
        if uses_window and window is not None and int(window) < max_pos:
            raise ConfigError(f"sliding_window={window} < max_position_embeddings={max_pos} is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        src_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        moe = _moe_fields(arch, cfg)
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
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            max_position_embeddings=max_pos,
            dtype=dtype or str(src_dtype),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **moe,
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


def _moe_fields(arch: str, cfg: dict) -> dict:
    """The experts' fields of an HF config: Qwen3-MoE's names, or Mixtral's (`num_local_experts`,
    experts of `intermediate_size`, every layer sparse, top-k always renormalised)."""
    if arch == "qwen3_moe":
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if key not in cfg:
                raise ConfigError(f"config.json is missing required field {key!r}")
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
            raise ConfigError(f"mlp_only_layers must be a list of layer indices, got {only!r}")
        return {
            "num_experts": int(cfg["num_experts"]),
            "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(cfg.get("decoder_sparse_step", 1)),
            "mlp_only_layers": tuple(sorted(only)),
        }
    if arch == "mixtral":
        for key in ("num_local_experts", "num_experts_per_tok", "intermediate_size"):
            if key not in cfg:
                raise ConfigError(f"config.json is missing required field {key!r}")
        return {
            "num_experts": int(cfg["num_local_experts"]),
            "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["intermediate_size"]),
            "norm_topk_prob": True,
        }
    return {}

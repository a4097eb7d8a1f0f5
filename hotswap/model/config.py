"""The model's configuration: one frozen value from an HF config.json (GGUF metadata and NNX
configs are read into the same dict form), with the family differences as plain fields.

Sliding-window attention is per layer (`layer_types`, HF's names): Gemma 2 alternates
sliding and full layers, Gemma 3 has five sliding layers to one full, Mistral with a
`sliding_window` slides on every layer. A window counts the query itself: position i
sees positions j with i - window < j <= i."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hotswap.errors import ConfigError
from hotswap.model.hf_spellings import FULL, SLIDING, spelled, standard

# HF `architectures[0]` -> our family name. Two similar families are cheaper to
# read than a registry, so the differences are plain fields below.
_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
# config.json `model_type` -> our family name (used when `architectures` is absent).
_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
}
GEMMA = ("gemma2", "gemma3")
_ACTS = {"silu", "gelu_pytorch_tanh"}
_DTYPES = {"float32", "bfloat16", "float16"}
QUANTIZATIONS = ("int8", "fp8", "gguf")  # `weights/quantize.py`


def hf_names(arch: str) -> tuple[str, str]:
    """A family's names in HF's config.json: (`model_type`, `architectures[0]`)."""
    model_type = next(t for t, a in _MODEL_TYPES.items() if a == arch)
    return model_type, next(c for c, a in _ARCHS.items() if a == arch)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling, as HF computes it: "llama3" (long wavelengths divided by
    `factor`, a smooth blend between) or "linear" (every frequency divided by `factor`:
    Gemma 3's global layers). The llama3 fields are unused by "linear"."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_position_embeddings: int = 0
    rope_type: str = "llama3"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma2" | "gemma3" | "qwen3_moe" | "mixtral"
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
    # How matmul weights are served (`weights/quantize.py`): None (in `dtype`), "int8", "fp8",
    # or "gguf" (a GGUF file's blocks as they are); int8's scales per output column, or per
    # group of `quantization_group_size` inputs.
    quantization: str | None = None
    quantization_group_size: int | None = None
    # The KV pages' dtype when it is not `dtype` (`kv_cache_dtype`; `kv_dtype` reads it).
    kv_cache_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Sliding windows: `layer_types[i]` is SLIDING or FULL; a SLIDING layer attends to the
    # last `sliding_window` positions (itself included). None: every layer is full.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # Gemma: s = cap * tanh(s / cap) on the scaled attention scores (per layer) and on the
    # final logits; the attention scale query_pre_attn_scalar**-0.5 instead of head_dim**-0.5;
    # Gemma 3's sliding layers' rope base (its full layers use rope_theta and rope_scaling).
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    rope_local_base_freq: float | None = None
    hidden_act: str = "silu"  # "silu" (SwiGLU) | "gelu_pytorch_tanh" (Gemma's GeGLU)
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
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in _DTYPES:
            raise ConfigError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} unsupported; use one of {sorted(_DTYPES)}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization={self.quantization!r}; use one of {', '.join(QUANTIZATIONS)} (or none)"
            )
        if self.quantization_group_size is not None and self.quantization != "int8":
            raise ConfigError(
                f"quantization_group_size applies to quantization='int8', not {self.quantization!r}"
            )
        if self.hidden_act not in _ACTS:
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported; supported: {sorted(_ACTS)}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(
                    f"layer_types has {len(self.layer_types)} entries but num_hidden_layers="
                    f"{self.num_layers}: it needs one per layer"
                )
            unknown = sorted({t for t in self.layer_types if t not in (SLIDING, FULL)})
            if unknown:
                raise ConfigError(f"layer_types holds {unknown}: each entry must be {SLIDING!r} or {FULL!r}")
            if SLIDING in self.layer_types and not self.sliding_window:
                raise ConfigError("layer_types has sliding layers but sliding_window is not set")
        if self.sliding_window is not None and int(self.sliding_window) <= 0:
            raise ConfigError(f"sliding_window must be > 0, got {self.sliding_window}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not float(value) > 0:
                raise ConfigError(f"config field {name} must be > 0 (or null), got {value}")

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

    @property
    def is_gemma(self) -> bool:
        """Gemma's layer: (1 + w) norms, a norm after attention and after the MLP, scaled embeddings."""
        return self.arch in GEMMA

    @property
    def kv_dtype(self) -> str:
        """The KV pages' dtype: `kv_cache_dtype` when given, else `dtype`."""
        return self.kv_cache_dtype or self.dtype

    def with_kv_cache_dtype(self, choice: str) -> ModelConfig:
        """This model with the `kv_cache_dtype` option applied ("auto": the pages in `dtype`)."""
        return dataclasses.replace(self, kv_cache_dtype=None if choice in ("auto", self.dtype) else choice)

    def first_layers(self, n: int) -> ModelConfig:
        """This model cut to its first n layers (their windows and experts as they are): a
        self-speculative draft (engine/self_draft.py)."""
        types = None if self.layer_types is None else self.layer_types[:n]
        dense = tuple(i for i in self.mlp_only_layers if i < n)
        return dataclasses.replace(self, num_layers=n, layer_types=types, mlp_only_layers=dense)

    def layer_window(self, i: int) -> int | None:
        """Layer i's attention window (positions it sees, itself included); None: all before it."""
        if self.layer_types is None or self.layer_types[i] != SLIDING:
            return None
        return self.sliding_window

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
        """Pure function of an HF config.json dict, as any transformers from 4.56 on writes it
        (hf_spellings.py). Raises ConfigError naming the field."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
        cfg = standard(cfg)
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if archs:
            if archs[0] == "Gemma3ForConditionalGeneration":
                raise ConfigError(
                    "architectures[0]='Gemma3ForConditionalGeneration' (Gemma 3 with its vision tower) "
                    "is not supported: serve the text model, a Gemma3ForCausalLM checkpoint "
                    "(model_type 'gemma3_text', tensors named model.layers.*)"
                )
            if archs[0] not in _ARCHS:
                raise ConfigError(
                    f"architectures[0]={archs[0]!r} is not supported; supported: {sorted(_ARCHS)}"
                )
            arch = _ARCHS[archs[0]]
        elif model_type in _MODEL_TYPES:
            arch = _MODEL_TYPES[model_type]
        else:
            raise ConfigError(
                f"model_type={model_type!r} is not supported; supported: {sorted(_MODEL_TYPES)}"
            )

        def need(key):
            if key not in cfg:
                raise ConfigError(f"config.json is missing required field {spelled(key)}")
            return cfg[key]

        # The fields beyond the Llama family's: Gemma's, or a Mistral window.
        extra = _gemma_fields(cfg, arch) if arch in GEMMA else {}
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = cfg.get("head_dim") or (_GEMMA_DEFAULTS["head_dim"] if arch in GEMMA else hidden // heads)

        # Rope as transformers 4.x spelled it (hf_spellings.standard reads 5.x's `rope_parameters`
        # into it): the full layers' base and scaling; Gemma 3's sliding layers' base is extra's.
        default_theta = extra.pop("rope_theta", 10000.0)
        theta = float(cfg.get("rope_theta", default_theta))
        scaling = cfg.get("rope_scaling")
        rope_scaling = _rope_scaling(scaling) if scaling else None

        if cfg.get("attention_bias") and arch != "qwen2":
            raise ConfigError(f"attention_bias=true is not supported for {arch}")
        if cfg.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported")
        act = cfg.get("hidden_act", "silu")
        if arch not in GEMMA and act != "silu":
            raise ConfigError(f"hidden_act={act!r} is not supported for {arch} (only 'silu')")
        max_pos = int(cfg.get("max_position_embeddings", extra.pop("max_position_embeddings", 4096)))
        window = cfg.get("sliding_window")
        if arch in ("mistral", "mixtral") and window is not None and int(window) < max_pos:
            # Mistral and Mixtral slide on every layer; a window of the whole context is no window.
            extra = {
                "sliding_window": int(window),
                "layer_types": (SLIDING,) * int(need("num_hidden_layers")),
            }
        elif arch in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window") and window is not None:
            if int(window) < max_pos:
                raise ConfigError(
                    f"sliding_window={window} < max_position_embeddings={max_pos} is not supported for {arch}"
                )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        src_dtype = cfg.get("dtype") or "float32"
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
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in GEMMA)),
            qkv_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
            max_position_embeddings=max_pos,
            dtype=dtype or str(src_dtype),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **extra,
            **_moe_fields(arch, cfg),
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


def _rope_scaling(scaling: dict) -> RopeScaling | None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    if kind == "linear":
        return RopeScaling(factor=float(scaling["factor"]), rope_type="linear")
    if kind not in (None, "default"):
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (only 'llama3' and 'linear')")
    return None


# transformers' defaults for fields a Gemma config.json may leave out (Gemma2Config,
# Gemma3TextConfig), so a sparse config means what it means to HF.
_GEMMA_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096}
_GEMMA_FAMILY_DEFAULTS = {
    "gemma2": {
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
    },
    "gemma3": {
        "final_logit_softcapping": None,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 131072,
        "rope_local_base_freq": 10000.0,
        "sliding_window_pattern": 6,
    },
}


def _gemma_fields(cfg: dict, arch: str) -> dict:
    """The Gemma fields of ModelConfig from an HF Gemma 2 / Gemma 3 config (HF's defaults for
    absent ones). `rope_theta` and `max_position_embeddings` come back as defaults for the caller.
    Without `layer_types`, HF derives them: Gemma 2 alternates (layer 0 sliding), Gemma 3 has
    every `sliding_window_pattern`-th layer full."""
    defaults = {**_GEMMA_DEFAULTS, **_GEMMA_FAMILY_DEFAULTS[arch]}

    def get(key):
        return cfg.get(key, defaults.get(key))

    def opt_float(key):
        value = get(key)
        return None if value is None else float(value)

    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention=true (an embedding model) is not supported")
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"  # HF's Gemma MLP reads only this one
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"hidden_activation={act!r} is not supported for {arch} (only 'gelu_pytorch_tanh')")
    n = cfg.get("num_hidden_layers")
    types = cfg.get("layer_types")
    if types is None and isinstance(n, int):
        every = 2 if arch == "gemma2" else int(get("sliding_window_pattern"))
        types = [SLIDING if (i + 1) % every else FULL for i in range(n)]
    if types is not None and not isinstance(types, (list, tuple)):
        raise ConfigError(f"layer_types must be a list, got {types!r}")
    window = get("sliding_window")
    out = {
        "sliding_window": None if window is None else int(window),
        "layer_types": None if types is None else tuple(types),
        # HF's Gemma 3 attention never applies the field (its config still carries it).
        "attn_logit_softcapping": opt_float("attn_logit_softcapping") if arch == "gemma2" else None,
        "final_logit_softcapping": opt_float("final_logit_softcapping"),
        "query_pre_attn_scalar": opt_float("query_pre_attn_scalar"),
        "hidden_act": act,
        "rope_theta": defaults["rope_theta"],
        "max_position_embeddings": defaults["max_position_embeddings"],
    }
    if arch == "gemma3":  # the sliding layers' rope base, unscaled (HF scales only the full layers')
        out["rope_local_base_freq"] = float(get("rope_local_base_freq"))
    return out


def _moe_fields(arch: str, cfg: dict) -> dict:
    """The experts' fields of an HF config (its names read into one by hf_spellings): Qwen3-MoE's,
    or Mixtral's (experts of `intermediate_size`, every layer sparse, top-k always renormalised)."""
    if arch == "qwen3_moe":
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if key not in cfg:
                raise ConfigError(f"config.json is missing required field {spelled(key)}")
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
        for key in ("num_experts", "num_experts_per_tok", "intermediate_size"):
            if key not in cfg:
                raise ConfigError(f"config.json is missing required field {spelled(key)}")
        return {
            "num_experts": int(cfg["num_experts"]),
            "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["intermediate_size"]),
            "norm_topk_prob": True,
        }
    return {}

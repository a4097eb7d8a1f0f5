"""config.json as each transformers writes it: every family's config in the spelling of 4.56 (top-level
`rope_theta` / `rope_scaling`, `torch_dtype`, Qwen3-MoE's `num_experts`) and of 5.x (`rope_parameters`,
Gemma 3's per layer type, `dtype`, Qwen3-MoE's `num_local_experts`) is the same ModelConfig, and the
one transformers itself reads from either (the oracle: the installed transformers, 5.12 in the main
environment and the newest in .venv-newest). Literal dicts, trimmed from what each version's
`save_pretrained` writes (hotswap/model/hf_spellings.py says where each spelling comes from)."""

from __future__ import annotations

import pytest
import transformers

from hotswap.errors import ConfigError
from hotswap.model.config import ModelConfig

pytestmark = pytest.mark.transformers_matrix

SHAPE = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
GEMMA = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 12, "sliding_window": 8}
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": True, "mlp_only_layers": [1]}
# family -> (fields both spellings share, transformers 4.56's spelling, 5.x's spelling)
FAMILIES = {
    "llama": (
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu"},
        {
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", **LLAMA3},
            "torch_dtype": "bfloat16",
        },
        {"rope_parameters": {"rope_type": "llama3", **LLAMA3, "rope_theta": 500000.0}, "dtype": "bfloat16"},
    ),
    "qwen2": (
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False},
        # configs older than 4.56 name the kind `type` (4.56 writes both, 5.x reads either)
        {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}, "torch_dtype": "float32"},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}, "dtype": "float32"},
    ),
    "qwen3": (
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "tie_word_embeddings": True},
        {"rope_theta": 1e6, "rope_scaling": None, "torch_dtype": "bfloat16"},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "dtype": "bfloat16"},
    ),
    "qwen3_moe": (
        {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **MOE},
        {"num_experts": 8, "rope_theta": 1e6, "rope_scaling": None, "torch_dtype": "bfloat16"},
        {
            "num_local_experts": 8,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            "dtype": "bfloat16",
        },
    ),
    "mistral": (
        {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 16},
        {"rope_theta": 1e6, "torch_dtype": "float32"},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "dtype": "float32"},
    ),
    "mixtral": (
        {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4},
        {"num_experts_per_tok": 2, "rope_theta": 1e6, "torch_dtype": "float32"},
        {
            "num_experts_per_tok": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            "dtype": "float32",
        },
    ),
    "gemma2": (
        {
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            **GEMMA,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
        {"rope_theta": 10000.0, "torch_dtype": "bfloat16"},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "dtype": "bfloat16"},
    ),
    "gemma3": (
        {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            **GEMMA,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        {
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "torch_dtype": "bfloat16",
        },
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            "dtype": "bfloat16",
        },
    ),
}


def _config(family: str, spelling: int) -> dict:
    shared, *spellings = FAMILIES[family]
    return {**SHAPE, **shared, **spellings[spelling]}


def _as_transformers_reads_it(d: dict) -> dict:
    """The fields transformers' own config class reads from `d` (5.x's attributes)."""
    fields = {k: v for k, v in d.items() if k not in ("architectures", "model_type")}
    hf = transformers.AutoConfig.for_model(d["model_type"], **fields)
    rope = dict(hf.rope_parameters)
    full, local = rope.get("full_attention", rope), rope.get("sliding_attention") or {}
    return {
        "rope_theta": full["rope_theta"],
        "rope_type": full.get("rope_type", "default"),
        "factor": full.get("factor"),
        "local_theta": local.get("rope_theta"),
        "num_experts": getattr(hf, "num_experts", 0),
        "dtype": str(hf.dtype).removeprefix("torch."),
    }


def _ours(cfg: ModelConfig) -> dict:
    scaling = cfg.rope_scaling
    return {
        "rope_theta": cfg.rope_theta,
        "rope_type": "default" if scaling is None else scaling.rope_type,
        "factor": None if scaling is None else scaling.factor,
        "local_theta": cfg.rope_local_base_freq,
        "num_experts": cfg.num_experts,
        "dtype": cfg.dtype,
    }


@pytest.mark.parametrize("family", list(FAMILIES))
def test_both_spellings_are_one_config_as_transformers_reads_them(family):
    old, new = (ModelConfig.from_hf(_config(family, s)) for s in (0, 1))
    assert old == new
    assert _ours(new) == _as_transformers_reads_it(_config(family, 0))
    assert _ours(new) == _as_transformers_reads_it(_config(family, 1))


def test_the_fields_the_spellings_carry():
    qwen_moe = ModelConfig.from_hf(_config("qwen3_moe", 1))
    assert (qwen_moe.num_experts, qwen_moe.moe_layers, qwen_moe.dtype) == (8, (0, 2), "bfloat16")
    llama = ModelConfig.from_hf(_config("llama", 1)).rope_scaling
    assert (llama.rope_type, llama.factor, llama.high_freq_factor) == ("llama3", 8.0, 4.0)
    gemma3 = ModelConfig.from_hf(_config("gemma3", 1))
    assert (gemma3.rope_theta, gemma3.rope_local_base_freq, gemma3.rope_scaling.factor) == (1e6, 1e4, 8.0)
    # transformers 5.12 leaves a flat, unset rope entry beside Gemma 3's per-layer-type ones
    mixed = _config("gemma3", 1)
    mixed["rope_parameters"] = {**mixed["rope_parameters"], "rope_type": "default", "rope_theta": None}
    assert ModelConfig.from_hf(mixed) == gemma3


@pytest.mark.parametrize(
    "changes,message",
    [
        # two spellings of one field that disagree: transformers versions differ on which wins
        ({"num_experts": 4}, r"num_experts=4 and num_local_experts=8: two spellings of 'num_experts'"),
        ({"torch_dtype": "float32"}, r"dtype='bfloat16' and torch_dtype='float32'"),
        # another family's name for the field is not one of Qwen3-MoE's
        (
            {"num_local_experts": None, "n_routed_experts": 8},
            r"missing required field 'num_experts' \(or 'num_local_experts'\)",
        ),
        ({"rope_parameters": [1e6]}, "rope_parameters must be an object"),
        ({"rope_parameters": {"full_attention": 1e6}}, "rope_parameters.full_attention must be an object"),
        ({"rope_scaling": "linear"}, "rope_scaling must be an object"),
    ],
)
def test_bad_spellings_name_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**_config("qwen3_moe", 1), **changes})

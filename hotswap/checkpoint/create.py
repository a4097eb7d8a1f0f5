"""Write a seeded random-weight HF-format checkpoint (tests, demos, benchmarks).

The directory loads in hotswap and in transformers (`AutoModelForCausalLM`,
`AutoTokenizer`) alike, so tests can use transformers as the oracle without any
download. The tokenizer is a byte-level BPE trained here on a small built-in
English corpus: byte-level means any text encodes, and training is
deterministic, so the same call always writes the same directory.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from hotswap.checkpoint.hf import params_from_hf, save_hf_dir
from hotswap.errors import ConfigError
from hotswap.model.config import FULL, SLIDING, ModelConfig
from hotswap.model.spec import hf_specs

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]  # ids 0..3
BOS_ID, EOT_ID, IM_END_ID = 0, 1, 3

# ChatML with a leading BOS; raise_exception exercises the renderer's helper.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_ARCHS = {
    "llama": ("LlamaForCausalLM", {"attention_bias": False, "mlp_bias": False}),
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": None}),
    "qwen3": (
        "Qwen3ForCausalLM",
        {"attention_bias": False, "use_sliding_window": False, "sliding_window": None},
    ),
    # Tiny-model Gemma defaults: a window (16) shorter than test prompts, an attention scale that
    # is not head_dim's, and for Gemma 3 every second layer full, so the 2-layer preset has both.
    "gemma2": (
        "Gemma2ForCausalLM",
        {
            "hidden_activation": "gelu_pytorch_tanh",
            "attention_bias": False,
            "sliding_window": 16,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            "hidden_activation": "gelu_pytorch_tanh",
            "attention_bias": False,
            "sliding_window": 16,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": 24,
            "rope_local_base_freq": 10000.0,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
        },
    ),
    # Sparse: the preset's `intermediate_size` serves the dense layers (mlp_only_layers) and,
    # unless overridden, the experts; 8 experts, top-2, renormalised.
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        {
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": 0.0,
        },
    ),
    "mixtral": (
        "MixtralForCausalLM",
        {
            "sliding_window": None,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.0,
        },
    ),
}
_MODEL_TYPES = {"gemma3": "gemma3_text"}  # config.json model_type where it is not the family name

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small language model learns which word tends to follow
another, and with enough text it begins to write sentences that almost make sense.
Once upon a time there was a little robot who lived in a quiet town by the sea. Every morning the robot
walked to the harbour, counted the boats, and wrote the number in a notebook. The fishermen laughed, but
the robot did not mind. It liked numbers, and it liked the sound of the water against the stones.
Weather report: tomorrow will be cloudy in the morning with light rain in the afternoon. Temperatures
will stay between twelve and eighteen degrees. The wind will come from the west at twenty kilometres per
hour, and the sea will be calm near the coast.
To bake bread, mix flour, water, salt and yeast in a large bowl. Knead the dough for ten minutes until it
is smooth, then let it rise for one hour. Shape the loaf, bake it in a hot oven for forty minutes, and let
it cool before you cut it.
What is the capital of France? The capital of France is Paris. What is two plus two? Two plus two is four.
Who wrote the play about the prince of Denmark? It was written by William Shakespeare.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
Science explains the world with experiments. Water boils at one hundred degrees at sea level. The earth
goes around the sun once a year, and the moon goes around the earth about once a month. Light travels
faster than sound, which is why you see lightning before you hear thunder.
Hello! How are you today? I am fine, thank you. Would you like a cup of tea or coffee? Tea, please, with
a little milk and no sugar. The train leaves at half past nine from platform three.
"""


def load_preset(name: str) -> dict[str, Any]:
    """A preset's HF config fields, by name (`hotswap/configs/{name}.json`) or by path to a JSON file."""
    path = Path(name)
    if path.suffix == ".json" and path.exists():
        text = path.read_text()
    else:
        presets = resources.files("hotswap") / "configs"
        file = presets / f"{name}.json"
        if not file.is_file():
            names = sorted(p.name[:-5] for p in presets.iterdir() if p.name.endswith(".json"))
            raise ConfigError(f"unknown preset {name!r}; available: {names}")
        text = file.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"preset {name!r} is not valid JSON: {e}") from e
    return {k: v for k, v in data.items() if not k.startswith("_")}


def hf_config_for(
    preset: dict[str, Any], arch: str, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """config.json for `arch` from preset fields + overrides, rope in transformers-5 form.

    Overrides may use the legacy `rope_theta` / `rope_scaling` keys; they are
    folded into `rope_parameters`, which is what transformers 5 writes and reads.
    """
    if arch not in _ARCHS:
        raise ConfigError(f"arch={arch!r} is not supported; supported: {sorted(_ARCHS)}")
    cls, arch_fields = _ARCHS[arch]
    merged: dict[str, Any] = {**preset, **(overrides or {})}
    rope = dict(merged.pop("rope_parameters", None) or {})
    rope.setdefault("rope_theta", float(merged.pop("rope_theta", 10000.0)))
    scaling = merged.pop("rope_scaling", None)
    if scaling:
        rope.update(scaling)
        rope["rope_type"] = scaling.get("rope_type", scaling.get("type"))
        rope.pop("type", None)
    rope.setdefault("rope_type", "default")
    # Always explicit: Qwen3's transformers default head_dim (128) is not hidden/heads.
    head_dim = merged.pop("head_dim", None) or merged["hidden_size"] // merged["num_attention_heads"]
    if arch == "qwen3_moe":
        merged.setdefault("moe_intermediate_size", merged["intermediate_size"])
    hf = {
        "architectures": [cls],
        "model_type": _MODEL_TYPES.get(arch, arch),
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "bos_token_id": BOS_ID,
        "eos_token_id": [EOT_ID, IM_END_ID],
        "pad_token_id": EOT_ID,
        "dtype": "float32",
        "use_cache": True,
        **arch_fields,
        **merged,
        "head_dim": int(head_dim),
        "rope_parameters": rope,
    }
    cfg = ModelConfig.from_hf(hf)  # fail here, naming the field, rather than in a later load
    if cfg.is_gemma:  # written out, as transformers 5 writes them: HF and hotswap read the same layers
        hf.pop("sliding_window_pattern", None)
        hf["layer_types"] = list(cfg.layer_types)
        hf.pop("hidden_act")
    if cfg.rope_local_base_freq is not None:  # Gemma 3: one rope per layer type
        local = {"rope_type": "default", "rope_theta": float(hf.pop("rope_local_base_freq"))}
        hf["rope_parameters"] = {FULL: rope, SLIDING: local}
    return hf


def _random_tensors(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """HF-layout float32 weights; norms near 1 and nonzero biases so neither is a no-op in tests."""
    rng = np.random.default_rng(seed)
    out = {}
    norm_center = np.float32(0.0 if cfg.is_gemma else 1.0)  # Gemma's norms scale by (1 + w)
    for name, spec in hf_specs(cfg).items():
        noise = rng.standard_normal(spec.hf_shape, dtype=np.float32)
        if name.endswith("norm.weight"):
            out[name] = norm_center + np.float32(0.1) * noise
        elif name.endswith(".bias"):
            out[name] = np.float32(0.1) * noise
        elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            # routers: scores a few units apart, so each token has clear favourites as in a
            # trained MoE (not near-ties that a rounding difference would flip)
            out[name] = np.float32(0.5) * noise
        else:
            out[name] = np.float32(0.02) * noise
    return out


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on the built-in corpus, special tokens first (ids 0..3)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ConfigError(f"vocab_size={vocab_size} is too small for a byte-level tokenizer (need >= 260)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    bos = SPECIAL_TOKENS[BOS_ID]
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, BOS_ID)]
            ),
        ]
    )
    return tok


def _tokenizer_config(max_len: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[IM_END_ID],
        "pad_token": SPECIAL_TOKENS[EOT_ID],
        "unk_token": None,  # else transformers 5 Qwen2Tokenizer adds an <|endoftext|> beyond the vocab
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def create_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    arch: str = "llama",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json to `out_dir`.

    `overrides` are HF config fields (e.g. `tie_word_embeddings`, `head_dim`,
    `rope_scaling={"rope_type": "llama3", ...}`, `dtype="bfloat16"`).
    """
    hf = hf_config_for(load_preset(preset), arch, overrides)
    cfg = ModelConfig.from_hf(hf)
    tok = build_tokenizer(cfg.vocab_size)
    if tok.get_vocab_size() > cfg.vocab_size:  # cannot happen: the trainer stops at vocab_size
        raise ConfigError(f"tokenizer has {tok.get_vocab_size()} tokens > vocab_size {cfg.vocab_size}")

    out = Path(out_dir)
    save_hf_dir(hf, params_from_hf(cfg, _random_tensors(cfg, seed)), out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(cfg.max_position_embeddings), indent=2) + "\n"
    )
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [EOT_ID, IM_END_ID], "pad_token_id": EOT_ID}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out

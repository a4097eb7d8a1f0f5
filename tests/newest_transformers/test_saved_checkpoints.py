"""Checkpoints saved by the newest transformers (.venv-newest; tests/conftest.py collects this folder
only there) load in hotswap and score as transformers does: its current config.json spellings
(Qwen3-MoE's `num_local_experts`, rope under `rope_parameters`, Gemma 3's rope per layer type;
hotswap/model/hf_spellings.py) mean to hotswap what they mean to transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from hotswap import LLM
from hotswap.programs import tpu_slice

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500000.0,
}
# family -> (config class, model class, fields beyond TINY, what the saved config.json must spell
# in the current form: the test is only worth its time if transformers wrote the new names)
CASES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True},
        lambda c: "rope_theta" not in c and c["rope_parameters"]["rope_theta"] == 500000.0,
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
        lambda c: c["num_local_experts"] == 8 and "num_experts" not in c and "rope_theta" not in c,
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "sliding_window": 8,
            "query_pre_attn_scalar": 12,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
        lambda c: (
            set(c["rope_parameters"]) == {"full_attention", "sliding_attention"}
            and "rope_local_base_freq" not in c
        ),
    ),
}


def _saved(tmp_path, family: str):
    """A seeded tiny `family` model, saved by transformers; (the model, its directory)."""
    config_cls, model_cls, fields, _ = CASES[family]
    config = getattr(transformers, config_cls)(**TINY, **fields)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # Gemma's norms start at 0 ((1 + w) = 1), biases at 0: perturb all
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path / family)
    model.set_attn_implementation("eager")
    return model, tmp_path / family


@pytest.mark.parametrize("family", list(CASES))
def test_checkpoint_saved_by_transformers_scores_as_transformers(tmp_path, family):
    model, model_dir = _saved(tmp_path, family)
    saved = json.loads((model_dir / "config.json").read_text())
    assert saved["transformers_version"] == transformers.__version__
    assert CASES[family][3](saved), f"transformers {transformers.__version__} wrote {saved}"

    llm = LLM(model_dir, max_model_len=256, warmup=False)
    seqs = [np.random.default_rng(n).integers(0, TINY["vocab_size"], n).tolist() for n in (17, 90)]
    ours = llm.score([(s[:1], s[1:]) for s in seqs])
    for seq, lp in zip(seqs, ours, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0].float()
        theirs = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
        worst = float(np.abs(lp - theirs.numpy()).max())
        assert worst <= 1e-4, f"{family}, {len(seq)} tokens: max |dlogprob| {worst:.2e}"


def test_aot_reads_the_config_transformers_saves(tmp_path):
    """`hotswap aot DIR`'s model: the Qwen3-MoE config.json transformers writes (config only)."""
    config_cls, _, fields, _ = CASES["qwen3_moe"]
    getattr(transformers, config_cls)(**TINY, **fields).save_pretrained(tmp_path)
    cfg = tpu_slice.load_model_config(str(tmp_path), "bfloat16")
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        "qwen3_moe",
        8,
        2,
        24,
    )
    assert cfg.moe_layers == (0, 2) and cfg.norm_topk_prob and cfg.dtype == "bfloat16"

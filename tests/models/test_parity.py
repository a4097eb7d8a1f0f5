"""Numerical parity with HF transformers (PyTorch CPU, float32) through the public `LLM.score`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from hotswap import LLM
from hotswap.checkpoint.create import create_checkpoint

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CASES = {
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope-scaling+head_dim": (
        "llama",
        {"rope_scaling": LLAMA3_ROPE, "head_dim": 32, "rope_theta": 500000.0},
    ),
    "mistral": ("mistral", {}),
    "qwen2-qkv-bias": ("qwen2", {}),
    "qwen3-qk-norm+head_dim": ("qwen3", {"head_dim": 24}),
}
# Mixtures of experts (model/moe.py): a dense layer among sparse ones; 16 experts top-4 with the
# top-k probabilities as they are; Mixtral's names and renormalised top-2.
MOE_CASES = {
    "qwen3-moe-8x2-norm+dense-layer": (
        "qwen3_moe",
        {"num_hidden_layers": 3, "mlp_only_layers": [1], "moe_intermediate_size": 32},
    ),
    "qwen3-moe-16x4-unnorm": (
        "qwen3_moe",
        {"num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": False, "moe_intermediate_size": 32},
    ),
    "mixtral-8x2": ("mixtral", {"intermediate_size": 48}),
}
CASES |= MOE_CASES
# The cheap cases of the families whose config.json transformers 5 respells, also run with the
# newest transformers (.venv-newest, `make test`).
NEWEST_TOO = {"llama-untied", "llama-tied", "llama3-rope-scaling+head_dim", "qwen3-moe-8x2-norm+dense-layer"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.transformers_matrix) if n in NEWEST_TOO else n for n in CASES]
)
def test_score_matches_transformers(tmp_path, name):
    arch, overrides = CASES[name]
    model_dir = create_checkpoint(tmp_path / name, preset="tiny", arch=arch, seed=11, overrides=overrides)
    llm = LLM(model_dir, max_model_len=256, warmup=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    rng = np.random.default_rng(0)
    # prompts of different lengths, long enough for rope scaling to matter (positions > 32)
    seqs = [rng.integers(0, llm.config.vocab_size, int(n)).tolist() for n in (2, 17, 64, 150)]
    ours = llm.score([(s[:1], s[1:]) for s in seqs])  # every position after the first
    worst = 0.0
    for s, lp in zip(seqs, ours, strict=True):
        with torch.no_grad():
            logits = ref(torch.tensor([s])).logits[0].float()
        theirs = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(s[1:])[:, None])[:, 0].numpy()
        worst = max(worst, float(np.abs(lp - theirs).max()))
    assert worst <= 1e-4, f"{name}: max |dlogprob| {worst:.2e}"

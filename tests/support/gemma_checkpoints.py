"""The seeded Gemma 2, Gemma 3 and Mistral-window checkpoints of tests/models/test_gemma.py
(also run through each attention path by tests/kernels/test_window_attention.py): windows (16)
shorter than the prompts, GQA (4 query heads on 2 KV heads), tied heads, head_dim 32."""

from __future__ import annotations

import numpy as np
from safetensors.numpy import load_file, save_file

from hotswap.checkpoint.create import create_checkpoint

TINY = {"tie_word_embeddings": True, "head_dim": 32}
CASES = {
    # layers: sliding, full; both softcaps
    "gemma2": ("gemma2", {**TINY, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 3.0}),
    # layers: sliding, full, sliding; local rope base 1e4, global 1e6 with linear scaling x8
    "gemma3": (
        "gemma3",
        {
            **TINY,
            "num_hidden_layers": 3,
            "rope_theta": 1e6,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
    ),
    "mistral-window": ("mistral", {"sliding_window": 16}),
}


def sharpen(model_dir, qk: float = 4.0, head: float = 8.0) -> None:
    """q/k projections x qk, Gemma's final norm (1 + w) x head: larger scores and logits."""
    t = load_file(model_dir / "model.safetensors")
    t["model.norm.weight"] = (1 + t["model.norm.weight"]) * np.float32(head) - 1
    for name in t:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            t[name] = t[name] * np.float32(qk)
    save_file(t, model_dir / "model.safetensors", metadata={"format": "pt"})


def seeded_checkpoint(tmp_path, name: str):
    """CASES[name] written under tmp_path (seed 11), sharpened unless Mistral."""
    arch, overrides = CASES[name]
    model_dir = create_checkpoint(tmp_path / name, preset="tiny", arch=arch, seed=11, overrides=overrides)
    if arch != "mistral":
        sharpen(model_dir)
    return model_dir


# Gemma 3's chat template, as its tokenizer_config.json has it (text content only).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    '{%- else -%}{%- set first_user_prefix = "" -%}{%- set loop_messages = messages -%}{%- endif -%}'
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\\n'}}{%- endif -%}"
)

"""Seeded LoRA adapters written by PEFT itself, and PEFT as the oracle (HF transformers + PEFT,
f32, eager attention): what tests/test_lora*.py compare the engine with."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf_model(base_dir):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def make_adapter(
    base_dir, out_dir, *, seed: int, rank: int = 8, alpha: float = 16.0, targets=TARGETS, std: float = 0.05
) -> Path:
    """A PEFT LoRA adapter on `base_dir`'s model, saved by `save_pretrained` (safetensors and
    adapter_config.json). PEFT starts B at zero (a no-op adapter); both factors are drawn here
    from `seed`, so the adapter changes every adapted layer."""
    import peft
    import torch

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0)
    model = peft.get_peft_model(_hf_model(base_dir), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * std)
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


@functools.lru_cache(maxsize=8)
def _oracle(base_dir: str, adapter_dir: str | None):
    """HF model (+ PEFT adapter), built once per (base, adapter) directory pair."""
    import peft

    model = _hf_model(base_dir)
    return model if adapter_dir is None else peft.PeftModel.from_pretrained(model, adapter_dir).eval()


def peft_logprobs(base_dir, adapter_dir, pairs) -> list[np.ndarray]:
    """log p(completion | prompt) per token under base + adapter (`PeftModel.from_pretrained`),
    or the base alone when `adapter_dir` is None."""
    import torch

    model = _oracle(str(base_dir), None if adapter_dir is None else str(adapter_dir))
    out = []
    with torch.no_grad():
        for prompt, completion in pairs:
            ids = torch.tensor([list(prompt) + list(completion)])
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
            out.append(logp[pos, torch.tensor(completion)].numpy())
    return out

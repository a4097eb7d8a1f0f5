"""Qwen3-MoE GGUF files (`qwen3moe`): a seeded tiny file written as llama.cpp's converter writes
it (tests/support/gguf_files.py) from an HF checkpoint, against transformers loading the same file.

transformers 5.x reads `qwen3moe` GGUF files but not `expert_feed_forward_length` (it keeps
Qwen3MoeConfig's default `moe_intermediate_size`, 768, and refuses the tiny file's experts):
the oracle is given the file's value as a config override, as a user of a file that is not
768 wide must.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from gguf_files import write_qwen3moe_gguf

from hotswap import LLM, SamplingParams
from hotswap.checkpoint import gguf_io, hf
from hotswap.checkpoint.create import create_checkpoint
from hotswap.errors import WeightsMismatch

GEN = 10


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    """2 sparse layers of 8 experts (top-2, renormalised: llama.cpp's qwen3moe graph), F32."""
    root = tmp_path_factory.mktemp("gguf_moe")
    model_dir = create_checkpoint(
        root / "hf",
        preset="tiny",
        arch="qwen3_moe",
        seed=11,
        overrides={"num_hidden_layers": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
    )
    return model_dir, write_qwen3moe_gguf(model_dir, root / "moe.gguf")


def test_qwen3moe_gguf_matches_transformers_on_the_same_file(moe_gguf):
    model_dir, path = moe_gguf
    cfg, params, tok = gguf_io.load_gguf(path)
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert cfg.moe_intermediate_size == 32 and cfg.norm_topk_prob and cfg.moe_layers == (0, 1)
    assert tok is not None
    # F32 in the file: every leaf is the checkpoint's, bit for bit (stacked experts included)
    _, want = hf.load_hf_dir(model_dir)
    assert params["layers"][1]["experts_down"].shape == (8, 32, 64)
    np.testing.assert_equal(params, want)

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, moe_intermediate_size=32
    ).eval()
    assert ref.config.num_experts == 8 and ref.config.norm_topk_prob
    llm = LLM(str(path), max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, warmup=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 23)]
    sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    worst = 0.0
    with torch.no_grad():
        for p, o in zip(prompts, outs, strict=True):
            want_ids = ref.generate(
                torch.tensor([p]), max_new_tokens=GEN, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(p) :].tolist()
            got_ids = list(o.outputs[0].token_ids)
            assert got_ids == want_ids
            seq = p + got_ids
            lp = torch.log_softmax(ref(torch.tensor([seq])).logits[0].float(), -1).numpy()
            hf_lp = lp[np.arange(len(p) - 1, len(seq) - 1), got_ids]
            ours = np.asarray(llm.score([(p, got_ids)])[0])
            worst = max(worst, float(np.max(np.abs(ours - hf_lp))))
    assert worst <= 1e-4, worst


def test_a_qwen3moe_gguf_whose_expert_count_contradicts_its_tensors_is_refused(moe_gguf, tmp_path):
    model_dir, _ = moe_gguf
    bad = write_qwen3moe_gguf(model_dir, tmp_path / "bad.gguf", expert_count=4)  # its tensors hold 8
    with pytest.raises(WeightsMismatch) as e:
        LLM(str(bad), max_model_len=64, warmup=False)
    msg = str(e.value)
    assert "blk.0.ffn_gate_inp.weight" in msg and "qwen3moe.expert_count=4" in msg
    assert "expected (4, 64), got (8, 64)" in msg

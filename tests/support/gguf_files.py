"""Writing GGUF files as llama.cpp's converter (convert_hf_to_gguf.py) writes them, with the
`gguf` package, from an HF checkpoint directory: Llama files (q/k rows permuted for ggml's
rope) and Gemma 2 / Gemma 3 files (Gemma's norm names, every `*norm.weight` stored as w + 1,
the metadata the converter writes and nothing more), and Qwen3-MoE files (each projection's
experts stacked in one tensor, the expert counts in the metadata). A Llama file carries the
checkpoint's byte-level BPE tokenizer, or a seeded SentencePiece vocabulary (`sentencepiece_vocab`,
shaped as Llama 2's / Mistral's) as `_set_vocab_sentencepiece` writes one.

`encode(gguf_name, array) -> (data, qtype)` chooses how each tensor is stored (default: 2-D
weights in one block type via `gguf.quants.quantize`, 1-D tensors in F32, as llama.cpp).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from hotswap.checkpoint import experts, gguf_io, hf
from hotswap.model.config import ModelConfig

Q = gguf.GGMLQuantizationType
Encode = Callable[[str, np.ndarray], tuple[np.ndarray, Q]]
_FILE_TYPES = {Q.F32: 0, Q.F16: 1, Q.BF16: 32, Q.Q8_0: 7, Q.Q4_0: 2, Q.Q4_1: 3, Q.Q5_0: 8, Q.Q5_1: 9}


def gguf_name(name: str, arch: str = "llama") -> str:
    """An HF tensor name -> llama.cpp's."""
    for g, h in gguf_io._GLOBAL_NAMES.items():
        if name == h:
            return g
    names = {v: k for k, v in gguf_io._ARCHS[arch].layer_names.items()}
    _, _, i, *module, kind = name.split(".")
    return f"blk.{i}.{names['.'.join(module)]}.{kind}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`, as written there."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantized(qtype: Q) -> Encode:
    def encode(name: str, a: np.ndarray) -> tuple[np.ndarray, Q]:
        kind = qtype if a.ndim == 2 else Q.F32  # as llama.cpp: norms stay F32
        return gguf.quants.quantize(a, kind), kind

    return encode


def _tokenizer_from_dir(w: gguf.GGUFWriter, model_dir: Path) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tconf = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    ids = dict(vocab)
    w.add_bos_token_id(ids[tconf["bos_token"]])
    w.add_eos_token_id(ids[tconf["eos_token"]])
    w.add_pad_token_id(ids[tconf["pad_token"]])
    w.add_add_bos_token(True)  # create_checkpoint's tokenizer prepends BOS
    w.add_chat_template(tconf["chat_template"])


# The text a seeded SentencePiece vocabulary is trained on: English, code, digits, accents.
_CORPUS = """
The quick brown fox jumps over the lazy dog. The three primary colors are red, yellow and blue.
Once upon a time there was a little model that wanted to answer every question in the world.
def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)  # the Fibonacci numbers, 0 1 1 2 3 5 8
for i in range(10): print(i, i * i, "hello world")  # squares from 0 to 81
Numbers: 1234567890, 3.14159, 2.71828, 42, 100%, $5.00, 12:30, 2026-12-05.
Café, naïve, façade, résumé, Zürich, São Paulo, Ångström, señor, élève, über.
What is the capital of France? Paris is the capital of France, and Berlin is the capital of Germany.
I'm here, you're there, they've gone, we'll see, she'd know, it's fine, don't worry.
"""
# Control and user-defined tokens beyond <unk>, <s>, </s>: Mistral's instruction markers, and one
# user-defined token (matched whole in text, never special), as llama.cpp's types say.
_CONTROL = ["[INST]", "[/INST]"]
_USER_DEFINED = ["<tool>"]
SPM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def sentencepiece_vocab(size: int) -> dict:
    """A SentencePiece BPE vocabulary of `size` pieces shaped as Llama 2's: <unk> <s> </s>, the
    control and user-defined tokens, the 256 byte pieces <0x00>..<0xFF>, then the pieces a BPE
    trained on `_CORPUS` merges (score -rank: the merge order) and last its characters (scores
    below every merge), "▁" for a space. Deterministic: the most frequent pair is merged first,
    ties to the smaller pair."""
    head = ["<unk>", "<s>", "</s>", *_CONTROL, *_USER_DEFINED]
    types = [2, 3, 3, *[3] * len(_CONTROL), *[4] * len(_USER_DEFINED)] + [6] * 256
    tokens = head + [f"<0x{b:02X}>" for b in range(256)]
    words: dict[tuple[str, ...], int] = {}
    for w in _CORPUS.split():
        key = tuple("\u2581" + w)
        words[key] = words.get(key, 0) + 1
    chars: dict[str, int] = {}
    for w, n in words.items():
        for c in w:
            chars[c] = chars.get(c, 0) + n
    alphabet = sorted(chars, key=lambda c: (-chars[c], c))
    room = size - len(tokens) - len(alphabet)
    merged: list[str] = []
    while len(merged) < room:
        pairs: dict[tuple[str, str], int] = {}
        for w, n in words.items():
            for pair in zip(w, w[1:], strict=False):
                pairs[pair] = pairs.get(pair, 0) + n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        piece = best[0] + best[1]
        if piece not in merged:
            merged.append(piece)
        words = {_merge(w, best): n for w, n in words.items()}
    pieces = merged + alphabet
    tokens += pieces
    types += [1] * len(pieces)
    tokens += [f"<unused{i}>" for i in range(size - len(tokens))]  # a corpus too small to fill it
    types += [5] * (size - len(types))
    scores = [0.0] * len(head + list(range(256))) + [-float(i) for i in range(size - len(head) - 256)]
    return {"tokens": tokens, "scores": scores, "types": types, "unk": 0, "bos": 1, "eos": 2}


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if word[i : i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _sentencepiece_tokenizer(
    w: gguf.GGUFWriter, vocab: dict, chat_template: str | None, *, space_prefix: bool = True
) -> None:
    """The tokenizer metadata llama.cpp's `_set_vocab_sentencepiece` writes: Llama 2 / Mistral
    (a space prefix), Gemma (none, and a pad token). The order is the converter's: the seeded
    file's sha256 (tests/data) depends on it."""
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab["tokens"])
    w.add_token_scores(vocab["scores"])
    w.add_token_types(vocab["types"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    w.add_unk_token_id(vocab["unk"])
    if "pad" in vocab:
        w.add_pad_token_id(vocab["pad"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def write_sentencepiece_vocab_gguf(out: Path, size: int = 512) -> Path:
    """A llama GGUF with the seeded SentencePiece vocabulary, the hyper-parameters llama.cpp reads
    and no tensors: what `Llama(path, vocab_only=True)` loads (tests/support/record_llama_cpp_tokens.py).
    Byte-for-byte the same each time, so its sha256 names the vocabulary the goldens were taken on."""
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(1)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(16)
    w.add_layer_norm_rms_eps(1e-6)
    _sentencepiece_tokenizer(w, sentencepiece_vocab(size), SPM_CHAT_TEMPLATE)
    return _finish(w, out)


def _finish(w: gguf.GGUFWriter, out: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_gguf(
    model_dir: Path, out: Path, qtype: Q = Q.F32, *, encode: Encode | None = None, sentencepiece: bool = False
) -> Path:
    """An HF Llama checkpoint directory -> a llama GGUF file (2-D weights in `qtype` unless `encode`
    says otherwise), with its tokenizer, or with `sentencepiece` the seeded SentencePiece one."""
    encode = encode or quantized(qtype)
    cfg = ModelConfig.from_hf(hf.read_hf_config(model_dir))
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if qtype in _FILE_TYPES:
        w.add_file_type(_FILE_TYPES[qtype])
    if sentencepiece:
        _sentencepiece_tokenizer(w, sentencepiece_vocab(cfg.vocab_size), SPM_CHAT_TEMPLATE)
    else:
        _tokenizer_from_dir(w, model_dir)
    for name, a in hf.read_hf_tensors(model_dir).items():
        a = np.asarray(a, np.float32)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            a = permute(a, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        data, kind = encode(gguf_name(name), a)
        w.add_tensor(gguf_name(name), data, raw_dtype=kind)
    return _finish(w, out)


def write_gemma_gguf(
    model_dir: Path, out: Path, tensors: dict[str, np.ndarray], vocab: dict, *, chat_template: str | None
) -> Path:
    """An HF Gemma 2 / Gemma 3 checkpoint (config.json in `model_dir`, `tensors` HF-named) -> a
    gemma2 / gemma3 GGUF in F32, as `Gemma2Model` / `Gemma3Model` of convert_hf_to_gguf.py
    write it. `vocab`: SentencePiece `tokens`, `scores`, `types` and the special ids."""
    raw = json.loads((model_dir / "config.json").read_text())
    arch = "gemma2" if raw["model_type"] == "gemma2" else "gemma3"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(raw["max_position_embeddings"])
    w.add_embedding_length(raw["hidden_size"])
    w.add_block_count(raw["num_hidden_layers"])
    w.add_feed_forward_length(raw["intermediate_size"])
    w.add_head_count(raw["num_attention_heads"])
    w.add_head_count_kv(raw["num_key_value_heads"])
    w.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    w.add_key_length(raw["head_dim"])
    w.add_value_length(raw["head_dim"])
    w.add_file_type(0)
    w.add_sliding_window(raw["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(raw["attn_logit_softcapping"])
        w.add_final_logit_softcapping(raw["final_logit_softcapping"])
    else:
        w.add_rope_freq_base(raw["rope_parameters"]["full_attention"]["rope_theta"])
    _sentencepiece_tokenizer(w, vocab, chat_template, space_prefix=False)
    for name, a in tensors.items():
        a = np.asarray(a, np.float32)
        if name.endswith("norm.weight"):
            a = a + np.float32(1.0)  # Gemma's (1 + w) RMSNorm, folded in by the converter
        w.add_tensor(gguf_name(name, arch), a, raw_dtype=Q.F32)
    return _finish(w, out)


def write_qwen3moe_gguf(model_dir: Path, out: Path, *, expert_count: int | None = None) -> Path:
    """An HF Qwen3-MoE checkpoint directory (every layer sparse) -> a qwen3moe GGUF in F32, as
    `Qwen3MoeModel` of convert_hf_to_gguf.py writes it: each projection's experts stacked into
    `ffn_{gate,up,down}_exps` (`[E, out, in]` in numpy order), the router as `ffn_gate_inp`, and
    `expert_count`, `expert_used_count`, `expert_feed_forward_length` in the metadata.
    `expert_count` overrides the metadata's count (a file that contradicts its tensors)."""
    cfg = ModelConfig.from_hf(hf.read_hf_config(model_dir))
    w = gguf.GGUFWriter(str(out), "qwen3moe")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts if expert_count is None else expert_count)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_file_type(0)
    _tokenizer_from_dir(w, model_dir)
    for name, a in experts.stack(cfg, hf.read_hf_tensors(model_dir)).items():
        w.add_tensor(gguf_name(name, "qwen3moe"), np.asarray(a, np.float32), raw_dtype=Q.F32)
    return _finish(w, out)

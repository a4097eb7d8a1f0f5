"""A GGUF file's tokenizer, rebuilt with `tokenizers` from its `tokenizer.*` metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, the merges (or,
for SentencePiece vocabularies, scores), the token types, the special-token ids and
the chat template as metadata, and names the pre-tokenizer (`tokenizer.ggml.pre`)
whose split regex it hard-codes. This module assembles from `tokenizers` parts the
tokenizer llama.cpp runs on the file, so that both encode alike:
- byte-level BPE (`tokenizer.ggml.model` = "gpt2": Llama 3, SmolLM, Qwen): the stored
  vocabulary and merges, the split named by `tokenizer.ggml.pre` (llama.cpp's regexes);
- SentencePiece (`"llama"`: Llama 2, Mistral, Gemma): merges by the pieces' scores with
  byte fallback and the file's `add_space_prefix` (`gguf_sentencepiece.py`);
then the control, unknown and user-defined tokens matched whole before the model runs (as
llama.cpp's tokenize with `parse_special`; control and unknown ones are special, dropped by
decode(skip_special_tokens=True)), and a BOS/EOS post-processor when the metadata asks for one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from hotswap.checkpoint import gguf_sentencepiece
from hotswap.checkpoint.tokenizer import Tokenizer
from hotswap.errors import CheckpointError

_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # llama.cpp's token types

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (splits applied before the byte-level step, whether that step also
# applies GPT-2's regex, BPE ignore_merges). As in llama.cpp's llama-vocab.cpp: "smollm"
# isolates every digit and then splits like GPT-2; Llama 3 matches whole words against the
# vocabulary before merging (ignore_merges).
_PRE: dict[str, tuple[list[str], bool, bool]] = {
    "default": ([], True, False),
    "gpt2": ([], True, False),
    "smollm": ([r"\p{N}"], True, False),
    "llama-bpe": ([_LLAMA3], False, True),
    "llama3": ([_LLAMA3], False, True),
    "qwen2": ([_QWEN2], False, False),
}


def _pre_tokenizer(pre: str, where: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    if pre not in _PRE:
        raise CheckpointError(
            f"{where}: tokenizer.ggml.pre={pre!r} is not supported; supported: {sorted(_PRE)}"
        )
    splits, gpt2_regex, ignore_merges = _PRE[pre]
    steps = [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_regex))
    return pre_tokenizers.Sequence(steps), ignore_merges


def _post_processor(bos: str | None, eos: str | None, ids: dict[str, int]):
    """BOS/EOS around every encode, when the metadata asks for them (`add_bos_token`, ...)."""

    def seq(piece: str, type_id: int) -> str:
        return " ".join(
            [
                *([f"{bos}:{type_id}"] if bos else []),
                f"{piece}:{type_id}",
                *([f"{eos}:{type_id}"] if eos else []),
            ]
        )

    single, pair = seq("$A", 0), seq("$A", 0) + " " + seq("$B", 1)
    special = [(t, ids[t]) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def tokenizer_from_metadata(meta: Mapping[str, Any], *, where: str = "GGUF") -> Tokenizer | None:
    """The Tokenizer a GGUF's metadata describes; None when the file has no vocabulary."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(
            f"{where}: tokenizer.ggml.model={kind!r} is not supported (byte-level BPE, 'gpt2', "
            "and SentencePiece, 'llama')"
        )
    sentencepiece = kind == "llama"
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(f"{where}: {len(types)} token types for {len(tokens)} tokens")
    # llama.cpp's ids for a SentencePiece file that names none (Llama 2's).
    defaults = {"bos": 1, "eos": 2, "unknown": 0} if sentencepiece else {}

    def special(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id", defaults.get(key))
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos, pad = special("bos"), special("eos"), special("padding")
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", sentencepiece))
    if sentencepiece:
        scores = list(meta.get("tokenizer.ggml.scores") or [])
        if len(scores) != len(tokens):
            raise CheckpointError(f"{where}: {len(scores)} token scores for {len(tokens)} tokens")
        tok = gguf_sentencepiece.model_tokenizer(tokens, scores, special("unknown"), prefix_space)
    else:
        tok = _byte_level(meta, tokens, where)
    # Matched whole in the text before the model runs, as llama.cpp does; control and unknown
    # tokens are special (dropped by decode(skip_special_tokens=True)), user-defined ones
    # (<think>, Gemma's runs of spaces and newlines) are not.
    kinds = list(zip(tokens, types, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in kinds if k in (_CONTROL, _UNKNOWN)]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in kinds if k == _USER_DEFINED])
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", sentencepiece)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        ids = {t: i for i, t in enumerate(tokens)}
        tok.post_processor = _post_processor(bos if add_bos else None, eos if add_eos else None, ids)
    kw = {
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    if sentencepiece:
        return gguf_sentencepiece.SentencePieceTokenizer(
            tok, prefix_space=prefix_space, add_bos=add_bos, **kw
        )
    return Tokenizer(tok, **kw)


def _byte_level(meta: Mapping[str, Any], tokens: list[str], where: str) -> tokenizers.Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pre, ignore_merges = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")), where)
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    return tok

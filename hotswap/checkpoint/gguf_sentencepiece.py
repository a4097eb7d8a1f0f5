"""Gemma's SentencePiece vocabulary from a GGUF, as the `tokenizers` model transformers builds.

A Gemma GGUF stores its SentencePiece pieces, their scores and token types, but no
merges and no tokenizer.json. transformers' GGUF loader (the oracle the tests compare
against; `GGUFGemmaConverter`, transformers 5.12) builds a Unigram model over the
pieces and scores with byte fallback, spaces normalized to "▁" and no prefix space;
the same is built here, so both encode alike:
- a piece of two or more spaces is stored as real spaces; the model looks it up as
  "▁▁", so such pieces are respelled, and the `<0x09>` byte piece is the tab itself;
- only the special tokens the metadata names (and `<mask>`, Gemma's) are matched whole
  before the model runs; the other control pieces (`<start_of_turn>`, ...) are pieces of
  the vocabulary like any other, found by the model (at score 0, the best there is).
"""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

ARCHS = ("gemma", "gemma2", "gemma3")
SPACE = "\u2581"
MASK = "<mask>"  # GemmaTokenizer's mask token: special in transformers' tokenizer too


def respell(tokens: list[str]) -> list[str]:
    """The pieces as the model looks them up: spaces as "▁", the tab byte as a tab."""
    return ["\t" if t == "<0x09>" else SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def tokenizer(
    pieces: list[str], scores: list[float], unk_id: int, prefix_space: bool
) -> tokenizers.Tokenizer:
    """The Unigram tokenizer (no added tokens yet) over the respelled `pieces`."""
    tok = tokenizers.Tokenizer(
        models.Unigram(list(zip(pieces, map(float, scores), strict=True)), unk_id=unk_id, byte_fallback=True)
    )
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:  # as transformers: only the decoder strips it, the encoder adds none
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok

"""A SentencePiece vocabulary from a GGUF (`tokenizer.ggml.model` = "llama": Llama 2, Mistral,
Gemma), tokenized as llama.cpp's `llm_tokenizer_spm` tokenizes it.

llama.cpp does not run SentencePiece: it reads the pieces, their scores and token types, and
1. cuts out of the text every control, unknown and user-defined token, matched whole
   (`tokenizer_st_partition`; Gemma's runs of spaces, tabs and newlines are user-defined
   tokens stored as the real characters, so they are cut out here too);
2. in each remaining fragment, puts a space in front when the file says `add_space_prefix`
   (every fragment: each one follows the start or a cut-out token), writes spaces as "▁",
   splits it into characters and repeatedly merges the adjacent pair whose concatenation
   is the best-scored piece (ties: the leftmost pair), then spells characters that are no
   piece as their UTF-8 bytes `<0xNN>`.

Step 2 is BPE with one merge per way of cutting a piece into two pieces, ranked by the
piece's score: `tokenizers`' BPE runs it, with no pre-tokenizer (the fragment is one word),
and its added tokens do step 1 (leftmost-longest; llama.cpp tries longer tokens first, which
differs only for two special tokens that overlap in the text, which none of these vocabularies
has). Equal-scored pieces are ranked by id, where llama.cpp takes the leftmost pair; the
published vocabularies have no two normal pieces of one score.

Decoding is llama.cpp's `llama_detokenize`: "▁" back to spaces, byte pieces fused, control
tokens dropped (or shown, `skip_special_tokens=False`), and with `add_space_prefix` one space
stripped from the first token, unless that token is a dropped leading BOS (`SentencePieceTokenizer`).
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers
from tokenizers import decoders, models, normalizers

from hotswap.checkpoint.tokenizer import Tokenizer

SPACE = "\u2581"


def merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) of two pieces that concatenate to a piece, best-scored piece first
    (514,847 for Gemma 3's 262,144 pieces: the slowest step of building the tokenizer)."""
    pieces = set(tokens)
    out = []
    for i in sorted(range(len(tokens)), key=lambda i: (-scores[i], i)):
        piece = tokens[i]
        for cut in range(1, len(piece)):
            left = piece[:cut]
            if left in pieces and piece[cut:] in pieces:
                out.append((left, piece[cut:]))
    return out


def model_tokenizer(
    tokens: list[str], scores: list[float], unk: str | None, prefix_space: bool
) -> tokenizers.Tokenizer:
    """The `tokenizers` pipeline of step 2 (no added tokens yet), and a decoder without the strip."""
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab, merges(tokens, scores), unk_token=unk, byte_fallback=True, fuse_unk=False)
    tok = tokenizers.Tokenizer(bpe)
    steps = [normalizers.Prepend(SPACE)] if prefix_space else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


class SentencePieceTokenizer(Tokenizer):
    """A Tokenizer whose decode strips the prefix space as llama.cpp's `llama_detokenize` does."""

    def __init__(self, tok: tokenizers.Tokenizer, *, prefix_space: bool, add_bos: bool, **kw):
        super().__init__(tok, **kw)
        self._prefix_space, self._add_bos = prefix_space, add_bos

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        text = super().decode(ids, skip_special_tokens)
        if not self._prefix_space or not ids:
            return text
        # llama.cpp strips one space from the first token's text only; a leading BOS that
        # decoding drops takes the strip away with it (the text then keeps its space).
        if skip_special_tokens and self._add_bos and ids[0] == self.bos_token_id:
            return text
        first = super().decode(ids[:1], skip_special_tokens)
        return text[1:] if first.startswith(" ") else text

"""The output processor (engine/outputs.py SequenceText) against full decodes of the same ids.

The oracle for stop strings is the rule the engine had before it decoded incrementally:
after each token, decode every output id, stop at the first token whose text contains a
stop string (the first of the list that does), and cut the text before that stop string.
"""

from __future__ import annotations

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from hotswap.checkpoint.create import _CORPUS, BOS_ID, IM_END_ID, build_tokenizer
from hotswap.checkpoint.tokenizer import Tokenizer
from hotswap.engine.outputs import SequenceText
from hotswap.engine.sampling import SamplingParams

TEXTS = [
    "Hello world! The robot counted the boats.",
    "héllo wörld — naïve café, 東京タワー, emoji 🙂🚀 and \ttabs\nnewlines",
    "def add(a, b):\n    return a + b\n",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(build_tokenizer(512))  # the tiny preset's tokenizer, built here


@pytest.fixture(scope="module")
def metaspace_tok():
    """Sentencepiece-style: a word's leading space is a "▁" that a decode drops at its start."""
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    return Tokenizer(tok)


def stream(tok, ids, stop=(), skip=True, stop_terminated=(), keep=False):
    """Feed ids one at a time, taking a delta after each (as the engine does for a stream).
    Returns (the processor, the deltas, how many ids it took, the stop string that matched).
    `keep`: include_stop_str_in_output."""
    params = SamplingParams(stop=list(stop), skip_special_tokens=skip, include_stop_str_in_output=keep)
    st = SequenceText(tok, params)
    deltas, hit, n = [], None, 0
    for n, t in enumerate(ids, 1):
        hit = st.append(t, stop_terminated=t in stop_terminated)
        if hit is not None:
            break
        if n < len(ids):
            deltas.append(st.take_delta())
    deltas.append(st.take_delta(final=True))
    return st, deltas, n, hit


def old_rule(tok, ids, stop, skip=True):
    """(ids taken, stop string, text): the full re-decode per token the processor replaces."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip)
        hit = next((s for s in stop if s in text), None)
        if hit is not None:
            return n, hit, text[: text.index(hit)]
    return len(ids), None, tok.decode(ids, skip)


def test_text_and_deltas_equal_the_full_decode(tok):
    rng = np.random.default_rng(0)
    cases = [tok.encode(t) for t in TEXTS]
    cases += [rng.integers(0, tok.vocab_size, 200).tolist() for _ in range(5)]  # invalid UTF-8 too
    for ids in cases:
        for skip in (True, False):
            for stop in ((), ("\x00never",)):
                st, deltas, n, hit = stream(tok, ids, stop, skip)
                full = tok.decode(ids, skip)
                assert hit is None and n == len(ids)
                assert st.text == full and "".join(deltas) == full
    # Without stop strings nothing is decoded until asked, then once: the same text.
    st = SequenceText(tok, SamplingParams())
    for t in cases[1]:
        assert st.append(t) is None
    assert st.text == tok.decode(cases[1]) == TEXTS[1]


def test_a_decode_that_drops_a_leading_space_still_streams_the_full_text(metaspace_tok):
    tok = metaspace_tok
    for text in (TEXTS[0], TEXTS[2].replace("\t", " ")):
        ids = tok.encode(text)
        in_context = [tok.decode(ids[: k + 1])[len(tok.decode(ids[:k])) :] for k in range(len(ids))]
        assert any(tok.decode([t]) != c for t, c in zip(ids, in_context, strict=True))  # alone: no space
        for stop in ((), ("\x00never",), (text[9:12],)):
            st, deltas, n, hit = stream(tok, ids, stop)
            assert (n, hit, st.text) == old_rule(tok, ids, stop) and "".join(deltas) == st.text


def test_multibyte_characters_split_across_tokens_never_reach_a_delta(tok):
    ids = tok.encode(TEXTS[1], add_special_tokens=False)
    pieces = [tok.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces)  # some character really is split across tokens
    st, deltas, _, _ = stream(tok, ids, stop=["\x00never"])
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == TEXTS[1] == st.text
    # Cut inside a character: running text shows U+FFFD as a full decode does, deltas hold it back,
    # and the final delta hands it over.
    cut = tok.encode("ok 🙂", add_special_tokens=False)[:-1]
    st = SequenceText(tok, SamplingParams(stop=["zz"]))
    running = []
    for t in cut:
        st.append(t)
        running.append(st.take_delta())
        assert st.text == tok.decode(cut[: len(running)])
    assert "\ufffd" not in "".join(running) and st.text.endswith("\ufffd")
    assert "".join(running) + st.take_delta(final=True) == tok.decode(cut)


def test_stop_strings_match_the_full_redecode(tok):
    """Every stop string cut out of the texts (spanning token boundaries or not), alone and in lists."""
    checked = spanning = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for start in range(0, len(text), 2):
            for length in (1, 2, 3, 5, 8):
                s = text[start : start + length]
                stops = [s] if start % 4 else ["\x00never", s, text[start + 1 : start + 3]]
                st, deltas, n, hit = stream(tok, ids, stops)
                want_n, want_hit, want_text = old_rule(tok, ids, stops)
                assert (n, hit, st.text) == (want_n, want_hit, want_text), (text, stops)
                assert "".join(deltas) == st.text
                # The match starts in text an earlier token completed: it spans a token boundary.
                spanning += want_hit is not None and len(want_text) < len(tok.decode(ids[: want_n - 1]))
                checked += 1
    assert checked > 300 and spanning > 50


def test_include_stop_str_in_output_keeps_the_matched_stop_string(tok):
    """vLLM's include_stop_str_in_output (SGLang's no_stop_trim): the old rule's text, the stop
    string after it, and the deltas add up to it; whatever followed it in its token is cut."""
    checked = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for start in range(1, len(text), 3):
            for length in (1, 2, 5):
                stops = ["\x00never", text[start : start + length]]
                st, deltas, n, hit = stream(tok, ids, stops, keep=True)
                want_n, want_hit, want_text = old_rule(tok, ids, stops)
                assert (n, hit) == (want_n, want_hit), (text, stops)
                assert st.text == want_text + (hit or "") and "".join(deltas) == st.text, (text, stops)
                checked += hit is not None
    assert checked > 100


def test_stop_string_at_the_very_start(tok):
    ids = tok.encode(TEXTS[0], add_special_tokens=False)
    for stop in (TEXTS[0][:1], TEXTS[0][:4], ""):
        st, deltas, n, hit = stream(tok, ids, [stop])
        assert hit == stop and st.text == "" and set(deltas) == {""}
        assert n == old_rule(tok, ids, [stop])[0]


def test_stop_string_deltas_hold_back_a_possible_start(tok):
    """A stream never sends text a stop string will cut (what the API's stream relied on)."""
    st = SequenceText(tok, SamplingParams(stop=["STOP"]))

    def feed(piece):
        hits = [st.append(t) for t in tok.encode(piece, add_special_tokens=False)]
        return next((h for h in hits if h is not None), None)

    got = []
    for piece in ("ab", "ST", "x", "S"):
        assert feed(piece) is None
        got.append(st.take_delta())
    assert got == ["ab", "", "STx", ""]
    assert feed("TOP") == "STOP"
    assert st.take_delta() == "" and st.text == "abSTx"  # the stop cut "STOP": nothing to take back
    assert st.take_delta(final=True) == ""


def test_skip_special_tokens(tok):
    body = tok.encode("Hi there", add_special_tokens=False)
    ids = [BOS_ID, *body, IM_END_ID]
    for skip, want in ((True, "Hi there"), (False, "<|begin_of_text|>Hi there<|im_end|>")):
        st, deltas, _, _ = stream(tok, ids, ["\x00never"], skip)
        assert st.text == want == tok.decode(ids, skip) and "".join(deltas) == want
    # A stop string inside a special token's text matches only when special tokens are shown.
    assert stream(tok, ids, ["im_end"], True)[3] is None
    st, _, n, hit = stream(tok, ids, ["im_end"], False)
    assert (hit, n, st.text) == ("im_end", len(ids), "<|begin_of_text|>Hi there<|")


def test_a_token_that_ends_the_sample_is_not_checked_for_stop_strings(tok):
    """EOS or a stop token id: the engine finishes on the token, and the text stays whole (as before)."""
    ids = [*tok.encode("Hi there", add_special_tokens=False), IM_END_ID]
    st, deltas, n, hit = stream(tok, ids, ["im_end"], False, stop_terminated={IM_END_ID})
    assert hit is None and st.text == tok.decode(ids, False) == "".join(deltas)

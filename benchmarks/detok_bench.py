"""Streaming detokenization: text work per token at 64 and 2,048 output tokens.

    python benchmarks/detok_bench.py [--tokenizer MODEL_DIR] [--repeats 5]

Streams a 64- and a 2,048-token completion, with stop strings set that never match
(so every token is checked), through what the engine does per token of a streamed
sample: `SequenceText.append`, `take_delta` and `text` (engine/outputs.py). The same
run times the approach it replaced: a full re-decode for the stop check, another for
the output's text, and a diff of the whole text for the stream delta, so a token's
cost grew with the output. Time is per token, the best of `--repeats` runs (this CPU
is shared; the minimum is the least disturbed). Output ids cycle through the encoded
built-in English corpus with the locally trained tokenizer (nothing downloads), or a
local HF model directory's `tokenizer.json` with `--tokenizer`.
"""

from __future__ import annotations

import argparse
import json
import time

from hotswap.checkpoint.create import _CORPUS, build_tokenizer
from hotswap.checkpoint.tokenizer import Tokenizer
from hotswap.engine.outputs import SequenceText
from hotswap.engine.sampling import SamplingParams

LENGTHS = (64, 2048)
STOP = ["\x00never", "### END ###"]  # never in the text: every token is checked, none stops


def processor(tok: Tokenizer, ids: list[int]) -> str:
    st = SequenceText(tok, SamplingParams(stop=STOP))
    sent = []
    for t in ids:
        assert st.append(t) is None
        sent.append(st.take_delta())
        st.text  # noqa: B018  (the engine builds each streamed output's text)
    sent.append(st.take_delta(final=True))
    return "".join(sent)


def full_redecode(tok: Tokenizer, ids: list[int]) -> str:
    """Per token: decode all ids for the stop check, again for the output, then diff for the delta."""
    sent = ""
    out: list[int] = []
    for t in ids:
        out.append(t)
        text = tok.decode(out)
        assert not any(s in text for s in STOP)
        text = tok.decode(out).rstrip("\ufffd")
        hold = max((k for s in STOP for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        text = text[: len(text) - hold]
        if text.startswith(sent):
            sent = text
    return tok.decode(out)


def per_token_us(fn, tok: Tokenizer, ids: list[int], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(tok, ids)
        best = min(best, time.perf_counter() - t0)
    return best / len(ids) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", help="a local model directory with tokenizer.json")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tok = Tokenizer.from_dir(args.tokenizer) if args.tokenizer else Tokenizer(build_tokenizer(512))
    corpus = tok.encode(_CORPUS, add_special_tokens=False)
    ids = [corpus[i % len(corpus)] for i in range(max(LENGTHS))]
    for n in LENGTHS:  # both give the full decode: the comparison is like for like
        assert processor(tok, ids[:n]) == full_redecode(tok, ids[:n]) == tok.decode(ids[:n])
    res = {}
    for name, fn in (("processor", processor), ("full_redecode", full_redecode)):
        res[name] = {n: per_token_us(fn, tok, ids[:n], args.repeats) for n in LENGTHS}
    new, old = res["processor"], res["full_redecode"]
    a, b = LENGTHS
    print(
        f"detokenize+stop per token: {a} tok {new[a]:.1f} us, {b} tok {new[b]:.1f} us, "
        f"ratio {new[b] / new[a]:.2f}"
    )
    print(
        f"old full re-decode per token: {a} tok {old[a]:.1f} us, {b} tok {old[b]:.1f} us, "
        f"ratio {old[b] / old[a]:.2f}"
    )
    print(json.dumps({k: {str(n): round(v, 2) for n, v in r.items()} for k, r in res.items()}))


if __name__ == "__main__":
    main()

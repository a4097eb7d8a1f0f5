"""The texts GGUF tokenizers are checked on against llama.cpp (tests/data/llama_cpp_tokens_*.json):
whitespace runs, tabs, newlines, digits, code, CJK, emoji, accents, leading and double spaces, a
seeded mix of those, and each of a vocabulary's special tokens placed in text. Pure Python: the
recording script imports it from llama-cpp-python's own environment."""

from __future__ import annotations

import random

HAND = [
    "",
    " ",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\t",
    "\t\t",
    "\r\n",
    " \n \t ",
    "Hello world!",
    "Hello  world",
    "Hello   world",
    " Hello",
    "  Hello",
    "Hello ",
    "Hello  ",
    "The three primary colors are",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "I'm here, they're there; we'll see. Don't worry, it's fine.",
    "  two leading spaces\n\n\ttab and newlines",
    "line one\nline two\n\nline four\n\n\n\nline eight",
    "trailing newline\n",
    "tabs\tbetween\t\twords\t\t\tand more",
    "mixed \t \n whitespace \n\t\n runs",
    " " * 40 + "forty spaces",
    "\n" * 33 + "thirty-three newlines",
    "\t" * 35 + "thirty-five tabs",
    "0",
    "12",
    "123",
    "1234567890",
    "3.14159 2.71828 1e-10 -42 +7",
    "2026-12-05 12:30:45 UTC",
    "$5.00, 100%, 1,000,000 and 0x1F",
    "Call 555-0123 or +1 (800) 555-0199.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    '<div class="x"><p>Hello</p></div>',
    "<table><tr><td>cell</td></tr></table>",
    "**bold** _italic_ `code` [link](https://example.com/path?q=1&r=2#frag)",
    "# Heading\n\n- item one\n- item two\n  - nested item\n",
    "café naïve façade résumé Zürich São Paulo Ångström señor élève über",
    "Ünïcödé àéîõü ÀÉÎÕÜ ñ ß œ æ ø",
    "日本語のテキスト",
    "中文分词测试，你好世界！",
    "한국어 텍스트입니다",
    "Привет мир, как дела?",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "ภาษาไทย",
    "Ελληνικά γράμματα αβγδ",
    "🤖🚀👍🏽 👨‍👩‍👧 ❤️",
    "emoji 😀 in 🎉 the 🦀 middle",
    "“quotes” ‘single’ … — – • ©®™",
    "\u00a0nbsp \u200bzero-width \u200d joiner \ufeffbom",
    "e\u0301 combining accent, a\u0308 umlaut",
    "∑∫∂√∞≈≠≤≥ ± × ÷ → ⇒ ∀∃",
    "a" * 50,
    "ab" * 30,
    "The the THE tHe",
    "antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
    "x=   y   \r\n   \n",
    "bell\x07 and escape\x1b[0m",
    "mañana, ¿qué tal? ¡Hola!",
    "URL: https://www.example.org/a/b_c-d.html?x=1",
    "email: someone@example.com, user.name+tag@sub.domain.io",
    "path/to/file.py:123: error: something went wrong",
    "   leading and trailing   ",
    "Once upon a time, " * 6,
]

_FRAGMENTS = [
    "the",
    "The",
    "hello",
    "world",
    "capital",
    "France",
    "model",
    "42",
    "3.14",
    "2026",
    "fib(n)",
    "x = 1",
    "café",
    "über",
    "日本",
    "语言",
    "🤖",
    "👍🏽",
    "—",
    "...",
    "!",
    "?",
    "'s",
    "don't",
    '"quoted"',
    "[1, 2]",
    "{a}",
    "<b>",
    "Ω",
    "ñ",
]
_SEPARATORS = ["", " ", " ", " ", "  ", "   ", "\n", "\n\n", "\t", ", ", ". ", " \n", "\t "]


def seeded_mixes(n: int = 150, seed: int = 46) -> list[str]:
    """`n` texts of 1-8 fragments joined by random separators, with a leading space now and then."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = [rng.choice(_FRAGMENTS) for _ in range(rng.randint(1, 8))]
        text = parts[0]
        for p in parts[1:]:
            text += rng.choice(_SEPARATORS) + p
        out.append(rng.choice(["", "", "", " ", "  ", "\n"]) + text + rng.choice(["", "", "", " ", "\n"]))
    return out


def with_specials(specials: list[str]) -> list[str]:
    """Each special token placed at the start, between words, after spaces, and twice in a row."""
    out = []
    for s in specials:
        out += [s, f"{s}hello", f"a{s}b", f" {s} x", f"{s}{s}\n", f"Hi {s}\nthere  {s}"]
    return out


def texts(specials: list[str]) -> list[str]:
    """Every text a vocabulary with these special tokens is checked on (de-duplicated, in order)."""
    return list(dict.fromkeys(HAND + seeded_mixes() + with_specials(specials)))

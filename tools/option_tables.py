"""Write the engine option tables of the docs from `hotswap.EngineArgs` (hotswap/args.py).

python tools/option_tables.py           # rewrites the tables in docs/en and docs/zh_cn
python tools/option_tables.py --check   # exits 1, naming the page, where a table is stale

Each table is found by an option it lists (`TABLES`) and replaced whole; tests/project/test_docs.py
checks that the pages hold exactly what this writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hotswap.args import markdown_table

ROOT = Path(__file__).resolve().parents[1]
LANGS = ("en", "zh_cn")
# page -> (EngineArgs scope, a span that only the engine option table of that page holds)
TABLES = {
    "python_api.md": ("llm", "`max_num_batched_tokens`"),
    "serving.md": ("serve", "`--max-num-batched-tokens`"),
}


def table_span(lines: list[str], marker: str) -> tuple[int, int]:
    """[start, end) of the lines of the markdown table holding a row that starts with `marker`."""
    row = next(i for i, line in enumerate(lines) if line.startswith(f"| {marker} |"))
    start = row
    while start > 0 and lines[start - 1].startswith("|"):
        start -= 1
    end = row
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return start, end


def rendered(page: Path, scope: str, marker: str, lang: str) -> str:
    lines = page.read_text().split("\n")
    start, end = table_span(lines, marker)
    return "\n".join([*lines[:start], *markdown_table(scope, lang).rstrip("\n").split("\n"), *lines[end:]])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tools/option_tables.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale page")
    check = p.parse_args(argv).check
    stale = []
    for lang in LANGS:
        for name, (scope, marker) in TABLES.items():
            page = ROOT / "docs" / lang / name
            text = rendered(page, scope, marker, lang)
            if text != page.read_text():
                stale.append(page)
                if not check:
                    page.write_text(text)
    for page in stale:
        print(f"{page.relative_to(ROOT)}: {'stale option table' if check else 'rewritten'}")
    return 1 if stale and check else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

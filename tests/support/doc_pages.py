"""The docs' pages as the tests read them: fenced code blocks, headings, tables and code spans
of docs/{en,zh_cn}/*.md, and the pages in reading order (tests/project/test_docs.py checks
them; tests/server/test_tool_calls_server.py runs one block against a real model)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from markdown_it import MarkdownIt

DOCS = Path(__file__).resolve().parents[2] / "docs"
NO_RUN = "# doc: no-run"  # a block's first line: compiled and its imports run, not executed
_MD = MarkdownIt("commonmark").enable("table")
_SPAN = re.compile(r"`([^`]+)`")


@dataclasses.dataclass(frozen=True)
class Block:
    lang: str
    line: int  # 1-based line of the block's first code line in the .md file
    code: str

    @property
    def no_run(self) -> bool:
        return self.code.startswith(NO_RUN)


def blocks(path: Path) -> list[Block]:
    """Fenced code blocks; MyST directives (```{toctree}) come back with their braces as `lang`."""
    out = []
    for tok in _MD.parse(path.read_text()):
        if tok.type == "fence":
            out.append(Block(tok.info.split()[0] if tok.info else "", tok.map[0] + 2, tok.content))
    return out


def headings(path: Path) -> list[tuple[int, str]]:
    toks = _MD.parse(path.read_text())
    return [(int(t.tag[1]), toks[i + 1].content) for i, t in enumerate(toks) if t.type == "heading_open"]


def tables(path: Path) -> list[list[list[str]]]:
    """Every table as rows of raw cell text (header row first)."""
    out: list[list[list[str]]] = []
    in_table = False
    for tok in _MD.parse(path.read_text()):
        if tok.type in ("table_open", "table_close"):
            in_table = tok.type == "table_open"
            out += [[]] if in_table else []
        elif in_table and tok.type == "tr_open":
            out[-1].append([])
        elif in_table and tok.type == "inline":  # a cell's content
            out[-1][-1].append(tok.content)
    return out


def table_with(path: Path, span: str) -> list[list[str]]:
    """The body rows of the one table whose cells mention the code span `span`."""
    found = [t for t in tables(path) if any(f"`{span}`" in cell for row in t for cell in row)]
    assert len(found) == 1, f"{path}: {len(found)} tables mention `{span}`"
    return found[0][1:]


def spans(text: str) -> list[str]:
    return _SPAN.findall(text)


def pages(lang: str) -> list[Path]:
    """Pages in reading order: the toctrees of index.md, then index.md itself."""
    index = DOCS / lang / "index.md"
    names = [
        line.strip()
        for b in blocks(index)
        if b.lang == "{toctree}"
        for line in b.code.splitlines()
        if line.strip() and not line.startswith(":")
    ]
    return [DOCS / lang / f"{name}.md" for name in names] + [index]


def python_blocks(path: Path) -> list[Block]:
    return [b for b in blocks(path) if b.lang == "python"]

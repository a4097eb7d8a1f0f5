"""Chinese docs: `sphinx-build -W -b html docs/zh_cn docs/_build/zh_cn` (or `make docs`)."""

import re
import sys
from pathlib import Path

from docutils import nodes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conf_common import *  # noqa: E402,F403
from conf_common import setup as common_setup  # noqa: E402

language = "zh_CN"

# Chinese puts no spaces between words, but HTML renders a source line break inside a
# paragraph as one. Joining lines where both sides are Chinese keeps the sources wrapped
# like the English ones without stray spaces on the page (a break next to Latin text stays
# the space the sources write there anyway).
_CJK = "\u3000-\u303f\u4e00-\u9fff\uff00-\uffef\u201c\u201d"
_ENDS_CJK = re.compile(f"[{_CJK}]$")
_STARTS_CJK = re.compile(f"^[{_CJK}]")


def _join_chinese_lines(app, doctree) -> None:
    # MyST turns each soft line break into its own "\n" Text node between its neighbours.
    for text in list(doctree.findall(nodes.Text)):
        parent = text.parent
        if str(text) != "\n" or parent is None or isinstance(parent, nodes.FixedTextElement):
            continue
        i = next(j for j, child in enumerate(parent.children) if child is text)  # identity, not ==
        if 0 < i < len(parent) - 1:
            before, after = parent[i - 1].astext(), parent[i + 1].astext()
            if _ENDS_CJK.search(before) and _STARTS_CJK.search(after):
                del parent[i]  # by position: remove() compares by value and would drop the first "\n"


def setup(app):
    common_setup(app)
    app.connect("doctree-read", _join_chinese_lines)

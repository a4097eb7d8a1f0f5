"""Sphinx settings shared by the English (docs/en) and Chinese (docs/zh_cn) projects.

Each tree has its own conf.py that imports this and sets `language`, so the two
builds stay independent (own search index, own `_build` folder) and cannot
drift in anything but the words.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

# autodoc imports hotswap, which imports jax: keep it off any accelerator so the docs
# build the same on a laptop, in CI and on a TPU VM.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # document this checkout, even where another hotswap is installed

import hotswap  # noqa: E402

project = "hotswap"
author = "the hotswap authors"
copyright = "the hotswap authors, Apache-2.0"
version = release = hotswap.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]

# Docstrings use Markdown-style `code` spans; the rST default role would render them as
# italic "title references". `literal` renders them as code, as their authors meant.
default_role = "literal"

autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_class_signature = "separated"

# alabaster ships with Sphinx: no theme package to install or pin.
html_theme = "alabaster"
html_theme_options = {"fixed_sidebar": True, "show_relbars": True}
html_title = f"hotswap {release}"
html_static_path: list[str] = []


# The code's docstrings are written in Markdown habits that rST reads differently:
# a "- item" list straight after its lead-in line (rST wants a blank line first, else
# "Unexpected indentation"), and a code span with a suffix such as `device_put`s (rST
# wants the end-string followed by a space or punctuation). Rewriting those two idioms
# here renders them as their authors meant, instead of failing the -W build on them.
_SPAN_SUFFIX = re.compile(r"(`[^`\s][^`]*`)(?=[A-Za-z0-9])")


def _markdownish_to_rst(app, what, name, obj, options, lines: list[str]) -> None:
    out: list[str] = []
    for line in lines:
        stripped = line.lstrip()
        is_item = stripped.startswith(("- ", "* "))
        if is_item and out and out[-1].strip():
            prev = out[-1]
            prev_indent = len(prev) - len(prev.lstrip())
            in_list = prev.lstrip().startswith(("- ", "* ")) or prev_indent > len(line) - len(stripped)
            if not in_list:
                out.append("")
        out.append(_SPAN_SUFFIX.sub(r"\1\\ ", line))
    lines[:] = out


def setup(app):
    app.connect("autodoc-process-docstring", _markdownish_to_rst)

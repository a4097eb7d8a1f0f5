"""Chinese docs: `sphinx-build -W -b html docs/zh_cn docs/_build/zh_cn` (or `make docs`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conf_common import *  # noqa: E402,F403

language = "zh_CN"

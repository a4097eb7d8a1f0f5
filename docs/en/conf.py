"""English docs: `sphinx-build -W -b html docs/en docs/_build/en` (or `make docs`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conf_common import *  # noqa: E402,F403

language = "en"

"""The end-of-file hook of `.pre-commit-config.yaml`: each text file ends with exactly one newline.

python tools/eof.py FILE...   # prints each bad file, exits 1 if any
"""

from __future__ import annotations

import sys
from pathlib import Path


def bad_ending(path: Path) -> bool:
    data = path.read_bytes()
    return bool(data) and (not data.endswith(b"\n") or data.endswith(b"\n\n"))


def main(paths: list[str]) -> int:
    bad = [p for p in paths if bad_ending(Path(p))]
    for p in bad:
        print(f"{p}: must end with exactly one newline")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`hotswap bench`: runs the source checkout's `benchmarks/bench.py` (`python -m benchmarks.bench`).

The benchmarks are not part of the package (nor of its wheel), and the package never imports
them: the command runs them in a child Python with the checkout this package was imported from
(an editable install, or the checkout on PYTHONPATH) first on `PYTHONPATH`; relative paths such
as `--out` stay the caller's. `benchmarks/bench.py` owns its flags: `hotswap bench --help` prints them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from hotswap.errors import HotswapError

HELP = "benchmarks vs HF transformers (source checkout only; `hotswap bench --help` lists the flags)"
# The child's entry: `benchmarks.bench.main` with this command's name in its usage and errors.
_RUN = "import sys; from benchmarks.bench import main; sys.exit(main(sys.argv[1:], prog='hotswap bench'))"


class BenchmarksNotFound(HotswapError):
    """`hotswap bench` from an installed wheel: `benchmarks/` is only in a source checkout."""

    code = "benchmarks_not_found"


def checkout() -> Path | None:
    """The source checkout this package was imported from, or None (an installed wheel).

    A checkout is the package's parent directory when it holds `pyproject.toml` and
    `benchmarks/bench.py`; a wheel's parent is site-packages, which holds neither.
    """
    root = Path(__file__).resolve().parents[2]
    return (
        root if (root / "pyproject.toml").is_file() and (root / "benchmarks" / "bench.py").is_file() else None
    )


def add_parser(sub) -> None:
    # Every word (`--no-hf`, `--help` too) goes to benchmarks/bench.py as it is.
    p = sub.add_parser("bench", help=HELP, prefix_chars="\0", add_help=False)
    p.add_argument("args", nargs="*")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    root = checkout()
    if root is None:
        raise BenchmarksNotFound(
            "the benchmarks are not part of the installed package: run `hotswap bench` from an editable "
            "install of a source checkout (`pip install -e .`), or `python -m benchmarks.bench` from its root"
        )
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    rc = subprocess.run([sys.executable, "-c", _RUN, *args.args], env={**os.environ, "PYTHONPATH": path})
    if {"-h", "--help"} & set(args.args):  # help exits as argparse's own does for the other commands
        raise SystemExit(rc.returncode)
    return rc.returncode

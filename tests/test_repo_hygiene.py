"""The repository passes its own pre-commit hooks (ruff, whitespace, end of file)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_pre_commit_passes_on_repository(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.fail("run the suite from a git checkout: pre-commit checks the tracked files")
    exe = shutil.which("pre-commit") or str(Path(sys.executable).parent / "pre-commit")
    env = {"PRE_COMMIT_HOME": str(tmp_path / "pc"), "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    proc = subprocess.run(
        [exe, "run", "--all-files", "--show-diff-on-failure"], cwd=ROOT, capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

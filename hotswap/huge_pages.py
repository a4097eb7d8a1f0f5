"""2 MB pages for the engine's large buffers on Linux with glibc: what the CLI starts with.

A decode step streams every weight from DRAM. On 4 KB pages each page of that stream costs a
TLB miss and a page-table walk (two-level in a VM); on 2 MB pages a 512th of them. With THP
(transparent huge pages) in its common `madvise` mode, anonymous memory gets 2 MB pages only
where the program asked with `madvise(MADV_HUGEPAGE)`, and XLA's CPU buffers (params, KV
pages, activations) come from glibc's malloc, which asks for its large mappings when started
with the tunable `glibc.malloc.hugetlb=1`. Measured on this project's 2-core box, bench-100m:
a batch-1 decode step 17.4 -> 15.7 ms (the kernel bench: 1.08-1.4x for 1-32 rows).

The tunable is read once, when the process starts, so `hotswap serve | bench | demo` re-exec
themselves with it (`maybe_reexec`); a program that builds an `LLM` itself gets the same by
starting with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` in its environment.
`HOTSWAP_HUGE_PAGES=0` turns the re-exec off.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's THP mode ("always", "madvise" or "never"), None where there is none."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


def reexec_env(environ: dict[str, str]) -> dict[str, str] | None:
    """The environment to restart with so that malloc asks for huge pages, or None when a restart
    would change nothing: not Linux/glibc, THP "always" (every large mapping has them already)
    or "never" or absent, the tunable already set, or HOTSWAP_HUGE_PAGES=0."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc" or thp_mode() != "madvise":
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if environ.get("HOTSWAP_HUGE_PAGES", "1") == "0" or "glibc.malloc.hugetlb" in tunables:
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}" if tunables else TUNABLE}


def maybe_reexec(argv: list[str]) -> None:
    """Replace this process with `python -m hotswap.cli *argv` under `reexec_env` (same pid,
    stdio and arguments); returns only when no restart is needed."""
    env = reexec_env(dict(os.environ))
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "hotswap.cli", *argv], env)

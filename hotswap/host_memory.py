"""glibc's allocator and the engine's host memory: XLA:CPU's buffers all come from malloc.

Two settings, both for the decode loop that streams every weight and KV page from DRAM:

- **Thresholds** (`tune_allocator`, once per process). glibc serves requests above its mmap
  threshold (128 KiB, rising to at most 32 MiB) with a fresh mmap and returns them on free, and
  trims the heap top above 128 KiB, so a step's multi-megabyte temporaries (gathered KV pages,
  activations of a packed prefill) would be page-faulted in from zeroed pages on every step.
  Raising both thresholds keeps freed memory in the process for reuse; `sleep()` hands it back
  explicitly with `release_free_memory()`.
- **2 MB pages** (`maybe_reexec`). On 4 KB pages each page of the weight stream costs a TLB
  miss and a page-table walk (two-level in a VM); on 2 MB pages a 512th of them. With THP in
  its common `madvise` mode, anonymous memory gets 2 MB pages only where the program asked
  with `madvise(MADV_HUGEPAGE)`, which glibc's malloc does for its large mappings when started
  with the tunable `glibc.malloc.hugetlb=1`. The tunable is read once, when the process
  starts, so `hotswap serve | bench | demo` re-exec themselves with it; a program that builds
  an `LLM` itself gets the same by starting with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` in its
  environment. `HOTSWAP_HUGE_PAGES=0` turns the re-exec off, `HOTSWAP_MALLOC_TUNING=0` the
  thresholds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from pathlib import Path

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 30  # 1 GiB: larger single buffers still come from (and go back to) mmap

_libc = None


def _glibc():
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        lib = ctypes.CDLL(name) if name else None
        _libc = lib if lib is not None and hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
    return _libc or None


def tune_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process). Off with HOTSWAP_MALLOC_TUNING=0."""
    if os.environ.get("HOTSWAP_MALLOC_TUNING", "1") == "0":
        return False
    libc = _glibc()
    if libc is None:  # not glibc (macOS, musl): nothing to tune
        return False
    return bool(libc.mallopt(_M_TRIM_THRESHOLD, THRESHOLD)) and bool(
        libc.mallopt(_M_MMAP_THRESHOLD, THRESHOLD)
    )


def release_free_memory() -> None:
    """Return the heap's free memory to the OS (after sleep frees weights or the KV cache)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


# ---- 2 MB pages ---------------------------------------------------------------

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

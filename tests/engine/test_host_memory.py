"""The CPU allocator tuning (host_memory.py): on, off by env, and a sleep that hands memory back."""

from __future__ import annotations

import ctypes.util
import platform

from hotswap import host_memory


def test_tuning_applies_on_glibc_and_can_be_turned_off(monkeypatch):
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert host_memory.tune_allocator() is glibc
    monkeypatch.setenv("HOTSWAP_MALLOC_TUNING", "0")
    assert host_memory.tune_allocator() is False
    assert ctypes.util.find_library("c")  # the library the tuning talks to
    host_memory.release_free_memory()  # safe at any time


def test_release_returns_freed_memory():
    """A big freed heap block is back with the OS after release_free_memory (RSS drops)."""
    import numpy as np

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    host_memory.tune_allocator()
    block = np.ones(64 * 2**20 // 8)  # 64 MiB from the heap (below the raised mmap threshold)
    before = rss_mb()
    del block
    host_memory.release_free_memory()
    assert rss_mb() < before - 32

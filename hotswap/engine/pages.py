"""Page allocator: every page is free, cached (in the prefix index, no owner) or owned.

Owned pages carry a refcount (shared prompt pages of `n` samples or prefix
hits). The prefix index itself is an `EngineState` value; functions here take
it and return the new one, so the engine can swap it whole on a weight update.
"""

from __future__ import annotations

import hashlib

import numpy as np

from hotswap.engine.state import PrefixIndex


def page_key(parent: int, tokens: list[int], version: int) -> int:
    """Chain hash of (parent key, page token ids, weights version), never 0."""
    h = hashlib.blake2b(digest_size=8)
    h.update(int(parent).to_bytes(8, "little"))
    h.update(int(version).to_bytes(8, "little", signed=True))
    h.update(np.asarray(tokens, np.int64).tobytes())
    return int.from_bytes(h.digest(), "little") or 1


class PagePool:
    """Host-side refcounts and free list. Page 0 is the null page: never handed out."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.refcount = np.zeros(num_pages, np.int32)
        self.free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() yields low ids first
        self.tick = 0

    def num_free(self, prefix: PrefixIndex) -> int:
        """Pages obtainable now: free ones plus unowned cached ones (evictable)."""
        evictable = int(np.count_nonzero((prefix.key != 0) & (self.refcount == 0)))
        return len(self.free) + evictable

    def allocate(self, prefix: PrefixIndex) -> tuple[int, PrefixIndex]:
        """One page (refcount 1), evicting the least recently used cached page if needed; 0 if none."""
        if self.free:
            page = self.free.pop()
        else:
            cand = np.flatnonzero((prefix.key != 0) & (self.refcount == 0))
            if cand.size == 0:
                return 0, prefix
            page = int(cand[np.argmin(prefix.tick[cand])])
            prefix = prefix.remove([page])
        self.refcount[page] = 1
        return page, prefix

    def share(self, page: int) -> None:
        self.refcount[page] += 1

    def release(self, pages: list[int], prefix: PrefixIndex) -> None:
        """Drop one reference to each page; unowned pages not in the index become free."""
        for page in pages:
            if page == 0:
                continue
            self.refcount[page] -= 1
            assert self.refcount[page] >= 0, f"page {page} released twice"
            if self.refcount[page] == 0 and prefix.key[page] == 0:
                self.free.append(page)

    def reset(self) -> None:
        """Everything free (after a weight update that released every sequence)."""
        self.refcount[:] = 0
        self.free = list(range(self.num_pages - 1, 0, -1))

    def reclaim_uncached(self, prefix: PrefixIndex) -> None:
        """After the index was emptied: unowned pages that were cached become free."""
        free = set(self.free)
        for page in range(1, self.num_pages):
            if self.refcount[page] == 0 and prefix.key[page] == 0 and page not in free:
                self.free.append(page)

    def check(self, prefix: PrefixIndex, owners: dict[int, int]) -> None:
        """Invariant: each page is exactly one of free / cached / owned, refcounts match owners."""
        free = set(self.free)
        assert len(free) == len(self.free), "duplicate page in free list"
        assert 0 not in free, "null page on the free list"
        for page in range(1, self.num_pages):
            rc, cached = int(self.refcount[page]), bool(prefix.key[page] != 0)
            assert rc == owners.get(page, 0), f"page {page}: refcount {rc} != owners {owners.get(page, 0)}"
            if page in free:
                assert rc == 0 and not cached, f"page {page} free but owned or cached"
            else:
                assert rc > 0 or cached, f"page {page} leaked: not free, not cached, not owned"

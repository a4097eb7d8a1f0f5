"""The page pool: who holds each KV page, as part of the engine state.

Every page but the null page 0 is exactly one of: owned (refcount > 0: some
sequence's block table lists it), cached (refcount 0 and in the prefix index:
evictable, least recently used first) or free (neither). "Free" is derived from
the refcounts and the index, never listed separately, so emptying the index
(a weight update, `reset_prefix_cache`) frees its unowned pages with nothing to
reconcile by hand.

The pool also holds each sequence's block table (`tables[seq_id]`, page i
holding tokens [i*ps, (i+1)*ps)) and the chain keys of its pages registered in
the prefix index (`keys[seq_id]`), both tuples. A transition edits a private
copy (`edit()`) and returns it inside the new `EngineState`; a pool that a state
holds is never edited again, so an old state stays a valid value. The copy is
O(sequences) plus the refcounts: tables and keys are immutable and replaced,
not extended, when they grow (once per page of tokens).

A model with sliding-window layers keeps those layers' pages in a smaller pool of twins
(`window`, `window_pages.py`), bounded by the window; every edit here keeps it in step.
"""

from __future__ import annotations

import collections

import numpy as np

from hotswap.engine.prefix import PrefixIndex
from hotswap.engine.window_pages import WindowPages


class PagePool:
    def __init__(
        self,
        refcount: np.ndarray,
        tables: dict[int, tuple[int, ...]] | None = None,
        keys: dict[int, tuple[int, ...]] | None = None,
        tick: int = 0,
        window: WindowPages | None = None,
    ):
        self.refcount = refcount  # int32[num_pages]; refcount[0] stays 0 (null page)
        self.tables = tables if tables is not None else {}
        self.keys = keys if keys is not None else {}
        self.tick = tick  # LRU clock of the prefix index
        self.window = window  # the sliding-window layers' twins; None: they use these pages

    @staticmethod
    def empty(num_pages: int, window: WindowPages | None = None) -> PagePool:
        return PagePool(np.zeros(num_pages, np.int32), window=window)

    def emptied(self) -> PagePool:
        """An empty pool of the same sizes (after an update, a sleep, a failed step)."""
        w = self.window
        return PagePool.empty(
            self.num_pages,
            None if w is None else WindowPages.empty(self.num_pages, w.num_pages, w.window, w.ps),
        )

    @staticmethod
    def owning(num_pages: int, tables: dict[int, tuple[int, ...]], tick: int = 0) -> PagePool:
        """A pool (no window pool) whose only owners are `tables` (refcounts counted from them), no keys."""
        refcount = np.zeros(num_pages, np.int32)
        for table in tables.values():
            np.add.at(refcount, np.asarray(table, np.int64), 1)
        return PagePool(refcount, {s: tuple(t) for s, t in tables.items()}, {}, tick)

    def holding(self, keep: list[int] | tuple[int, ...]) -> PagePool:
        """A pool whose only owners are the sequences `keep`, with no keys: what an update's
        `keep` policy leaves."""
        pool = PagePool.owning(self.num_pages, {s: self.table(s) for s in keep}, self.tick)
        pool.window = None if self.window is None else self.window.keeping(pool.tables)
        return pool

    def forgetting_keys(self) -> PagePool:
        """The same owners with no registered keys (the prefix index was emptied)."""
        return PagePool(self.refcount.copy(), dict(self.tables), {}, self.tick, self.window)

    def edit(self) -> PagePool:
        """A private copy for one transition to edit in place."""
        window = None if self.window is None else self.window.copy()
        return PagePool(self.refcount.copy(), dict(self.tables), dict(self.keys), self.tick, window)

    @property
    def num_pages(self) -> int:
        return len(self.refcount)

    def table(self, seq_id: int) -> tuple[int, ...]:
        return self.tables.get(seq_id, ())

    def window_table(self, seq_id: int) -> tuple[int, ...]:
        """seq's block table for the sliding-window layers: its twins, or its pages when they
        have no pool of their own."""
        table = self.table(seq_id)
        return table if self.window is None else self.window.twins(seq_id, table)

    def window_holds(self, pages: list[int] | tuple[int, ...], n: int) -> bool:
        """The sliding-window layers can continue after `pages[:n]` (always, without a window pool)."""
        return self.window is None or self.window.holds(pages, n)

    def seq_keys(self, seq_id: int) -> tuple[int, ...]:
        return self.keys.get(seq_id, ())

    def add_keys(self, seq_id: int, keys: list[int]) -> None:
        """Record the chain keys of seq's next pages, registered in the prefix index (or found there)."""
        if keys:
            self.keys[seq_id] = self.seq_keys(seq_id) + tuple(keys)

    def next_tick(self) -> int:
        self.tick += 1
        return self.tick

    # ---- edits (on a copy from `edit()`) ------------------------------------

    def allocate(self, seq_id: int, n: int, prefix: PrefixIndex) -> tuple[bool, PrefixIndex]:
        """Append n pages (refcount 1) to seq's table, free ones first (lowest id), then the least
        recently used cached ones (evicted from the index). False, nothing taken, if too few."""
        if n <= 0:
            return True, prefix
        unowned = np.flatnonzero(self.refcount[1:] == 0) + 1
        cached = prefix.key[unowned] != 0
        free, evictable = unowned[~cached], unowned[cached]
        if len(free) + len(evictable) < n or (self.window is not None and self.window.num_obtainable() < n):
            return False, prefix
        pages = free[:n]
        if len(pages) < n:
            lru = evictable[np.argsort(prefix.tick[evictable], kind="stable")[: n - len(pages)]]
            prefix = prefix.remove(lru.tolist())
            pages = np.concatenate([pages, lru])
        self.refcount[pages] = 1
        if self.window is not None:
            self.window.take(pages, prefix.key != 0)
        self.tables[seq_id] = self.table(seq_id) + tuple(int(p) for p in pages)
        return True, prefix

    def share(self, seq_id: int, pages: list[int] | tuple[int, ...]) -> None:
        """seq, holding no pages yet, lists pages another owner (or the prefix index) holds, and
        the twins of those its next query sees (`window_holds` checked)."""
        if not pages:
            return
        assert not self.table(seq_id), f"seq {seq_id} shares pages after holding some"
        for page in pages:
            self.refcount[page] += 1
        self.tables[seq_id] = tuple(pages)
        if self.window is not None:
            self.window.hold(seq_id, self.tables[seq_id])

    def advance(self, seq_id: int, num_tokens: int) -> None:
        """seq has computed `num_tokens`: the window twins behind its next query are released."""
        if self.window is not None:
            self.window.advance(seq_id, self.table(seq_id), num_tokens)

    def truncate(self, seq_id: int, keep: int) -> None:
        """seq keeps the first `keep` pages of its table; the rest (its own, unindexed: a
        speculative verification's rejected positions) lose its reference."""
        table = self.table(seq_id)
        if len(table) <= keep:
            return
        if self.window is not None:
            self.window.drop_tail(seq_id, table, keep)
        tail = np.asarray(table[keep:], np.int64)
        self.refcount[tail] -= 1
        assert (self.refcount[tail] >= 0).all(), f"seq {seq_id}: a page was released twice"
        self.tables[seq_id] = table[:keep]

    def release(self, seq_id: int) -> None:
        """Drop seq's table and keys; its pages lose one reference each."""
        if self.window is not None:
            self.window.release(seq_id, self.table(seq_id))
        table = self.tables.pop(seq_id, ())
        self.keys.pop(seq_id, None)
        if table:
            idx = np.asarray(table, np.int64)
            self.refcount[idx] -= 1
            assert (self.refcount[idx] >= 0).all(), f"seq {seq_id}: a page was released twice"

    # ---- views --------------------------------------------------------------

    def usage(self, prefix: PrefixIndex) -> dict[str, int]:
        """Owned / cached / free counts of the pages that can be handed out (all but page 0)."""
        rc, key = self.refcount[1:], prefix.key[1:]
        owned = int(np.count_nonzero(rc > 0))
        cached = int(np.count_nonzero((key != 0) & (rc == 0)))
        usage = {"owned": owned, "cached": cached, "free": len(rc) - owned - cached}
        if self.window is not None:  # the window layers' twins: held by a sequence, or not
            held = int(np.count_nonzero(self.window.refcount[1:]))
            usage |= {"window_pages": self.window.num_pages - 1, "window_held": held}
        return usage

    def check(self, prefix: PrefixIndex) -> None:
        """Invariant: refcounts equal the owners the tables list; page 0 is never handed out."""
        owners = collections.Counter(p for t in self.tables.values() for p in t)
        assert 0 not in owners and self.refcount[0] == 0, "the null page was handed out"
        assert prefix.key[0] == 0, "the null page is in the prefix index"
        for page in range(1, self.num_pages):
            rc = int(self.refcount[page])
            assert rc == owners.get(page, 0), f"page {page}: refcount {rc} != owners {owners.get(page, 0)}"
        for seq_id, table in self.tables.items():
            assert len(set(table)) == len(table), f"seq {seq_id}: a page listed twice in its table"
        if self.window is not None:
            self.window.check(self.tables)

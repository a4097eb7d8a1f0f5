"""The sliding-window layers' pages: a pool of their own, bounded by the window.

A sliding-window layer never reads a key more than `window` positions behind the query, so
at 32k tokens a Gemma 3 sequence would hold 5/6 of its layers' KV for nothing if those
layers kept every page. Here each page of a sequence (a page id of the full layers' pool,
`pages.PagePool`, whose ids the prefix index and the block tables name) has a twin in the
window pool, `local_of[page]`, written by the window layers in the same step as the full
layers write the page. A sequence holds the twins of its pages from the first one its next
query can see (`first_needed`) onward; the twins behind it are released as it advances.
This is vLLM's hybrid KV cache manager and SGLang's SWA pool, on hotswap's one page space:

- Provenance stays on the page id: a twin is allocated with its page, only ever written with
  it, and a reused twin or page is unmapped first, so a mapping that exists holds the page's
  tokens under the page's recorded weights version, adapter and prefix key.
- A released twin (refcount 0) keeps its mapping until it is reused, unindexed pages' first,
  then the least recently released: a later prefix hit can still find it. Release order, not
  the prefix index's clock, is what matters here: a hit needs the twins just behind its end,
  and those are the ones a sequence released last.
- A prefix hit of n pages is usable only if the twins its next query sees are all mapped
  (`holds`); the scheduler shortens the hit until they are (vLLM's rule for sliding
  windows: the window's blocks must be cached, not only the full layers').

Host numpy, edited on a copy (`copy()`) inside `PagePool.edit()`, as the pool is.
"""

from __future__ import annotations

import numpy as np


class WindowPages:
    def __init__(
        self,
        window: int,
        page_size: int,
        local_of: np.ndarray,
        global_of: np.ndarray,
        refcount: np.ndarray,
        dropped: dict[int, int] | None = None,
        released: np.ndarray | None = None,
        clock: int = 0,
    ):
        self.window, self.ps = window, page_size
        self.local_of = local_of  # int32[num_pages]: the page's twin in this pool (0: none)
        self.global_of = global_of  # int32[num_window_pages]: the page a twin belongs to (0: free)
        self.refcount = refcount  # int32[num_window_pages]: sequences holding the twin in their window
        # seq_id -> how many of its table's leading pages it no longer holds twins of
        self.dropped = dropped if dropped is not None else {}
        # int64[num_window_pages]: when each twin was last released (`clock` ticks once a release)
        self.released = released if released is not None else np.zeros(len(refcount), np.int64)
        self.clock = clock

    @staticmethod
    def empty(num_pages: int, num_window_pages: int, window: int, page_size: int) -> WindowPages:
        z = np.zeros
        return WindowPages(
            window,
            page_size,
            z(num_pages, np.int32),
            z(num_window_pages, np.int32),
            z(num_window_pages, np.int32),
        )

    def copy(self) -> WindowPages:
        return WindowPages(
            self.window,
            self.ps,
            self.local_of.copy(),
            self.global_of.copy(),
            self.refcount.copy(),
            dict(self.dropped),
            self.released.copy(),
            self.clock,
        )

    @property
    def num_pages(self) -> int:
        return len(self.refcount)

    def first_needed(self, num_tokens: int) -> int:
        """The first page the query at position `num_tokens` (a sequence's next) can see."""
        return max(0, num_tokens - self.window + 1) // self.ps

    def holds(self, table: tuple[int, ...] | list[int], n: int) -> bool:
        """The twins a query after `table`'s first n pages sees are all mapped."""
        return all(self.local_of[p] != 0 for p in table[self.first_needed(n * self.ps) : n])

    def twins(self, seq_id: int, table: tuple[int, ...]) -> tuple[int, ...]:
        """seq's block table in this pool: its pages' twins, 0 (the null page) for those it dropped."""
        d = self.dropped.get(seq_id, 0)
        return (0,) * d + tuple(int(x) for x in self.local_of[list(table[d:])])

    # ---- edits (on a copy) --------------------------------------------------------

    def num_obtainable(self) -> int:
        return int(np.count_nonzero(self.refcount[1:] == 0))

    def unmap(self, pages) -> None:
        """Pages about to be reused: their old twins (unheld by now) become free."""
        twins = self.local_of[pages]
        twins = twins[twins != 0]
        assert (self.refcount[twins] == 0).all(), "a held twin's page was reused"
        self.global_of[twins] = 0
        self.local_of[pages] = 0

    def take(self, pages: np.ndarray, indexed: np.ndarray) -> None:
        """Fresh twins (refcount 1) for newly allocated `pages`: free ones first, then those of
        unindexed pages, then the least recently released (`indexed`: the prefix index's
        per-page key != 0). The caller checked `num_obtainable()`."""
        self.unmap(pages)
        unheld = np.flatnonzero(self.refcount[1:] == 0) + 1
        owner = self.global_of[unheld]
        worth = np.where(owner == 0, 0, np.where(indexed[owner], 2, 1))
        twins = unheld[np.lexsort((self.released[unheld], worth))[: len(pages)]]
        self.local_of[self.global_of[twins][self.global_of[twins] != 0]] = 0
        self.global_of[twins] = pages
        self.local_of[pages] = twins
        self.refcount[twins] = 1

    def hold(self, seq_id: int, table: tuple[int, ...]) -> None:
        """seq, holding nothing yet, now lists `table` (pages shared from a hit or a parent): it
        holds the twins of the pages its next query sees."""
        first = self.first_needed(len(table) * self.ps)
        self.dropped[seq_id] = first
        twins = self.local_of[list(table[first:])]
        assert (twins != 0).all(), "a shared page's twin is not mapped (check `holds` first)"
        np.add.at(self.refcount, twins, 1)

    def advance(self, seq_id: int, table: tuple[int, ...], num_tokens: int) -> None:
        """seq computed `num_tokens`: release the twins its next query no longer sees."""
        d, first = self.dropped.get(seq_id, 0), min(self.first_needed(num_tokens), len(table))
        if first > d:
            self._unhold(self.local_of[list(table[d:first])])
            self.dropped[seq_id] = first

    def drop_tail(self, seq_id: int, table: tuple[int, ...], keep: int) -> None:
        """seq's table is cut to its first `keep` pages: release the twins of the rest it holds."""
        start = max(keep, self.dropped.get(seq_id, 0))
        if len(table) > start:
            self._unhold(self.local_of[list(table[start:])])

    def release(self, seq_id: int, table: tuple[int, ...]) -> None:
        d = self.dropped.pop(seq_id, 0)
        if len(table) > d:
            self._unhold(self.local_of[list(table[d:])])

    def _unhold(self, twins: np.ndarray) -> None:
        self.refcount[twins] -= 1
        assert (self.refcount[twins] >= 0).all(), "a twin was released twice"
        self.clock += 1
        self.released[twins] = self.clock

    def keeping(self, tables: dict[int, tuple[int, ...]]) -> WindowPages:
        """Only the twins `tables`' sequences hold (an update's `keep` policy): the rest free."""
        held = WindowPages.empty(len(self.local_of), self.num_pages, self.window, self.ps)
        for seq_id, table in tables.items():
            d = self.dropped.get(seq_id, 0)
            pages = np.asarray(table[d:], np.int64)
            twins = self.local_of[pages]
            held.local_of[pages], held.global_of[twins] = twins, pages
            np.add.at(held.refcount, twins, 1)
            held.dropped[seq_id] = d
        return held

    def check(self, tables: dict[int, tuple[int, ...]]) -> None:
        """Invariant: refcounts equal the holders; mappings are one-to-one; twin 0 unused."""
        assert self.refcount[0] == 0 and self.global_of[0] == 0 and self.local_of[0] == 0
        mapped = np.flatnonzero(self.local_of)
        assert (self.global_of[self.local_of[mapped]] == mapped).all(), "twin mapping not one-to-one"
        count = np.zeros_like(self.refcount)
        for seq_id, table in tables.items():
            twins = self.local_of[list(table[self.dropped.get(seq_id, 0) :])]
            assert (twins != 0).all(), f"seq {seq_id} holds an unmapped twin"
            np.add.at(count, twins, 1)
        assert (count == self.refcount).all(), "twin refcounts != holders"

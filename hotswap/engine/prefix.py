"""The prefix index: which full KV pages hold which token prefix, under which weights version
and which LoRA adapter (and adapter version).

Host numpy, one slot per page. A page's key is the chain hash of (parent key, page token ids,
weights version, adapter id, adapter version); `find`, the one matching function, compares the
key and every part of what wrote the page, so a lookup matches only the current weights and
the request's own adapter as loaded now: even an index that survived an update, or a prefix
cached under another adapter or an older load of the same one, could never hit. Values are
immutable: each edit returns a new index (copying a few small arrays is cheap).
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

BASE = (0, 0)  # the adapter identity of the base model: (adapter id, adapter version)


def page_key(parent: int, tokens: list[int], version: int, adapter: tuple[int, int] = BASE) -> int:
    """Chain hash of (parent key, page token ids, weights version, adapter id and version), never 0."""
    h = hashlib.blake2b(digest_size=8)
    h.update(int(parent).to_bytes(8, "little"))
    h.update(int(version).to_bytes(8, "little", signed=True))
    for part in adapter:
        h.update(int(part).to_bytes(8, "little", signed=True))
    h.update(np.asarray(tokens, np.int64).tobytes())
    return int.from_bytes(h.digest(), "little") or 1


@dataclasses.dataclass(frozen=True)
class PrefixIndex:
    """key[p]: chain key of page p's content (0: not cached); version[p]: the weights version
    that wrote it; adapter[p]: the (adapter id, adapter version) it was computed under
    ((0, 0): the base); tick[p]: its LRU clock."""

    key: np.ndarray  # uint64[num_pages]
    version: np.ndarray  # int64[num_pages]
    tick: np.ndarray  # int64[num_pages]
    adapter: np.ndarray  # int64[num_pages, 2]
    # A MoE model's routing of each indexed page's tokens, int16[num_pages, page_size, moe
    # layers, k] (None until a page of routed tokens is indexed): what a hit reports for the
    # tokens it did not compute. Shared by every edit of the index and written in place on
    # insert: a page's row is read only while the index lists the page, and `insert` is the
    # only way a page enters it.
    routing: np.ndarray | None = dataclasses.field(default=None, compare=False)

    @staticmethod
    def empty(num_pages: int) -> PrefixIndex:
        return PrefixIndex(
            key=np.zeros(num_pages, np.uint64),
            version=np.full(num_pages, -1, np.int64),
            tick=np.zeros(num_pages, np.int64),
            adapter=np.zeros((num_pages, 2), np.int64),
        )

    @property
    def num_pages(self) -> int:
        return len(self.key)

    @property
    def num_cached(self) -> int:
        return int(np.count_nonzero(self.key))

    def find(self, key: int, version: int, adapter: tuple[int, int] = BASE) -> int:
        """Page holding `key` written under weights `version` and `adapter`, or 0 (the null page)."""
        hit = np.flatnonzero(
            (self.key == np.uint64(key))
            & (self.version == version)
            & (self.adapter[:, 0] == adapter[0])
            & (self.adapter[:, 1] == adapter[1])
        )
        return int(hit[0]) if hit.size else 0

    def insert(
        self, page: int, key: int, version: int, tick: int, adapter: tuple[int, int] = BASE
    ) -> PrefixIndex:
        key_, ver, tk, ad = self.key.copy(), self.version.copy(), self.tick.copy(), self.adapter.copy()
        key_[page], ver[page], tk[page], ad[page] = np.uint64(key), version, tick, adapter
        return PrefixIndex(key_, ver, tk, ad, self.routing)

    def with_routing(self, page: int, experts: np.ndarray | None) -> PrefixIndex:
        """Record the routing of an indexed page's tokens ([page_size, moe layers, k])."""
        if experts is None:
            return self
        index = self
        if self.routing is None:
            routing = np.zeros((self.num_pages, *experts.shape), np.int16)
            index = dataclasses.replace(self, routing=routing)
        index.routing[page] = experts
        return index

    def touch(self, pages: list[int], tick: int) -> PrefixIndex:
        tk = self.tick.copy()
        tk[pages] = tick
        return PrefixIndex(self.key, self.version, tk, self.adapter, self.routing)

    def remove(self, pages: list[int]) -> PrefixIndex:
        key_, ver, ad = self.key.copy(), self.version.copy(), self.adapter.copy()
        key_[pages], ver[pages], ad[pages] = 0, -1, 0
        return PrefixIndex(key_, ver, self.tick, ad, self.routing)

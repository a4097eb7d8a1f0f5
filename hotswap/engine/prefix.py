"""The prefix index: which full KV pages hold which token prefix, under which weights version.

Host numpy, one slot per page. A page's key is the chain hash of (parent key,
page token ids, weights version); a lookup matches only the current version,
so even an index that survived an update could never hit. Values are
immutable: each edit returns a new index (copying a few small arrays is cheap).
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np


def page_key(parent: int, tokens: list[int], version: int) -> int:
    """Chain hash of (parent key, page token ids, weights version), never 0."""
    h = hashlib.blake2b(digest_size=8)
    h.update(int(parent).to_bytes(8, "little"))
    h.update(int(version).to_bytes(8, "little", signed=True))
    h.update(np.asarray(tokens, np.int64).tobytes())
    return int.from_bytes(h.digest(), "little") or 1


@dataclasses.dataclass(frozen=True)
class PrefixIndex:
    """key[p]: chain key of page p's content (0: not cached); version[p]: the weights version
    that wrote it; tick[p]: its LRU clock."""

    key: np.ndarray  # uint64[num_pages]
    version: np.ndarray  # int64[num_pages]
    tick: np.ndarray  # int64[num_pages]
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
        )

    @property
    def num_pages(self) -> int:
        return len(self.key)

    @property
    def num_cached(self) -> int:
        return int(np.count_nonzero(self.key))

    def find(self, key: int, version: int) -> int:
        """Page holding `key` under `version`, or 0 (the null page) if none."""
        hit = np.flatnonzero((self.key == np.uint64(key)) & (self.version == version))
        return int(hit[0]) if hit.size else 0

    def insert(self, page: int, key: int, version: int, tick: int) -> PrefixIndex:
        key_, ver, tk = self.key.copy(), self.version.copy(), self.tick.copy()
        key_[page], ver[page], tk[page] = np.uint64(key), version, tick
        return PrefixIndex(key_, ver, tk, self.routing)

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
        return PrefixIndex(self.key, self.version, tk, self.routing)

    def remove(self, pages: list[int]) -> PrefixIndex:
        key_, ver = self.key.copy(), self.version.copy()
        key_[pages], ver[pages] = 0, -1
        return PrefixIndex(key_, ver, self.tick, self.routing)

"""EngineState: the whole serving state as one explicit value.

`params`, the `weights_version`, the paged KV cache and the prefix index live
together so that a weight update is a function from one state to the next
(`lifecycle.py`): the new state's cache and index are empty by construction,
and the old state is untouched if anything fails.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.config import EngineConfig, ModelConfig
from hotswap.engine.params import Params


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer page buffers `[num_pages, page_size, 2*kv_heads, head_dim]` (K/V interleaved).

    `page_version[p]` is the weights version that last wrote page p (-1: never).
    It is host metadata, kept beside the device buffers so a page's provenance
    travels with the cache value.
    """

    pages: tuple[jax.Array, ...]
    page_version: np.ndarray  # int64[num_pages], host

    @property
    def num_pages(self) -> int:
        return self.pages[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.pages[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.size * p.dtype.itemsize for p in self.pages)


@dataclasses.dataclass(frozen=True)
class PrefixIndex:
    """Full-page prefix cache index, host numpy, one slot per page.

    key[p] is the chain hash of (parent key, page tokens, weights version) of
    the page's content (0: the page is not cached). version[p] is the weights
    version that wrote it; a lookup matches only the current version, so even
    an index that survived an update could never hit. tick[p] is the LRU clock.
    Transitions return new values (copying a few small arrays is cheap).
    """

    key: np.ndarray  # uint64[num_pages]
    version: np.ndarray  # int64[num_pages]
    tick: np.ndarray  # int64[num_pages]

    @staticmethod
    def empty(num_pages: int) -> PrefixIndex:
        return PrefixIndex(
            key=np.zeros(num_pages, np.uint64),
            version=np.full(num_pages, -1, np.int64),
            tick=np.zeros(num_pages, np.int64),
        )

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
        return PrefixIndex(key_, ver, tk)

    def touch(self, pages: list[int], tick: int) -> PrefixIndex:
        tk = self.tick.copy()
        tk[pages] = tick
        return PrefixIndex(self.key, self.version, tk)

    def remove(self, pages: list[int]) -> PrefixIndex:
        key_, ver = self.key.copy(), self.version.copy()
        key_[pages], ver[pages] = 0, -1
        return PrefixIndex(key_, ver, self.tick)


@dataclasses.dataclass(frozen=True)
class EngineState:
    """params: device arrays (host arrays while asleep at level 1; None at level 2)."""

    params: Params | None
    weights_version: int
    kv: KVCache | None
    prefix: PrefixIndex
    asleep: frozenset[str] = frozenset()


def new_kv_cache(mcfg: ModelConfig, ecfg: EngineConfig, dtype: str | None = None, sharding=None) -> KVCache:
    shape = (ecfg.num_pages, ecfg.page_size, 2 * mcfg.num_kv_heads, mcfg.head_dim)
    dt = jnp.dtype(dtype or mcfg.dtype)
    # Always committed to a sharding: uncommitted buffers would key a separate jit
    # cache entry from the step's own (committed) outputs and recompile once.
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pages = tuple(jnp.zeros(shape, dt, device=sharding) for _ in range(mcfg.num_layers))
    return KVCache(pages=pages, page_version=np.full(ecfg.num_pages, -1, np.int64))


def initial_state(params: Params, mcfg: ModelConfig, ecfg: EngineConfig, version: int = 1, kv_sharding=None):
    return EngineState(
        params=params,
        weights_version=version,
        kv=new_kv_cache(mcfg, ecfg, sharding=kv_sharding),
        prefix=PrefixIndex.empty(ecfg.num_pages),
    )

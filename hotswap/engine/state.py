"""EngineState: the whole serving state as one explicit value.

The params, the `weights_version`, the paged KV cache, the prefix index and the
page pool (refcounts and every sequence's block table) live together, so a
weight update is a function from one state to the next (`lifecycle.py`): the new
state's cache, index and pool hold nothing from before by construction, and the
old state is untouched if anything fails. Requests and their tokens are the
scheduler's host bookkeeping; which pages they hold is here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.engine.pages import PagePool
from hotswap.engine.prefix import PrefixIndex
from hotswap.engine.window_pages import WindowPages
from hotswap.engine_config import EngineConfig
from hotswap.kernels.backend import Backend
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params
from hotswap.programs import kv_sizing
from hotswap.weights import quantize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer page buffers `[num_pages, page_size, 2*kv_heads, head_dim]` (K/V interleaved),
    or `[num_pages, page_size, 2*kv_heads*head_dim]` (the same, lane-folded) for the Pallas
    kernel: the layout is the Backend's (`Backend.page_shape`).

    `page_version[p]` is the weights version that last wrote page p (-1: never), and
    `page_adapter[p]` the (adapter id, adapter version) it was computed under ((0, 0): the
    base model). Host metadata, kept beside the device buffers so a page's provenance
    travels with the cache value. Sliding-window layers' buffers hold fewer pages when they
    have a pool of their own (`window_pages.py`): their pages are twins of the page ids these
    arrays index, written with them, so provenance stays on the page id.
    """

    pages: tuple[jax.Array, ...]
    page_version: np.ndarray  # int64[num_pages], host
    page_adapter: np.ndarray = None  # int64[num_pages, 2], host; None: built from page_version

    def __post_init__(self):
        if self.page_adapter is None:
            object.__setattr__(self, "page_adapter", np.zeros((len(self.page_version), 2), np.int64))

    @property
    def num_pages(self) -> int:
        return len(self.page_version)

    @property
    def page_size(self) -> int:
        return self.pages[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.size * p.dtype.itemsize for p in self.pages)


@dataclasses.dataclass(frozen=True)
class EngineState:
    """params: device arrays (host arrays while asleep at level 1; None at level 2); `base` likewise."""

    params: Params | None
    weights_version: int
    kv: KVCache | None
    prefix: PrefixIndex
    pool: PagePool
    asleep: frozenset[str] = frozenset()
    # The base weights when `params` serve a merged LoRA adapter (model/lora.py): the next adapter
    # merges into these, on the device; None: `params` are the base.
    base: Params | None = None
    # The LoRA adapters served by name and their buffers (engine/adapters.py); None: enable_lora off.
    adapters: Any = None

    @property
    def step_params(self) -> Params | None:
        """What a step reads: the params, with the adapters' buffers under "lora" when served."""
        if self.adapters is None or self.params is None:
            return self.params
        return {**self.params, "lora": self.adapters.buffers}

    @property
    def num_pages(self) -> int:
        return self.prefix.num_pages

    @property
    def serving(self) -> bool:
        """Awake, with params on the device: requests are accepted and steps can run."""
        return not self.asleep and self.params is not None

    @property
    def weights_on_host(self) -> bool:
        """Asleep at level 1: the params wait in host memory for `wakeup(['weights'])`."""
        return "weights" in self.asleep and self.params is not None

    def with_pages(self, pages: tuple[jax.Array, ...]) -> EngineState:
        """The same state over new page buffers (a step's donated output), provenance unchanged."""
        return dataclasses.replace(self, kv=dataclasses.replace(self.kv, pages=pages))


def new_kv_cache(
    mcfg: ModelConfig,
    ecfg: EngineConfig,
    dtype: str | None = None,
    sharding=None,
    backend: Backend | None = None,
) -> KVCache:
    """Empty pages in `backend`'s layout (None: `[.., 2*kv_heads, head_dim]`, the CPU paths'):
    `num_pages` per layer, `kv_sizing.window_pages` for a sliding-window layer when it bounds them."""
    window = kv_sizing.window_pages(mcfg, ecfg)
    dt = jnp.dtype(dtype or mcfg.kv_dtype)
    # Always committed to a sharding: uncommitted buffers would key a separate jit
    # cache entry from the step's own (committed) outputs and recompile once.
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def buffer(i: int) -> jax.Array:
        rows = window if window is not None and mcfg.layer_window(i) is not None else ecfg.num_pages
        dims = (rows, ecfg.page_size, mcfg.num_kv_heads, mcfg.head_dim)
        shape = backend.page_shape(*dims) if backend is not None else (*dims[:2], 2 * dims[2], dims[3])
        return jnp.zeros(shape, dt, device=sharding)

    pages = tuple(buffer(i) for i in range(mcfg.num_layers))
    return KVCache(pages=pages, page_version=np.full(ecfg.num_pages, -1, np.int64))


def empty_pool(mcfg: ModelConfig, ecfg: EngineConfig) -> PagePool:
    """No page held, with the sliding-window layers' pool when they have one (`kv_sizing.window_pages`)."""
    window = kv_sizing.window_pages(mcfg, ecfg)
    if window is None:
        return PagePool.empty(ecfg.num_pages)
    twins = WindowPages.empty(ecfg.num_pages, window, mcfg.sliding_window, ecfg.page_size)
    return PagePool.empty(ecfg.num_pages, twins)


def empty_state(mcfg: ModelConfig, ecfg: EngineConfig, kv_sharding=None, backend=None) -> EngineState:
    """No weights yet (version 0) and an empty cache: the state the first load updates
    (`lifecycle.update_weights`), as any later update does."""
    return EngineState(
        params=None,
        weights_version=0,
        kv=new_kv_cache(mcfg, ecfg, sharding=kv_sharding, backend=backend),
        prefix=PrefixIndex.empty(ecfg.num_pages),
        pool=empty_pool(mcfg, ecfg),
    )


class StateRef:
    """The one EngineState a running engine serves: the step, admission and the lifecycle
    controller read it and replace it here, under the engine's lock. Each weights version
    served is recorded with the quantization its params were served in (`quantize.label`:
    None unquantized), so a token's version names the numerics that produced it."""

    def __init__(self, state: EngineState):
        self._quantization: dict[int, str | None] = {}
        self.state = state

    @property
    def state(self) -> EngineState:
        return self._state

    @state.setter
    def state(self, state: EngineState) -> None:
        if state.params is not None and state.weights_version not in self._quantization:  # once a version
            self._quantization[state.weights_version] = quantize.label(state.params)
        self._state = state

    def quantization(self, version: int) -> str | None:
        """How `version`'s weights were served (None: unquantized, or a version never served)."""
        return self._quantization.get(version)

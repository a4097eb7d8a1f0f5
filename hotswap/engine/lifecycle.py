"""Pure lifecycle transitions on EngineState: update_weights, sleep, wakeup, reset_prefix_cache,
and fresh_cache (after a failed step); and the one check of a sleep level, mode and tags, which
the Engine, the multi-host driver and the REST routes all call.

Each validates first and builds a new state only when everything checks out,
so a rejected call leaves the caller's state (and the weights it serves)
untouched. None of them reads or writes anything but its arguments. What a
transition empties (prefix index, page pool, page provenance) it empties in
the state it returns: nothing is left for the caller to reconcile.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from hotswap.engine.prefix import PrefixIndex
from hotswap.engine.state import EngineState, KVCache, new_kv_cache
from hotswap.engine_config import EngineConfig
from hotswap.errors import ConfigError, EngineAsleep, HotswapError, LifecycleConflict
from hotswap.kernels.backend import Backend
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params
from hotswap.weights.place import StagedParams, place_params

SLEEP_TAGS = frozenset({"weights", "kv_cache"})
SLEEP_LEVELS = (1, 2)
SLEEP_MODES = ("abort", "wait")  # wait: in-flight requests finish first (a drain); abort: they end now


def sleep_level(level: int, error: type[HotswapError] = ConfigError) -> int:
    """The one check of a sleep level (the Engine, the multi-host driver and the REST routes).
    `error`: the type the caller reports a bad one as (the REST routes: RequestError)."""
    if level not in SLEEP_LEVELS:
        raise error(f"sleep level must be 1 or 2, got {level}")
    return level


def sleep_drains(level: int, mode: str) -> bool:
    """Checks a sleep call's level and mode before anything happens; True when it drains first."""
    sleep_level(level)
    if mode not in SLEEP_MODES:
        raise ConfigError(f"unknown sleep mode {mode!r}; use 'abort' or 'wait'")
    return mode == "wait"


def wake_tags(tags, error: type[HotswapError] = ConfigError) -> frozenset[str]:
    """The one check of sleep/wakeup tags: a subset of SLEEP_TAGS; none given means all.
    `error`: as for `sleep_level`."""
    tags = frozenset(tags) if tags else SLEEP_TAGS
    if tags - SLEEP_TAGS:
        raise error(f"unknown tag(s) {sorted(tags - SLEEP_TAGS)}; use 'weights' and/or 'kv_cache'")
    return tags


def update_weights(
    state: EngineState,
    staged: StagedParams,
    *,
    version: int | None = None,
    keep: tuple[int, ...] | list[int] = (),
) -> EngineState:
    """A new state serving `staged` (the ingest pipeline's output, `weights/place.py`: checked
    and placed, the only thing this takes) as version+1 (or `version`), with an empty prefix
    index.

    The new pool holds only the block tables of the sequences in `keep` (the `keep`
    policy's running sequences): every other page is free, and every page's recorded
    version is cleared except those kept pages', so provenance stays true.
    """
    if not isinstance(staged, StagedParams):
        raise TypeError(
            f"lifecycle.update_weights takes StagedParams (weights/pipeline.py stage()), got {type(staged).__name__}"
        )
    if state.weights_on_host:
        raise EngineAsleep("weights are asleep at level 1: call wakeup(['weights']) before update_weights")
    new_version = state.weights_version + 1 if version is None else int(version)
    if new_version <= state.weights_version:
        raise LifecycleConflict(
            f"version {new_version} must be greater than the current version {state.weights_version}"
        )
    pool = state.pool.holding(keep)
    kv = state.kv
    if kv is not None:
        page_version = np.full_like(kv.page_version, -1)
        kept = np.flatnonzero(pool.refcount)
        page_version[kept] = kv.page_version[kept]
        page_adapter = np.zeros_like(kv.page_adapter)
        page_adapter[kept] = kv.page_adapter[kept]
        kv = KVCache(pages=kv.pages, page_version=page_version, page_adapter=page_adapter)
    return dataclasses.replace(
        state,
        params=staged.params,
        base=staged.base,
        weights_version=new_version,
        kv=kv,
        prefix=PrefixIndex.empty(state.num_pages),
        pool=pool,
        asleep=state.asleep - {"weights"},
    )


def drop_weights(state: EngineState) -> EngineState:
    """The state without its params (and base): an in-place update is about to write new ones
    into their room (`weights/place.py`, in place). Asleep for "weights" until `update_weights` gives
    it some, as after sleep level 2; the KV cache, the pool and in-flight tables stay."""
    return dataclasses.replace(state, params=None, base=None, asleep=state.asleep | {"weights"})


def _to_host(x: jax.Array):
    """pinned_host memory where the backend has it (fast to bring back), else host numpy."""
    try:
        kinds = {m.kind for m in x.sharding._internal_device_list[0].addressable_memories()}
        if "pinned_host" in kinds and x.sharding.memory_kind != "pinned_host":
            return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    except (AttributeError, ValueError, NotImplementedError):
        pass
    return np.asarray(jax.device_get(x))


def sleep(state: EngineState, level: int = 1) -> EngineState:
    """Level 1: params to host; KV, prefix index and page pool dropped (every sequence's pages
    with them). Level 2: params dropped too."""
    sleep_level(level)
    if state.asleep == SLEEP_TAGS and (level == 1 or state.params is None):
        return state
    params, base = (
        (None, None)
        if level == 2
        else tuple(jax.tree.map(_to_host, p) if p is not None else None for p in (state.params, state.base))
    )
    return dataclasses.replace(
        state,
        params=params,
        base=base,
        kv=None,
        prefix=PrefixIndex.empty(state.num_pages),
        pool=state.pool.emptied(),
        asleep=SLEEP_TAGS,
    )


def wakeup(
    state: EngineState,
    tags: list[str] | tuple[str, ...] | None,
    *,
    abstract: Params,
    mcfg: ModelConfig,
    ecfg: EngineConfig,
    kv_sharding=None,
    backend: Backend | None = None,
) -> EngineState:
    """`weights`: params back onto the device (after level 2 there are none until an update);
    `kv_cache`: fresh empty pages."""
    tags = wake_tags(tags)
    params, kv, base = state.params, state.kv, state.base
    if "weights" in tags and state.weights_on_host:
        params = place_params(params, abstract)
        base = place_params(base, abstract) if base is not None else None
    if "kv_cache" in tags and kv is None:
        kv = new_kv_cache(mcfg, ecfg, sharding=kv_sharding, backend=backend)
    asleep = state.asleep - tags
    if params is None:  # after sleep level 2 there is nothing to wake: still asleep until an update
        asleep = asleep | {"weights"}
    return dataclasses.replace(state, params=params, base=base, kv=kv, asleep=asleep)


def reset_prefix_cache(state: EngineState) -> EngineState:
    """Empty index. Never corrupts running sequences: they keep their tables and refcounts; their
    registered keys are forgotten, so full pages are indexed again as they complete."""
    pool = state.pool.forgetting_keys()
    return dataclasses.replace(state, prefix=PrefixIndex.empty(state.num_pages), pool=pool)


def fresh_cache(state: EngineState, kv: KVCache) -> EngineState:
    """Same weights over a new, empty cache (after a step failed with its buffers donated):
    every page free, nothing indexed, no provenance."""
    return dataclasses.replace(
        state, kv=kv, prefix=PrefixIndex.empty(state.num_pages), pool=state.pool.emptied()
    )

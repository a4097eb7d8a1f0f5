"""The engine state is one value: the pure transitions alone (no Engine) leave nothing from before.

A scheduler and a runner fill a state with owned pages, prefix entries, refcounts and page
versions; `update_weights`, `sleep` and `reset_prefix_cache` are then applied to that value
directly and the states they return are checked page by page, and the input state is checked
to be untouched.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hotswap.checkpoint import hf
from hotswap.engine import lifecycle
from hotswap.engine.runner import Runner
from hotswap.engine.sampling import SamplingParams
from hotswap.engine.scheduler import Scheduler
from hotswap.engine.sequence import Sequence
from hotswap.engine.state import empty_state
from hotswap.engine_config import EngineConfig
from hotswap.errors import NonFiniteWeights
from hotswap.kernels.backend import Backend
from hotswap.model.params import abstract_params
from hotswap.weights import pipeline, place

ECFG = EngineConfig(
    page_size=16,
    num_pages=24,
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    attention="reference",
)
PROMPT = list(range(20, 90))  # 70 tokens: 4 full pages of 16


@pytest.fixture(scope="module")
def world(tiny_dir):
    """(state with live pages and prefix entries, its sequences, abstract params, params, mcfg)."""
    mcfg, params = hf.load_hf_dir(tiny_dir)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev), abstract_params(mcfg)
    )
    state = lifecycle.update_weights(
        empty_state(mcfg, ECFG), place.StagedParams(place.place_params(params, abstract), abstract)
    )
    sched, runner = (
        Scheduler(ECFG),
        Runner(mcfg, ECFG, Backend.choose(ECFG.attention, head_dim=mcfg.head_dim)),
    )
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    seqs = [Sequence(i, f"r{i}", 0, PROMPT + [i], sp, seed=i, arrival=i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    for _ in range(6):  # prefill, prefix hits, a few decode steps
        plan, state = sched.schedule(state)
        pages, out = runner.run(state, plan)
        state, _ = sched.postprocess(state.with_pages(pages), plan, out)
    sched.check(state)
    return state, seqs, abstract, params, mcfg


def _snapshot(state):
    return (
        state.pool.refcount.copy(),
        dict(state.pool.tables),  # tables are tuples: a copy of the dict is a snapshot
        state.prefix.key.copy(),
        state.kv.page_version.copy(),
    )


def _assert_unchanged(state, snap):
    refcount, tables, key, page_version = snap
    np.testing.assert_array_equal(state.pool.refcount, refcount)
    assert state.pool.tables == tables
    np.testing.assert_array_equal(state.prefix.key, key)
    np.testing.assert_array_equal(state.kv.page_version, page_version)


def _assert_empty(state):
    assert not state.pool.refcount.any() and not state.pool.tables and not state.pool.keys
    assert state.prefix.num_cached == 0 and (state.prefix.version == -1).all()
    assert state.pool.usage(state.prefix) == {"owned": 0, "cached": 0, "free": ECFG.num_pages - 1}
    if state.kv is not None:
        assert (state.kv.page_version == -1).all()
    state.pool.check(state.prefix)


def test_the_filled_state_holds_pages_entries_and_refcounts(world):
    state, seqs, *_ = world
    assert all(len(state.pool.table(s.seq_id)) >= 5 for s in seqs)
    assert state.pool.refcount.max() >= 3  # the shared prompt pages: one reference per sequence
    assert state.prefix.num_cached >= 4 and (state.prefix.version[state.prefix.key != 0] == 1).all()
    assert (state.kv.page_version[np.flatnonzero(state.pool.refcount)] == 1).all()


def test_update_weights_returns_a_state_with_nothing_from_before(world):
    state, _, abstract, params, mcfg = world
    snap = _snapshot(state)
    new = lifecycle.update_weights(state, pipeline.stage(params, mcfg, abstract))
    assert new.weights_version == state.weights_version + 1
    _assert_empty(new)
    _assert_unchanged(state, snap)  # the input value still describes the old weights' cache


def test_update_weights_keeps_exactly_the_kept_sequences_pages(world):
    state, seqs, abstract, params, mcfg = world
    kept = seqs[0].seq_id
    new = lifecycle.update_weights(state, pipeline.stage(params, mcfg, abstract), keep=[kept])
    assert new.pool.tables == {kept: state.pool.table(kept)}
    table = list(state.pool.table(kept))  # a list: numpy reads a tuple as one index per axis
    assert np.flatnonzero(new.pool.refcount).tolist() == sorted(table)
    assert (new.pool.refcount[table] == 1).all()  # the other owners' references are gone
    assert new.prefix.num_cached == 0 and not new.pool.keys
    others = np.setdiff1d(np.arange(ECFG.num_pages), table)
    assert (new.kv.page_version[others] == -1).all()
    np.testing.assert_array_equal(new.kv.page_version[table], state.kv.page_version[table])
    new.pool.check(new.prefix)


def test_a_rejected_update_changes_nothing(world):
    """The pipeline refuses bad weights before any transition; the transition takes only what
    the pipeline staged (raw params are a TypeError, never staged behind the caller's back)."""
    state, _, abstract, params, mcfg = world
    snap = _snapshot(state)
    bad = jax.tree.map(lambda x: np.full(x.shape, np.nan, x.dtype), params)
    with pytest.raises(NonFiniteWeights):
        lifecycle.update_weights(state, pipeline.stage(bad, mcfg, abstract))
    with pytest.raises(TypeError, match="StagedParams"):
        lifecycle.update_weights(state, params)
    _assert_unchanged(state, snap)


def test_sleep_and_wakeup_return_states_with_nothing_from_before(world):
    state, _, abstract, _, mcfg = world
    snap = _snapshot(state)
    for level in (1, 2):
        slept = lifecycle.sleep(state, level)
        assert slept.kv is None and slept.asleep == lifecycle.SLEEP_TAGS
        _assert_empty(slept)
        woke = lifecycle.wakeup(slept, ["kv_cache"], abstract=abstract, mcfg=mcfg, ecfg=ECFG)
        assert woke.kv is not None
        _assert_empty(woke)
    _assert_unchanged(state, snap)


def test_reset_prefix_cache_empties_the_index_and_keeps_owned_pages(world):
    state, *_ = world
    snap = _snapshot(state)
    new = lifecycle.reset_prefix_cache(state)
    assert new.prefix.num_cached == 0 and not new.pool.keys  # nothing left to hit or to skip
    assert new.pool.tables == state.pool.tables  # running sequences keep their pages
    np.testing.assert_array_equal(new.pool.refcount, state.pool.refcount)
    usage = new.pool.usage(new.prefix)
    assert usage["cached"] == 0 and usage["owned"] == int(np.count_nonzero(state.pool.refcount))
    new.pool.check(new.prefix)
    _assert_unchanged(state, snap)

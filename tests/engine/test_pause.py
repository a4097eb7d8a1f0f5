"""Pause / resume as lifecycle calls, and the staleness bound `max_version_lag` under `keep`."""

from __future__ import annotations

import numpy as np
import pytest

from hotswap import LLM, SamplingParams
from hotswap.checkpoint import hf
from hotswap.errors import ConfigError

KW = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, page_size=16, warmup=False)
PROMPT = list(range(20, 90))
SP = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def params_b(tiny_dir_b):
    return hf.load_hf_dir(tiny_dir_b)[1]


@pytest.fixture(scope="module")
def params_a(tiny_dir):
    return hf.load_hf_dir(tiny_dir)[1]


def _start(llm, n=3, steps=4):
    """n requests running; with the default, each has sampled a token (4 steps at this budget,
    or the one after when the scheduler trims a step to a compiled size)."""
    got = {}
    for i in range(n):
        llm.engine.add_request(f"r{i}", PROMPT[i:], SP, sink=lambda o: got.__setitem__(o.request_id, o))
    seqs = [llm.engine.requests[f"r{i}"].seqs[0] for i in range(n)]
    for i in range(2 * steps):
        llm.engine.step()
        if i + 1 >= steps and all(s.output_ids for s in seqs):
            break
    assert llm.engine.num_running() == n
    return got


def _finish(llm, got, n=3):
    for _ in range(1000):
        if len(got) >= n and all(got[f"r{i}"].finished for i in range(n)):
            break
        llm.engine.step()
    return [got[f"r{i}"].outputs[0] for i in range(n)]


def test_paused_engine_does_not_step_and_loses_nothing(tiny_dir):
    llm = LLM(tiny_dir, **KW)
    got = _start(llm)
    before = {k: len(v.outputs[0].token_ids) for k, v in got.items()}
    llm.engine.pause("in_place")
    assert llm.engine.is_paused and llm.engine.pause_mode == "in_place"
    llm.engine.add_request("late", PROMPT, SP, sink=lambda o: got.__setitem__(o.request_id, o))
    steps = llm.engine.stats["steps"]
    assert llm.engine.step() == [] and llm.engine.stats["steps"] == steps
    assert {k: len(got[k].outputs[0].token_ids) for k in before} == before
    assert llm.engine.num_waiting() == 1 and llm.engine.num_running() == 3
    llm.engine.resume()
    outs = _finish(llm, got)
    assert all(len(c.token_ids) == 30 and c.finish_reason == "length" for c in outs)
    while "late" not in got:
        llm.engine.step()
    llm.engine.check_invariants()


def test_unknown_mode_refused(tiny_dir):
    llm = LLM(tiny_dir, **KW)
    with pytest.raises(ConfigError, match="retract"):
        llm.engine.pause("freeze")
    assert not llm.engine.is_paused


def test_pause_abort_ends_everything(tiny_dir):
    llm = LLM(tiny_dir, **KW)
    got = _start(llm)
    llm.engine.pause("abort")
    assert all(got[f"r{i}"].outputs[0].finish_reason == "abort" for i in range(3))
    assert int(llm.engine.state.pool.refcount.sum()) == 0
    llm.engine.resume()


def test_pause_wait_drains(tiny_dir):
    llm = LLM(tiny_dir, **KW)
    got = _start(llm)
    llm.engine.pause("wait")
    assert all(got[f"r{i}"].outputs[0].finish_reason == "length" for i in range(3))
    assert llm.engine.is_paused
    llm.engine.resume()


def test_retract_then_updates_recompute_on_new_weights(tiny_dir, params_a, params_b):
    llm = LLM(tiny_dir, **KW)
    got = _start(llm)
    llm.engine.pause("retract")
    assert llm.engine.num_running() == 0 and int(llm.engine.state.pool.refcount.sum()) == 0
    # Any number of updates while paused; none drains (the engine is not stepping).
    assert llm.engine.update_weights(params_b) == 2
    assert llm.engine.update_weights(params_a) == 3
    assert llm.engine.update_weights(params_b) == 4
    llm.engine.resume()
    outs = _finish(llm, got)
    for i, c in enumerate(outs):
        k = c.weights_versions.index(4)
        assert set(c.weights_versions[:k]) == {1} and set(c.weights_versions[k:]) == {4}
        assert not c.mixed_weights_kv and c.kv_versions[k:] == [4] * (30 - k)
        # the tokens after the update are the new weights' for this exact prefix
        lp = llm.score(PROMPT[i:] + c.token_ids[:k], c.token_ids[k:])
        np.testing.assert_allclose(c.logprobs[k:], lp, atol=1e-4)
    llm.engine.check_invariants()


def test_keep_labels_mixed_kv(tiny_dir, params_b):
    llm = LLM(tiny_dir, **KW)
    got = _start(llm)
    llm.engine.pause("keep")
    llm.engine.update_weights(params_b)
    llm.engine.resume()
    for c in _finish(llm, got):
        k = c.weights_versions.index(2)
        assert c.mixed_weights_kv and c.kv_versions == [1] * 30  # v2 tokens over v1 KV, labelled
        assert [s["version"] for s in c.weights_version_spans] == [1, 2] and k > 0


@pytest.mark.parametrize("paused", [True, False])
def test_max_version_lag_bounds_kv_age(tiny_dir, params_a, params_b, paused):
    llm = LLM(tiny_dir, max_version_lag=1, **KW)
    got = _start(llm)
    if paused:
        llm.engine.pause("keep")
    llm.engine.update_weights(params_b, policy="keep")  # lag 1: kept
    assert llm.engine.num_running() == 3
    if paused:
        llm.engine.resume()
    llm.engine.step()
    llm.engine.update_weights(params_a, policy="keep")  # lag 2 > 1: recomputed
    assert llm.engine.num_running() == 0 and llm.engine.num_waiting() == 3
    outs = _finish(llm, got)
    for c in outs:
        assert len(c.token_ids) == 30
        assert all(v - kv <= 1 for v, kv in zip(c.weights_versions, c.kv_versions, strict=True))
        assert 2 in c.weights_versions and c.weights_versions[-1] == 3
    llm.engine.check_invariants()


def test_pause_during_a_drain_stops_it_and_the_update_follows_the_mode(tiny_dir, params_b):
    import threading

    llm = LLM(tiny_dir, **KW)
    got = _start(llm)
    seen_paused = threading.Event()
    real_step = llm.engine.controller._step_locked  # the step a drain runs

    def step_then_pause():
        out = real_step()
        if not seen_paused.is_set():
            seen_paused.set()
            llm.engine.controller.pause_mode = "retract"  # as pause() would, from another thread, mid-drain
            llm.engine.state = llm.engine.sched.preempt_running(llm.engine.state)
        return out

    llm.engine.controller._step_locked = step_then_pause
    assert llm.engine.update_weights(params_b) == 2  # policy drain; the pause stops the drain
    llm.engine.controller._step_locked = real_step
    assert seen_paused.is_set() and llm.engine.num_running() == 0 and llm.engine.num_waiting() == 3
    llm.engine.check_invariants()
    llm.engine.resume()
    for c in _finish(llm, got):
        assert len(c.token_ids) == 30 and c.weights_versions[-1] == 2 and c.kv_versions[-1] == 2

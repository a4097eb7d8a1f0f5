"""The lifecycle decision tables: update policies, pause modes, sleep arguments, the pages-fit check.

The end-to-end behaviour of each row is tested in test_lifecycle.py and test_pause.py; here the
tables themselves must say what the docs say (docs/en/weight_updates.md), so that reading a row is reading the behaviour.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from hotswap.engine import lifecycle, pausing, policies
from hotswap.engine_config import EngineConfig
from hotswap.errors import ConfigError, RequestError

ACTIONS = ("drains", "refuses_if_busy", "aborts", "recomputes", "keeps_tables")


def test_each_policy_does_exactly_one_thing_to_in_flight_requests():
    assert tuple(policies.POLICIES) == ("drain", "abort", "recompute", "keep", "reject")
    for name, row in policies.POLICIES.items():
        assert row.name == name
        done = [a for a in ACTIONS if getattr(row, a)]
        assert len(done) == 1, (name, done)
        # Mixed-version KV exists exactly where old pages survive a swap, and is always labelled.
        assert row.marks_mixed == row.keeps_tables, name
    assert policies.policy("keep").keeps_tables and policies.policy("drain").drains
    assert policies.policy("reject").refuses_if_busy


def test_unknown_policy_refused_with_the_choices():
    with pytest.raises(ConfigError, match=r"unknown update policy 'swap'; use one of \('drain', 'abort'"):
        policies.policy("swap")


def test_an_update_while_paused_never_drains_nor_refuses():
    """The pause already decided what happens to in-flight work (pausing.py)."""
    assert set(pausing.PAUSE_MODES) == {"abort", "wait", "retract", "in_place", "keep"}
    want = {"abort": "abort", "wait": "recompute", "retract": "recompute", "in_place": "keep", "keep": "keep"}
    for name, mode in pausing.PAUSE_MODES.items():
        assert mode.name == name and mode.update is policies.POLICIES[want[name]]
        assert not mode.update.drains and not mode.update.refuses_if_busy
        assert sum((mode.drains, mode.aborts, mode.retracts)) <= 1, name
    assert pausing.pause_mode("in_place") == dataclasses.replace(pausing.pause_mode("keep"), name="in_place")
    with pytest.raises(ConfigError, match="unknown pause mode 'nap'"):
        pausing.pause_mode("nap")


def test_sleep_arguments_checked_in_one_place():
    assert [lifecycle.sleep_level(level) for level in (1, 2)] == [1, 2]
    for bad in (0, 3):
        with pytest.raises(ConfigError, match=f"level must be 1 or 2, got {bad}"):
            lifecycle.sleep_level(bad)
    assert lifecycle.sleep_drains(1, "wait") and not lifecycle.sleep_drains(2, "abort")
    with pytest.raises(ConfigError, match="unknown sleep mode 'later'"):
        lifecycle.sleep_drains(1, "later")
    with pytest.raises(ConfigError, match="level must be 1 or 2"):
        lifecycle.sleep_drains(3, "wait")  # the level is refused before a drain could start
    assert lifecycle.wake_tags(None) == lifecycle.wake_tags([]) == lifecycle.SLEEP_TAGS
    assert lifecycle.wake_tags(["weights"]) == {"weights"}
    with pytest.raises(ConfigError, match=r"unknown tag\(s\) \['gpu'\]"):
        lifecycle.wake_tags(["weights", "gpu"])
    # The REST routes report the same checks as the documented 400 `invalid_request`.
    with pytest.raises(RequestError, match="level must be 1 or 2, got 3"):
        lifecycle.sleep_level(3, RequestError)
    with pytest.raises(RequestError, match=r"unknown tag\(s\) \['gpu'\]"):
        lifecycle.wake_tags(["gpu"], RequestError)


def test_engine_config_refuses_a_pool_that_cannot_hold_one_sequence():
    # 128 tokens are 8 pages of 16: with the null page, 9 pages are the least that hold one.
    assert EngineConfig(page_size=16, num_pages=9, max_model_len=128).pages_per_seq == 8
    with pytest.raises(ConfigError, match="num_pages=8 cannot hold one max_model_len=128 sequence"):
        EngineConfig(page_size=16, num_pages=8, max_model_len=128)
    with pytest.raises(ConfigError, match="cannot hold one"):
        dataclasses.replace(EngineConfig(page_size=16, num_pages=9, max_model_len=128), max_model_len=129)


def test_no_other_site_branches_on_a_policy_mode_or_sleep_level():
    """Every decision reads the tables above (or `EngineState.serving` / `Engine.can_step`)."""
    root = Path(__file__).resolve().parents[2] / "hotswap"
    pattern = re.compile(
        r"policy ?==|policy in \(|mode ?== ?\"|level not in|level in \(1"
        r"|hold_admission ?=|asleep or|params is None or"
    )
    own = {"engine/policies.py", "engine/lifecycle.py"}
    found = {
        str(p.relative_to(root)): pattern.findall(p.read_text())
        for p in sorted(root.rglob("*.py"))
        if str(p.relative_to(root)) not in own
    }
    assert not {path: hits for path, hits in found.items() if hits}

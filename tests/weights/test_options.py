"""UpdateOptions: one frozen value for how an update runs, its fields written once."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hotswap import UpdateOptions
from hotswap.errors import ConfigError


def test_keywords_and_a_value_are_the_same_options():
    base = UpdateOptions(policy="keep", partial=True)
    assert UpdateOptions.of(base, version=7) == UpdateOptions(policy="keep", partial=True, version=7)
    assert UpdateOptions.of(None) == UpdateOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.policy = "drain"


def test_an_unknown_field_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown update option\(s\) \['polcy'\]; known: .*'policy'"):
        UpdateOptions.of(None, polcy="keep")


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"policy": 3}, "policy must be a name"),
        ({"version": True}, "version must be an int"),
        ({"version": 1.5}, "version must be an int"),
        ({"base_version": True}, "base_version must be an int"),
        ({"base_version": "3"}, "base_version must be an int"),
        ({"drain_timeout_s": -1.0}, "drain_timeout_s must be >= 0"),
        ({"lora_alpha": 0.0}, "lora_alpha must be a positive number"),
        ({"lora_alpha": math.nan}, "lora_alpha must be a positive number"),
    ],
)
def test_bad_values_are_refused_when_built(fields, needle):
    with pytest.raises(ConfigError, match=needle):
        UpdateOptions(**fields)


def test_the_json_form_round_trips_with_an_unbounded_drain():
    """What the multi-host driver sends its followers (a drain without a deadline included)."""
    import json

    opts = UpdateOptions(policy="abort", version=3, drain_timeout_s=math.inf, lora_alpha=16.0)
    assert UpdateOptions(**json.loads(json.dumps(opts.to_dict()))) == opts


def test_an_unknown_policy_is_refused_before_anything_is_read(tiny_dir, tmp_path):
    """The engine's policy table decides the name before the source is opened: a missing path
    would be a CheckpointError."""
    from hotswap import LLM

    llm = LLM(tiny_dir, warmup=False, max_model_len=64, num_pages=8)
    with pytest.raises(ConfigError, match="unknown update policy 'sometimes'"):
        llm.update_weights(tmp_path / "missing", policy="sometimes")
    with pytest.raises(ConfigError, match="unknown update option"):
        llm.update_weights(tiny_dir, polcy="keep")
    assert llm.weights_version == 1

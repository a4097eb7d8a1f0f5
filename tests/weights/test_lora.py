"""LoRA adapters as weight updates, merged on the device (the RL case: one adapter, changed every
step), against HF transformers + PEFT on seeded adapters; and bad adapters refused by name."""

from __future__ import annotations

import json
import pickle

import jax
import numpy as np
import pytest
from helpers import KNOBS
from lora_helpers import TARGETS, make_adapter, peft_logprobs

from hotswap import LLM, SamplingParams
from hotswap.checkpoint import payload
from hotswap.checkpoint.safetensors_io import read_safetensors
from hotswap.errors import ConfigError, HotswapError, NonFiniteWeights, PickleRefused, WeightsMismatch
from hotswap.model.spec import is_spec, param_specs

PAIRS = [([1, 17, 42, 99, 7], [3, 250, 11, 64, 5, 300]), ([2, 5, 9], [401, 33, 8, 120])]


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(tiny_dir, root / "a", seed=1),
        "b": make_adapter(tiny_dir, root / "b", seed=2, rank=4, alpha=4.0, targets=["q_proj", "down_proj"]),
    }


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, dtype="float32", warmup=False, **KNOBS)


def _max_diff(got, want) -> float:
    return max(float(np.max(np.abs(g - w))) for g, w in zip(got, want, strict=True))


def test_merged_adapter_matches_peft_and_each_update_is_a_version(llm, tiny_dir, adapters):
    """Each adapter update is version + 1 with an empty prefix cache and serves W + (alpha/r)·A·B
    as PEFT computes it; the next adapter merges into the base, not into the last merge."""
    v0 = llm.update_weights(str(tiny_dir))  # the base alone, whatever adapter an earlier test merged
    base = llm.score(PAIRS)
    assert _max_diff(base, peft_logprobs(tiny_dir, None, PAIRS)) <= 1e-4
    llm.generate([PAIRS[0][0] * 8], SamplingParams(max_tokens=1), use_tqdm=False)  # leaves cached pages
    assert llm.cache_usage()["cached"] > 0
    for i, name in enumerate(("a", "b", "a")):
        assert llm.update_weights(str(adapters[name])) == v0 + i + 1
        assert llm.cache_usage()["cached"] == 0
        assert _max_diff(llm.score(PAIRS), peft_logprobs(tiny_dir, adapters[name], PAIRS)) <= 1e-4
    # A full update replaces the base: the adapter is gone.
    llm.update_weights(str(tiny_dir))
    assert _max_diff(llm.score(PAIRS), base) <= 1e-6
    assert llm.engine.state.base is None


def test_peft_bytes_tensors_and_params_tree_merge_alike(llm, tiny_dir, adapters):
    """The same adapter as safetensors bytes, a PEFT-named mapping and a params-layout tree of
    A/B factors (alpha passed, as these forms do not state it) serves the same log-probs."""
    tensors = read_safetensors(adapters["a"] / "adapter_model.safetensors")
    want = peft_logprobs(tiny_dir, adapters["a"], PAIRS)
    llm.update_weights(payload.encode_safetensors(tensors), lora_alpha=16.0)
    assert _max_diff(llm.score(PAIRS), want) <= 1e-4
    llm.update_weights(dict(tensors), lora_alpha=16.0)
    assert _max_diff(llm.score(PAIRS), want) <= 1e-4
    tree = {"layers": [{} for _ in range(llm.config.num_layers)]}
    for s in jax.tree.leaves(param_specs(llm.config), is_leaf=is_spec):
        if s.adaptable:
            a, b = (np.asarray(tensors[n]) for n in s.lora_names("peft"))  # [r, in], [out, r]
            a_shape, b_shape = s.lora_shapes(a.shape[0])
            tree["layers"][s.path[1]][s.path[2]] = {
                "lora_a": a.T.reshape(a_shape),
                "lora_b": b.T.reshape(b_shape),
            }
    llm.update_weights(tree, lora_alpha=16.0)
    assert _max_diff(llm.score(PAIRS), want) <= 1e-4
    with pytest.raises(ConfigError, match="lora_alpha"):
        llm.update_weights(dict(tensors))  # no alpha stated, none passed


def _copy_adapter(src, dst, edit_tensors=None, edit_config=None):
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    tensors = dict(read_safetensors(src / "adapter_model.safetensors"))
    if edit_tensors:
        tensors = edit_tensors(tensors)
    if edit_config:
        config = edit_config(config)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    (dst / "adapter_model.safetensors").write_bytes(payload.encode_safetensors(tensors))
    return dst


def test_bad_adapters_are_refused_by_name_and_serving_is_unchanged(llm, tiny_dir, adapters, tmp_path):
    llm.update_weights(str(adapters["a"]))
    version, before = llm.weights_version, llm.score(PAIRS)
    q = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((adapters["a"] / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(pickle.dumps({"x": 1}))
    cases = {
        "another model": (
            _copy_adapter(
                adapters["a"], tmp_path / "wide", lambda t: {**t, q: np.zeros((8, 96), np.float32)}
            ),
            WeightsMismatch,
            rf"{q}: expected \(8, 64\)",
        ),
        "unknown module": (
            _copy_adapter(
                adapters["a"],
                tmp_path / "emb",
                edit_config=lambda c: {**c, "target_modules": ["embed_tokens"]},
            ),
            WeightsMismatch,
            "embed_tokens",
        ),
        "unknown tensor": (
            _copy_adapter(
                adapters["a"],
                tmp_path / "head",
                lambda t: {**t, "base_model.model.lm_head.lora_A.weight": np.zeros((8, 64), np.float32)},
            ),
            WeightsMismatch,
            "lm_head.lora_A",
        ),
        "missing pair": (
            _copy_adapter(adapters["a"], tmp_path / "half", lambda t: {k: v for k, v in t.items() if k != q}),
            WeightsMismatch,
            q,
        ),
        "nan": (
            _copy_adapter(
                adapters["a"], tmp_path / "nan", lambda t: {**t, q: np.full((8, 64), np.nan, np.float32)}
            ),
            NonFiniteWeights,
            q,
        ),
        "pickle": (pickled, PickleRefused, "never unpickled"),
    }
    for name, (path, error, match) in cases.items():
        with pytest.raises(error, match=match):
            llm.update_weights(str(path))
        assert llm.weights_version == version, name
        assert _max_diff(llm.score(PAIRS), before) == 0.0, name
    with pytest.raises(HotswapError):
        llm.update_weights(pickle.dumps({"layers": []}))  # a pickled payload: refused by its bytes
    assert TARGETS  # the oracle's targets are the spec table's adaptable modules

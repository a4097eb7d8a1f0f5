"""In-place weight updates (`weight_update_staging="in_place"`, `weights/place.py`): checked
first while serving goes on, then written over the serving weights, so the device holds one copy;
a bad update is still refused before anything serving is touched."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hotswap import LLM, SamplingParams
from hotswap.checkpoint import hf
from hotswap.errors import EngineAsleep, NonFiniteWeights, WeightsLost, WeightsMismatch
from hotswap.programs import catalog
from hotswap.weights import hf_device, place

KW = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, page_size=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
PROMPT = list(range(20, 90))


def _gen(llm, prompt=PROMPT):
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]


def _live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def _params_bytes(llm) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(llm.engine.state.params))


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, weight_update_staging="in_place", **KW)


@pytest.fixture(scope="module")
def copy_llm(tiny_dir):
    """The staged path on the same weights: the oracle of every in-place update."""
    return LLM(tiny_dir, weight_update_staging="copy", **KW)


@pytest.fixture(scope="module")
def tensors_b(tiny_dir_b):
    return dict(hf.read_hf_tensors(tiny_dir_b))


def _same(a, b):
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)


def test_auto_is_in_place_on_an_accelerator_and_a_copy_on_cpu(llm, copy_llm, tiny_dir):
    assert place.resolve("auto", "tpu") == place.resolve("auto", "gpu") == "in_place"
    assert place.resolve("auto", "cpu") == "copy"
    assert llm.engine.staging == "in_place" and copy_llm.engine.staging == "copy"
    assert LLM(tiny_dir, warmup=False, **KW).engine.staging == "copy"


def test_the_sizing_counts_one_copy_plus_what_a_pass_holds(llm):
    """The KV sizing's weights: staged, two copies and the tensors in flight; in place, one copy
    and the tensors in flight with their converted twins."""
    target = catalog.Target.on(llm.engine.mcfg, "reference", None, None)
    params = catalog.params_bytes_per_chip(llm.engine.mcfg, target)
    in_flight = hf_device.IN_FLIGHT_BYTES + max(x.nbytes for x in jax.tree.leaves(llm.engine.state.params))
    copy = catalog.weights_per_chip(llm.engine.mcfg, target, "copy")
    assert (copy.params, copy.reserve, copy.staging) == (params, params + in_flight, "copy")
    assert catalog.weights_per_chip(llm.engine.mcfg, target, "auto") == copy  # CPU
    in_place_weights = catalog.weights_per_chip(llm.engine.mcfg, target, "in_place")
    assert (in_place_weights.total, in_place_weights.staging) == (params + 2 * in_flight, "in_place")


def test_an_in_place_update_frees_the_old_weights_before_placing_the_new(
    llm, copy_llm, tiny_dir, tiny_dir_b, monkeypatch
):
    """The old leaves are gone (their bytes no longer live) when the new ones are placed, and
    the result serves exactly what the staged path serves."""
    llm.update_weights(tiny_dir)  # a known start whatever ran before
    before, params = _live_bytes(), _params_bytes(llm)
    seen = {}
    write = place.write

    def watching(*args, **kwargs):
        seen["live"] = _live_bytes()
        seen["params"] = llm.engine.state.params
        return write(*args, **kwargs)

    monkeypatch.setattr(place, "write", watching)
    version = llm.engine.weights_version
    assert llm.update_weights(tiny_dir_b) == version + 1
    assert seen["params"] is None  # the state held no weights while the new ones went in
    assert seen["live"] <= before - params, (seen["live"], before, params)
    copy_llm.update_weights(tiny_dir_b)
    _same(_gen(llm), _gen(copy_llm))
    assert _live_bytes() <= before + params // 10  # one copy again, not two
    llm.engine.check_invariants()


def test_bad_updates_are_refused_before_anything_serving_is_touched(llm, tensors_b):
    """NaN in an HF tensor, a wrong shape, NaN in a params tree: refused by the check pass;
    the same weights serve the same tokens, version unchanged."""
    want, version = _gen(llm), llm.engine.weights_version
    name = "model.layers.1.mlp.down_proj.weight"
    nan = dict(tensors_b)
    nan[name] = np.array(tensors_b[name], copy=True)
    nan[name].reshape(-1)[5] = np.nan
    with pytest.raises(NonFiniteWeights, match=name):
        llm.update_weights(nan)
    bad_shape = {**tensors_b, name: np.zeros((3, 3), np.float32)}
    with pytest.raises(WeightsMismatch, match=name):
        llm.update_weights(bad_shape)
    tree = jax.tree.map(np.array, jax.device_get(llm.engine.state.params))
    tree["layers"][0]["wq"].reshape(-1)[0] = np.inf
    with pytest.raises(NonFiniteWeights, match="layers.0.wq"):
        llm.update_weights(tree)
    assert llm.engine.weights_version == version
    _same(_gen(llm), want)


def test_a_partial_in_place_update_keeps_the_other_leaves(llm, copy_llm, tiny_dir, tensors_b):
    """A subset of tensors replaces only its leaves (a tied head with its embedding): the
    same tokens and log-probs as the staged path given the same subset."""
    subset = {
        n: tensors_b[n]
        for n in ("model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight")
        if n in tensors_b
    }
    assert len(subset) == 2
    for engine in (llm, copy_llm):
        engine.update_weights(tiny_dir)
        engine.update_weights(subset, partial=True)
    kept_before = llm.engine.state.params["layers"][1]["w_down"]
    _same(_gen(llm), _gen(copy_llm))
    assert llm.engine.state.params["layers"][1]["w_down"] is kept_before  # untouched, uncopied


def test_a_device_failure_while_writing_loses_the_weights_loudly(llm, tiny_dir, monkeypatch):
    """Pass 2 fails only as the device does: the engine then says the weights are lost (503),
    refuses requests instead of serving half a model, and the next update serves again."""
    llm.update_weights(tiny_dir)
    want = _gen(llm)

    def failing(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory (simulated)")

    monkeypatch.setattr(hf_device, "hf_to_device", failing)
    with pytest.raises(WeightsLost, match="RESOURCE_EXHAUSTED") as err:
        llm.update_weights(tiny_dir)
    assert err.value.status == 503
    with pytest.raises(EngineAsleep):
        _gen(llm)
    monkeypatch.undo()
    llm.update_weights(tiny_dir)
    _same(_gen(llm), want)
    llm.engine.check_invariants()


def test_a_lora_adapter_is_read_once_and_merged_as_the_staged_path_merges_it(
    llm, copy_llm, tiny_dir, tmp_path, monkeypatch
):
    """A LoRA adapter is merged beside the base it keeps, whatever the staging: the in-place
    engine serves what the staged one serves, and reads the adapter's files once (the check pass
    hands the adapter it read on to the merge)."""
    from lora_helpers import make_adapter

    from hotswap.weights import lora_forms

    adapter = make_adapter(tiny_dir, tmp_path / "adapter", seed=3)
    for engine in (llm, copy_llm):
        engine.update_weights(tiny_dir)
    base = _gen(llm)
    reads = []
    read = lora_forms.peft_dir

    def counting(path):
        reads.append(path)
        return read(path)

    monkeypatch.setattr(lora_forms, "peft_dir", counting)
    llm.update_weights(str(adapter))
    assert len(reads) == 1
    copy_llm.update_weights(str(adapter))
    merged = _gen(llm)
    _same(merged, _gen(copy_llm))
    assert np.abs(np.subtract(merged.logprobs, base.logprobs)).max() > 1e-3  # the adapter took effect
    llm.engine.check_invariants()

"""Hot weight updates: never stale KV, typed errors that change nothing, policies, sleep/wakeup."""

from __future__ import annotations

import io
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count_compiles

from hotswap import LLM, SamplingParams
from hotswap.checkpoint import hf
from hotswap.checkpoint.payload import encode_safetensors
from hotswap.errors import (
    EngineAsleep,
    HotswapError,
    LifecycleConflict,
    NonFiniteWeights,
    PayloadError,
    PickleRefused,
    WeightsMismatch,
)

KW = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, page_size=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = list(range(20, 90))  # 70 tokens: 4 full pages of 16


def _gen(llm, prompt=PROMPT, sp=GREEDY):
    return llm.generate([prompt], sp, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def new_params(tiny_dir_b):
    return hf.load_hf_dir(tiny_dir_b)[1]


@pytest.fixture(scope="module")
def fresh_b(tiny_dir_b):
    """A fresh engine built directly with the new weights: the oracle after an update."""
    return _gen(LLM(tiny_dir_b, **KW))


@pytest.fixture
def llm(tiny_dir):
    return LLM(tiny_dir, **KW)


def test_stale_kv_regression(llm, new_params, fresh_b):
    v1 = _gen(llm)
    assert _gen(llm).num_cached_tokens == 64  # the prompt's full pages are cached under v1
    assert llm.update_weights(new_params) == 2
    out = _gen(llm)
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == fresh_b.outputs[0].token_ids != v1.outputs[0].token_ids
    np.testing.assert_allclose(out.outputs[0].logprobs, fresh_b.outputs[0].logprobs, atol=1e-5)
    assert out.outputs[0].weights_versions == [2] * 8
    assert set(llm.state.prefix.version[llm.state.prefix.key != 0]) <= {2}
    llm.engine.check_invariants()


def test_twenty_alternating_updates(llm, tiny_dir, new_params, fresh_b):
    old_params = hf.load_hf_dir(tiny_dir)[1]
    v1 = _gen(llm)
    other = [7, 8, 9] * 12
    for i in range(20):
        use_b = i % 2 == 0
        version = llm.update_weights(new_params if use_b else old_params)
        assert version == i + 2
        llm.generate([other], GREEDY, use_tqdm=False)  # interleaved traffic fills the cache
        out = _gen(llm)
        want = fresh_b if use_b else v1
        assert out.num_cached_tokens == 0, f"update {i}: served cached KV from an older version"
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert out.outputs[0].weights_versions == [version] * 8
        assert _gen(llm).num_cached_tokens == 64  # and caching works within a version


def _in_flight(llm, n=3, max_tokens=30):
    got = {}
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(n):
        llm.engine.add_request(f"r{i}", PROMPT[i:], sp, sink=lambda o: got.__setitem__(o.request_id, o))
    seqs = [llm.engine.requests[f"r{i}"].seqs[0] for i in range(n)]
    for _ in range(8):  # until every request has sampled a token (4 steps at this budget)
        llm.engine.step()
        if all(s.output_ids for s in seqs):
            break
    assert llm.engine.num_running() == n and all(s.output_ids for s in seqs)
    return got


def _finish(llm, got, n=3):
    while len(got) < n:
        llm.engine.step()
    return [got[f"r{i}"].outputs[0] for i in range(n)]


def test_policy_drain(llm, new_params):
    got = _in_flight(llm)
    assert llm.update_weights(new_params, policy="drain") == 2
    assert len(got) == 3  # the update waited for them
    for c in _finish(llm, got):
        assert c.finish_reason == "length" and len(c.token_ids) == 30
        assert c.weights_versions == [1] * 30


def test_policy_abort(llm, new_params):
    got = _in_flight(llm)
    llm.update_weights(new_params, policy="abort")
    for c in _finish(llm, got):
        assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 30
        assert set(c.weights_versions) == {1}
    llm.engine.check_invariants()
    assert int(llm.engine.state.pool.refcount.sum()) == 0


@pytest.mark.parametrize("policy", ["recompute", "keep"])
def test_policy_recompute_and_keep_label_tokens(llm, new_params, fresh_b, policy):
    got = _in_flight(llm)
    llm.update_weights(new_params, policy=policy)
    outs = _finish(llm, got)
    for i, c in enumerate(outs):
        assert len(c.token_ids) == 30 and c.finish_reason == "length"
        k = c.weights_versions.index(2)
        assert 0 < k and set(c.weights_versions[:k]) == {1} and set(c.weights_versions[k:]) == {2}
        assert [s["version"] for s in c.weights_version_spans] == [1, 2]
        assert c.mixed_weights_kv == (policy == "keep")  # keep: v2 tokens over v1 context
        if policy == "recompute":
            # after the swap every token is what the new weights give for this exact prefix
            prefix = PROMPT[i:] + c.token_ids[:k]
            llm_lp = llm.score(prefix, c.token_ids[k:])
            np.testing.assert_allclose(c.logprobs[k:], llm_lp, atol=1e-4)
    llm.engine.check_invariants()
    assert int(llm.engine.state.pool.refcount.sum()) == 0
    out = _gen(llm)
    assert out.outputs[0].token_ids == fresh_b.outputs[0].token_ids
    if policy == "keep":
        assert out.num_cached_tokens == 0  # pages that mixed versions never entered the index
    else:
        assert out.num_cached_tokens == 64  # recomputed pages are genuinely version 2


def test_policy_reject(llm, new_params):
    got = _in_flight(llm)
    with pytest.raises(LifecycleConflict, match="in flight"):
        llm.update_weights(new_params, policy="reject")
    assert llm.weights_version == 1
    for c in _finish(llm, got):
        assert c.weights_versions == [1] * 30
    with pytest.raises(LifecycleConflict, match="cached"):  # cached pages also count
        llm.update_weights(new_params, policy="reject")
    llm.reset_prefix_cache()
    assert llm.update_weights(new_params, policy="reject") == 2


def _bad_sources(tiny_dir_b, new_params):
    cfg = hf.load_hf_dir(tiny_dir_b)[0]
    tensors = hf.hf_from_params(cfg, new_params)
    wrong_shape = dict(
        tensors, **{"model.layers.0.mlp.up_proj.weight": tensors["model.layers.0.mlp.up_proj.weight"].T}
    )
    wrong_dtype = jax.tree.map(lambda x: np.asarray(x, np.float16), new_params)
    missing = {k: v for k, v in tensors.items() if k != "model.norm.weight"}
    extra = dict(
        tensors, **{"model.layers.9.mlp.up_proj.weight": tensors["model.layers.0.mlp.up_proj.weight"]}
    )
    nan = jax.tree.map(lambda x: x, new_params)
    nan["layers"][1]["wo"] = nan["layers"][1]["wo"].copy()
    nan["layers"][1]["wo"][3, 3] = np.nan
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    nan_hf = dict(tensors, **{k_proj: tensors[k_proj].copy()})
    nan_hf[k_proj][5, 7] = np.inf
    blob = encode_safetensors(tensors)
    buf = io.BytesIO()
    import torch

    torch.save({k: torch.from_numpy(v) for k, v in list(tensors.items())[:2]}, buf)
    return {
        "wrong shape": (wrong_shape, WeightsMismatch, "up_proj"),
        "wrong dtype": (wrong_dtype, WeightsMismatch, "float16"),
        "missing tensor": (missing, WeightsMismatch, "model.norm.weight"),
        "extra tensor": (extra, WeightsMismatch, "model.layers.9"),
        "NaN": (nan, NonFiniteWeights, "layers.1.wo"),
        # device arrays take the C++ check on one CPU device (cpu_finite), not numpy's
        "NaN in device arrays": (jax.device_put(nan, jax.devices()[0]), NonFiniteWeights, "layers.1.wo"),
        "Inf in an HF tensor": (nan_hf, NonFiniteWeights, r"^model\.layers\.0\.self_attn\.k_proj\.weight: "),
        "NaN in safetensors bytes": (encode_safetensors(nan_hf), NonFiniteWeights, "k_proj"),
        "truncated safetensors": (blob[: len(blob) // 2], PayloadError, "truncated"),
        "pickle bytes": (pickle.dumps(tensors), PickleRefused, "pickle"),
        "torch.save bytes": (buf.getvalue(), PickleRefused, "torch.save"),
    }


def test_bad_updates_change_nothing(llm, tiny_dir_b, new_params):
    before = _gen(llm)
    for name, (src, err, needle) in _bad_sources(tiny_dir_b, new_params).items():
        with pytest.raises(err, match=needle):
            llm.update_weights(src)
        assert llm.weights_version == 1, name
        after = _gen(llm)
        assert after.outputs[0].token_ids == before.outputs[0].token_ids, name
        assert after.outputs[0].logprobs == before.outputs[0].logprobs, name
    # a half-finished chunk sequence commits nothing
    cfg = llm.config
    tensors = hf.hf_from_params(cfg, new_params)
    names = sorted(tensors)
    assert (
        llm.engine.update_weights_chunk(
            encode_safetensors({n: tensors[n] for n in names[:5]}), finished=False, update_id="u1"
        )
        is None
    )
    with pytest.raises(PayloadError):
        llm.engine.update_weights_chunk({n: tensors[n] for n in names[5:]}, finished=True, update_id="u2")
    assert llm.weights_version == 1 and _gen(llm).outputs[0].token_ids == before.outputs[0].token_ids
    llm.engine.stager.abort()
    # a partial update must be asked for explicitly
    one = {"model.norm.weight": tensors["model.norm.weight"]}
    with pytest.raises(WeightsMismatch, match="missing"):
        llm.update_weights(one)
    assert llm.update_weights(one, partial=True) == 2


def test_in_process_update_no_copy_no_recompile(llm, new_params):
    _gen(llm)
    device = jax.devices()[0]
    placed = jax.device_put(new_params, device)  # already on the engine's device and sharding
    scaled = jax.device_put(jax.tree.map(lambda x: x * 1.5, new_params), device)
    llm.update_weights(scaled)  # the first device-array update compiles the finiteness check once
    with count_compiles() as compiles:
        llm.update_weights(placed)
        _gen(llm)
        llm.update_weights(scaled)
        _gen(llm)
    assert compiles() == 0
    llm.update_weights(placed)
    for a, b in zip(jax.tree.leaves(llm.params), jax.tree.leaves(placed), strict=True):
        assert a is b  # used as-is: zero copy
    # uncommitted arrays (jnp.asarray) on the same device are committed in place, not copied
    loose = jax.tree.map(jnp.asarray, new_params)
    llm.update_weights(loose)
    for a, b in zip(jax.tree.leaves(llm.params), jax.tree.leaves(loose), strict=True):
        assert a.unsafe_buffer_pointer() == b.unsafe_buffer_pointer()


def test_directory_update_compiles_once_and_partial_keeps_leaves(llm, tiny_dir, tiny_dir_b, fresh_b):
    llm.update_weights(str(tiny_dir))  # the first directory update compiles its converters
    _gen(llm)
    with count_compiles() as compiles:
        assert llm.update_weights(str(tiny_dir_b)) == 3
        out = _gen(llm)
    assert compiles() == 0
    assert out.outputs[0].token_ids == fresh_b.outputs[0].token_ids
    before = llm.params
    norm = np.array(hf.read_hf_tensors(tiny_dir_b)["model.norm.weight"])
    assert llm.update_weights({"model.norm.weight": norm * 2}, partial=True) == 4
    after = llm.params
    np.testing.assert_array_equal(np.asarray(after["final_norm"]), norm * 2)
    assert after["layers"][0]["wq"] is before["layers"][0]["wq"]  # kept as is: no copy, no host trip
    assert after["embed"] is before["embed"] and after["lm_head"] is before["lm_head"]


def _live_bytes():
    return sum(a.nbytes for a in jax.live_arrays())


def test_sleep_wakeup_cycles(llm):
    before = _gen(llm)
    base = None
    for i in range(50):
        llm.sleep(level=1)
        assert llm.is_sleeping
        with pytest.raises(EngineAsleep):
            _gen(llm)
        llm.wakeup()
        assert not llm.is_sleeping
        if i % 10 == 0:
            out = _gen(llm)
            assert out.outputs[0].token_ids == before.outputs[0].token_ids
            assert out.num_cached_tokens == 0  # sleep dropped the cache
        if i == 1:
            base = _live_bytes()
    assert _live_bytes() <= base * 1.05
    assert llm.weights_version == 1  # sleep/wakeup never changes the weights


def test_sglang_style_sequence(llm, tiny_dir_b, new_params, fresh_b):
    """sleep(level=2) -> wakeup(weights) -> update_weights(chunks..., finished) -> wakeup(kv_cache)."""
    llm.sleep(level=2)
    assert llm.params is None
    llm.wakeup(["weights"])
    assert llm.is_sleeping  # no weights to serve until the update arrives
    with pytest.raises(EngineAsleep):
        _gen(llm)
    tensors = hf.hf_from_params(llm.config, new_params)
    names = sorted(tensors)
    half = len(names) // 2
    assert (
        llm.engine.update_weights_chunk(
            encode_safetensors({n: tensors[n] for n in names[:half]}), finished=False, update_id="x"
        )
        is None
    )
    assert (
        llm.engine.update_weights_chunk(
            encode_safetensors({n: tensors[n] for n in names[half:]}), finished=True, update_id="x"
        )
        == 2
    )
    llm.wakeup(["kv_cache"])
    out = _gen(llm)
    assert out.outputs[0].token_ids == fresh_b.outputs[0].token_ids
    assert out.outputs[0].weights_versions == [2] * 8


def test_update_from_directory_and_orbax(llm, tiny_dir_b, new_params, fresh_b, tmp_path):
    from hotswap.checkpoint import orbax_io

    assert llm.update_weights(str(tiny_dir_b)) == 2
    assert _gen(llm).outputs[0].token_ids == fresh_b.outputs[0].token_ids
    orbax_io.save_params(new_params, tmp_path / "ckpt")
    assert llm.update_weights(str(tmp_path / "ckpt"), version=10) == 10
    assert _gen(llm).outputs[0].weights_versions == [10] * 8
    with pytest.raises(LifecycleConflict, match="greater"):
        llm.update_weights(new_params, version=5)


def test_errors_are_typed(llm):
    with pytest.raises(HotswapError):
        llm.update_weights(42)
    with pytest.raises(HotswapError, match="policy"):
        llm.update_weights({}, policy="yolo")


def test_drain_finishes_preempted_sequences(tiny_dir, new_params):
    """A sequence preempted (pages ran out) before the update still finishes on the old weights."""
    small = LLM(tiny_dir, **(KW | dict(num_pages=12)), warmup=False)
    got = {}
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(3):
        small.engine.add_request(f"r{i}", PROMPT[i:], sp, sink=lambda o: got.__setitem__(o.request_id, o))
    while small.engine.sched.num_preemptions == 0:
        small.engine.step()
    assert small.update_weights(new_params, policy="drain", drain_timeout_s=120) == 2
    assert len(got) == 3
    for o in got.values():
        c = o.outputs[0]
        assert c.finish_reason == "length" and c.weights_versions == [1] * 30
    small.engine.check_invariants()

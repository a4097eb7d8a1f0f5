"""HF tensors converted on the device (weights/hf_device.py), the weight-update path.

Oracle: the host conversion `hf.params_from_hf`. Each check runs on both
routes: "cpu" (this machine: numpy checks finiteness on the source) and
"device" (what TPU/GPU do: the finiteness flag is reduced on the device).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import count_compiles, hf_to_device

from hotswap.checkpoint import hf
from hotswap.checkpoint.create import create_checkpoint
from hotswap.errors import NonFiniteWeights, WeightsMismatch
from hotswap.model import spec
from hotswap.model.config import ModelConfig
from hotswap.model.params import abstract_params
from hotswap.weights import hf_device

K_PROJ = "model.layers.0.self_attn.k_proj.weight"  # transposed
NORM = "model.layers.1.post_attention_layernorm.weight"  # not transposed


def abstract_for(cfg: ModelConfig, dtype: str | None = None):
    """What the engine validates against on one CPU device."""
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev), abstract_params(cfg, dtype)
    )


def assert_same(got, want):
    flat_got, flat_want = jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(want)
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
    for (path, a), (_, b) in zip(flat_got, flat_want, strict=True):
        assert isinstance(a, jax.Array), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=str(path))


@pytest.fixture(params=["cpu", "device"])
def route(request, monkeypatch):
    if request.param == "device":
        monkeypatch.setattr(hf_device, "_on_cpu", lambda sharding: False)
    return request.param


@pytest.fixture(scope="module", params=["llama", "llama-tied", "qwen2", "qwen3"])
def ckpt(request, tmp_path_factory):
    arch, _, tied = request.param.partition("-")
    overrides = {"tie_word_embeddings": bool(tied)}
    if arch == "qwen3":
        overrides["head_dim"] = 16
    d = create_checkpoint(tmp_path_factory.mktemp(request.param), arch=arch, seed=3, overrides=overrides)
    return ModelConfig.from_dir(d), d


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    d = create_checkpoint(tmp_path_factory.mktemp("tied"), seed=4, overrides={"tie_word_embeddings": True})
    cfg = ModelConfig.from_dir(d)
    return cfg, {k: np.array(v) for k, v in hf.read_hf_tensors(d).items()}


# ---- same values as the host conversion ---------------------------------------------------


def test_matches_host_conversion(ckpt, route):
    cfg, d = ckpt
    tensors = hf.read_hf_tensors(d)
    got = hf_to_device(cfg, tensors, abstract_for(cfg))
    assert_same(got, hf.params_from_hf(cfg, tensors))
    if cfg.tie_word_embeddings:
        np.testing.assert_array_equal(np.asarray(got["lm_head"]), np.asarray(got["embed"]).T)


@pytest.mark.parametrize(
    ("source", "engine"), [("bfloat16", "float32"), ("float32", "bfloat16"), ("float64", "float32")]
)
def test_casts_to_the_engine_dtype(tied, route, source, engine):
    cfg, tensors = tied
    src = {k: v.astype(hf.np_dtype(source)) for k, v in tensors.items()}
    got = hf_to_device(cfg, src, abstract_for(cfg, engine))
    assert got["embed"].dtype == np.dtype(hf.np_dtype(engine))
    assert_same(got, hf.params_from_hf(cfg, src, dtype=engine))


def test_tied_head_given_twice_must_match(tied, route):
    cfg, tensors = tied
    twice = {**tensors, spec.LM_HEAD: tensors[hf.EMBED]}
    assert_same(hf_to_device(cfg, twice, abstract_for(cfg)), hf.params_from_hf(cfg, tensors))
    with pytest.raises(WeightsMismatch, match="lm_head.weight: differs"):
        hf_to_device(cfg, {**tensors, spec.LM_HEAD: tensors[hf.EMBED] * 2}, abstract_for(cfg))


# ---- fresh buffers: nothing aliases a file or a caller's array -------------------------------


def test_rewriting_the_file_in_place_changes_nothing(tmp_path, route):
    """The file is memmapped while read, and jax on CPU adopts aligned host buffers: the
    params must still be copies, or a trainer saving the next step over it would change them."""
    d = create_checkpoint(tmp_path / "ck", seed=5, overrides={"tie_word_embeddings": True})
    cfg = ModelConfig.from_dir(d)
    got = hf_to_device(cfg, hf.read_hf_tensors(d), abstract_for(cfg))
    before = jax.tree.map(np.array, got)
    path = d / hf.SINGLE_FILE
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    with open(path, "r+b") as f:  # same inode, same size, every weight byte changed
        f.seek(header)
        f.write(b"\x3f" * (path.stat().st_size - header))
    assert float(np.abs(hf.read_hf_tensors(d)[hf.EMBED] - 0.74).max()) < 0.01  # the file did change
    assert_same(got, before)


def test_callers_arrays_are_copied(tied, route):
    cfg, tensors = tied
    mine = {k: v.copy() for k, v in tensors.items()}
    got = hf_to_device(cfg, mine, abstract_for(cfg))
    for v in mine.values():
        v[...] = 7.0
    assert_same(got, hf.params_from_hf(cfg, tensors))
    on_device = {k: jnp.asarray(v) for k, v in tensors.items()}
    got = hf_to_device(cfg, on_device, abstract_for(cfg))
    inputs = {x.unsafe_buffer_pointer() for x in on_device.values()}
    assert not inputs & {x.unsafe_buffer_pointer() for x in jax.tree.leaves(got)}


# ---- typed errors, under the HF name -----------------------------------------------------------


@pytest.mark.parametrize("name", [K_PROJ, NORM, hf.EMBED])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_is_named_and_can_be_let_through(tied, route, name, bad):
    cfg, tensors = tied
    t = tensors[name].copy()
    t.reshape(-1)[t.size // 3] = bad
    src = {**tensors, name: t}
    with pytest.raises(NonFiniteWeights, match=rf"^{name}: contains NaN or Inf$"):
        hf_to_device(cfg, src, abstract_for(cfg))
    got = hf_to_device(cfg, src, abstract_for(cfg), check_finite=False)
    assert not np.isfinite(np.asarray(hf.get_leaf(got, spec.hf_specs(cfg)[name].path))).all()


def test_non_finite_counts_the_rest_and_names_overflow(tied, route):
    cfg, tensors = tied
    two = {**tensors, K_PROJ: tensors[K_PROJ] * np.nan, NORM: tensors[NORM] * np.inf}
    with pytest.raises(NonFiniteWeights, match=rf"^{K_PROJ}: contains NaN or Inf \(and 1 more\)$"):
        hf_to_device(cfg, two, abstract_for(cfg))
    big = {**tensors, NORM: np.full_like(tensors[NORM], 1e6)}  # finite in f32, inf in f16
    with pytest.raises(NonFiniteWeights, match=rf"^{NORM}: .*after conversion to float16 \(overflow\)"):
        hf_to_device(cfg, big, abstract_for(cfg, "float16"))


def test_names_shapes_dtypes_are_checked_first(tied):
    cfg, tensors = tied
    with pytest.raises(WeightsMismatch, match=rf"{K_PROJ}: expected"):
        hf_to_device(cfg, {**tensors, K_PROJ: tensors[K_PROJ].T}, abstract_for(cfg))
    with pytest.raises(WeightsMismatch, match=rf"{NORM}: dtype int32"):
        hf_to_device(cfg, {**tensors, NORM: tensors[NORM].astype(np.int32)}, abstract_for(cfg))
    with pytest.raises(WeightsMismatch, match="missing tensor"):
        hf_to_device(cfg, {NORM: tensors[NORM]}, abstract_for(cfg))


# ---- partial updates, compilation ---------------------------------------------------------------


def test_partial_update_keeps_the_other_leaves_uncopied(tied, route):
    cfg, tensors = tied
    base = hf_to_device(cfg, tensors, abstract_for(cfg))
    embed = tensors[hf.EMBED] * 2
    got = hf_to_device(cfg, {hf.EMBED: embed, K_PROJ: tensors[K_PROJ] * 3}, abstract_for(cfg), base=base)
    np.testing.assert_array_equal(np.asarray(got["embed"]), embed)
    np.testing.assert_array_equal(np.asarray(got["lm_head"]), embed.T)  # the tied head follows
    wk = np.asarray(got["layers"][0]["wk"])  # [D, Hkv, hd]: HF's [Hkv*hd, D] transposed, heads split
    np.testing.assert_array_equal(wk, (tensors[K_PROJ].T * 3).reshape(wk.shape))
    assert wk.shape == (cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim)
    assert got["layers"][1]["w_up"] is base["layers"][1]["w_up"] and got["final_norm"] is base["final_norm"]
    np.testing.assert_array_equal(np.asarray(base["embed"]), tensors[hf.EMBED])  # the base is untouched
    with pytest.raises(WeightsMismatch, match="unexpected"):
        hf_to_device(cfg, {"model.layers.7.mlp.up_proj.weight": 0}, abstract_for(cfg), base=base)


def test_second_update_compiles_nothing(tied, route):
    """One small jit per tensor shape: a later update, full or any subset, reuses them."""
    cfg, tensors = tied
    base = hf_to_device(cfg, tensors, abstract_for(cfg))
    other = {k: v * 0.5 for k, v in tensors.items()}
    with count_compiles() as compiles:
        hf_to_device(cfg, other, abstract_for(cfg))
        hf_to_device(cfg, {K_PROJ: other[K_PROJ], NORM: other[NORM]}, abstract_for(cfg), base=base)
    assert compiles() == 0


# ---- sharded --------------------------------------------------------------------------------------

MESH_SCRIPT = r"""
import json, sys
import jax, numpy as np
from hotswap.checkpoint import hf
from hotswap.checkpoint.create import create_checkpoint
from hotswap.model.config import ModelConfig
from hotswap.weights import hf_device, pipeline
from hotswap.model import sharding
from hotswap.model.params import abstract_params

SHAPES = {"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 128, "intermediate_size": 256}
out = {}
on_cpu = hf_device._on_cpu
for route in ("cpu", "device"):
    hf_device._on_cpu = (lambda sharding: False) if route == "device" else on_cpu
    for tied in (False, True):
        d = create_checkpoint(f"{sys.argv[1]}/{route}-{tied}", seed=6, overrides={**SHAPES, "tie_word_embeddings": tied})
        cfg = ModelConfig.from_dir(d)
        shardings, _ = sharding.engine_shardings(cfg, 4)
        abstract = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract_params(cfg), shardings
        )
        tensors = hf.read_hf_tensors(d)
        got = pipeline.stage(tensors, cfg, abstract).params
        want = hf.params_from_hf(cfg, tensors)
        flat = zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(shardings), strict=True)
        out[f"{route}-{tied}"] = {
            "equal": all(np.array_equal(np.asarray(a), b) for a, b, _ in flat),
            "placed": all(
                a.sharding.is_equivalent_to(s, a.ndim)
                for a, s in zip(jax.tree.leaves(got), jax.tree.leaves(shardings), strict=True)
            ),
            "split": len({str(s.index) for s in got["layers"][0]["wq"].addressable_shards}),
        }
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sharded_update_lands_on_the_engine_shardings(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {f"{r}-{t}" for r in ("cpu", "device") for t in (False, True)}
    for key, r in result.items():
        assert r == {"equal": True, "placed": True, "split": 4}, key


def test_bf16_checkpoint_dtype_roundtrip(tmp_path, route):
    d = create_checkpoint(tmp_path / "bf16", seed=7, overrides={"dtype": "bfloat16"})
    cfg = ModelConfig.from_dir(d)
    tensors = hf.read_hf_tensors(d)
    assert tensors[hf.EMBED].dtype == np.dtype(ml_dtypes.bfloat16)
    assert_same(hf_to_device(cfg, tensors, abstract_for(cfg)), hf.params_from_hf(cfg, tensors))

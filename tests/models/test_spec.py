"""The parameter spec table (`model/spec.py`) drives shapes, sharding axes and HF names."""

from __future__ import annotations

import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hotswap.checkpoint import hf  # noqa: E402
from hotswap.checkpoint.create import create_checkpoint, load_preset  # noqa: E402
from hotswap.model import sharding, spec  # noqa: E402
from hotswap.model.config import ModelConfig  # noqa: E402
from hotswap.model.params import abstract_params, param_paths, param_shapes  # noqa: E402

ARCHS = ["llama", "llama-tied", "qwen2", "qwen3"]


def _cfg(name: str) -> ModelConfig:
    arch, _, tied = name.partition("-")
    return ModelConfig.from_hf({**load_preset("tiny"), "model_type": arch, "tie_word_embeddings": bool(tied)})


@pytest.mark.parametrize("name", ARCHS)
def test_every_param_has_exactly_one_row(name):
    cfg = _cfg(name)
    rows = jax.tree.leaves(spec.param_specs(cfg), is_leaf=spec.is_spec)
    abstract = dict(param_paths(abstract_params(cfg)))
    assert sorted(r.name for r in rows) == sorted(abstract)  # one row per leaf, no extra rows
    for r in rows:
        assert abstract[r.name].shape == r.shape, r.name
        assert len(r.axes) == len(r.shape) and set(r.axes) <= set(sharding.RULES), r.name
        m = r.matrix or r.shape  # the [in, out] matrix a head-split leaf reshapes, row-major
        assert r.hf_shape == (m[::-1] if r.transpose else m) and math.prod(m) == math.prod(r.shape)
    # Every HF tensor name is one row's, and only a tied head has none.
    named = spec.hf_specs(cfg)
    assert len(named) == len(rows) - cfg.tie_word_embeddings
    assert {r.name for r in rows if r.hf_name is None} == ({"lm_head"} if cfg.tie_word_embeddings else set())
    assert hf.hf_tensor_names(cfg) == {n: r.name for n, r in named.items()}


def test_trees_are_maps_over_the_table():
    cfg = _cfg("qwen2")
    rows = spec.param_specs(cfg)
    assert param_shapes(cfg) == jax.tree.map(lambda r: r.shape, rows, is_leaf=spec.is_spec)
    mesh = sharding.make_mesh(1)
    got = sharding.param_shardings(cfg, mesh)
    want = jax.tree.map(lambda r: sharding.logical_to_spec(r.axes), rows, is_leaf=spec.is_spec)
    assert jax.tree.map(lambda s: s.spec, got) == want
    row = rows["layers"][1]["w_up"]
    assert row.hf_name == "model.layers.1.mlp.up_proj.weight" and row.transpose
    assert row.axes == ("embed", "mlp") and row.shape == (cfg.hidden_size, cfg.intermediate_size)
    # attention keeps heads as an axis (Tunix's layout): wq [D, Hq, hd] from HF [Hq*hd, D]
    d, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layer = rows["layers"][0]
    assert (layer["wq"].shape, layer["wq"].axes) == ((d, nh, hd), ("embed", "heads", "head_dim"))
    assert (layer["wk"].shape, layer["wk"].axes) == ((d, nkv, hd), ("embed", "kv_heads", "head_dim"))
    assert (layer["wo"].shape, layer["wo"].axes) == ((nh, hd, d), ("heads", "head_dim", "embed"))
    assert layer["wq"].hf_shape == (nh * hd, d) and layer["wo"].hf_shape == (d, nh * hd)
    assert layer["wq"].hf_dims() == ((1, 2), (0,)) and layer["wo"].hf_dims() == ((2,), (0, 1))
    assert layer["bq"].shape == (nh * hd,)  # flat, as HF and Tunix store it


@pytest.mark.parametrize("name", ARCHS)
def test_hf_round_trip_through_the_table_is_exact(tmp_path, name):
    """save -> load through the table gives the same bits, and each file tensor is its row's."""
    arch, _, tied = name.partition("-")
    overrides = {"tie_word_embeddings": bool(tied)}
    if arch == "qwen3":
        overrides["head_dim"] = 16
    d = create_checkpoint(tmp_path / "a", arch=arch, seed=1, overrides=overrides)
    cfg, params = hf.load_hf_dir(d)
    hf.save_hf_dir(hf.read_hf_config(d), params, tmp_path / "b")
    cfg2, again = hf.load_hf_dir(tmp_path / "b")
    assert cfg2 == cfg
    for (path, a), (_, b) in zip(param_paths(params), param_paths(again), strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    on_disk = hf.read_hf_tensors(tmp_path / "b")
    rows = spec.hf_specs(cfg)
    assert set(on_disk) == set(rows)
    for hf_name, row in rows.items():
        leaf = hf.get_leaf(params, row.path)
        m = leaf.reshape(row.matrix) if row.matrix else leaf
        np.testing.assert_array_equal(on_disk[hf_name], m.T if row.transpose else m, err_msg=hf_name)
        np.testing.assert_array_equal(row.from_hf(on_disk[hf_name]), leaf, err_msg=hf_name)

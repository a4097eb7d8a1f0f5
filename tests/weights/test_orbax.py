"""Orbax save/restore of the params pytree, and the allowed-root check for weight paths."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hotswap.checkpoint.orbax_io import resolve_weights_path, restore_params, save_params  # noqa: E402
from hotswap.errors import CheckpointError, WeightsMismatch, WeightsPathNotAllowed  # noqa: E402
from hotswap.model.config import ModelConfig  # noqa: E402
from hotswap.model.params import abstract_params, param_paths, param_shapes  # noqa: E402
from hotswap.weights import place, plan, readers  # noqa: E402

CFG = ModelConfig(
    arch="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qk_norm=True,
)


def _params(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: rng.standard_normal(s).astype(dtype),
        param_shapes(CFG),
        is_leaf=lambda x: isinstance(x, tuple),
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint shared by the read-only tests (a save costs ~40 ms, restores ~30 ms)."""
    params = _params()
    path = save_params(params, tmp_path_factory.mktemp("ckpt") / "step_1")
    return params, path


def _assert_same(got, want):
    assert isinstance(got["layers"], list) and len(got["layers"]) == CFG.num_layers
    got_flat, want_flat = dict(param_paths(got)), dict(param_paths(want))
    assert got_flat.keys() == want_flat.keys()
    for name, w in want_flat.items():
        g = got_flat[name]
        assert isinstance(g, jax.Array), name
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), name


def test_roundtrip_bit_exact(saved):
    params, path = saved
    _assert_same(restore_params(path, abstract_params(CFG)), params)


def test_restore_without_abstract_tree(saved):
    params, path = saved
    _assert_same(restore_params(path), params)


def test_roundtrip_bf16_jax_arrays(tmp_path):
    params = jax.tree.map(jax.numpy.asarray, _params(ml_dtypes.bfloat16, seed=1))
    path = save_params(params, tmp_path / "bf16")
    _assert_same(restore_params(path, abstract_params(CFG, "bfloat16")), params)
    # Saved jax arrays carry sharding metadata; restoring without a target must still work.
    _assert_same(restore_params(path), params)


def test_restore_casts_float_dtype(saved):
    params, path = saved
    got = restore_params(path, abstract_params(CFG, "bfloat16"))
    assert got["embed"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(np.asarray(got["embed"]), params["embed"].astype(ml_dtypes.bfloat16))


def test_restore_into_sharded_abstract_tree(saved):
    params, path = saved
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), abstract_params(CFG)
    )
    got = restore_params(path, abstract)
    assert got["layers"][1]["wq"].sharding == sharding
    _assert_same(got, params)


def _restore(path, abstract):
    """An orbax checkpoint as the engine ingests it: its metadata checked by the plan
    (`weights/plan.py`) before `restore_params` reads a byte."""
    return place.fetched(plan.plan(readers.read(path, CFG), CFG, abstract))


def test_restore_wrong_shape_names_the_leaf(saved):
    _, path = saved
    abstract = abstract_params(CFG)
    abstract["layers"][1]["w_up"] = jax.ShapeDtypeStruct((32, 99), np.float32)
    with pytest.raises(
        WeightsMismatch, match=r"layers\.1\.w_up: expected \(32, 99\) float32, got \(32, 48\)"
    ):
        _restore(path, abstract)


def test_restore_wrong_structure(saved):
    _, path = saved
    other = ModelConfig(**{**CFG.__dict__, "num_layers": 3})
    with pytest.raises(WeightsMismatch, match=r"missing tensor\(s\): layers\.2\."):
        _restore(path, abstract_params(other))
    no_qk = ModelConfig(**{**CFG.__dict__, "qk_norm": False})
    with pytest.raises(WeightsMismatch, match="unexpected.*k_norm"):
        _restore(path, abstract_params(no_qk))


def test_restore_non_float_cast_refused(saved):
    _, path = saved
    abstract = abstract_params(CFG)
    abstract["final_norm"] = jax.ShapeDtypeStruct((CFG.hidden_size,), np.int32)
    with pytest.raises(WeightsMismatch, match="final_norm: expected .* int32, got .* float32"):
        _restore(path, abstract)


def test_restore_missing_or_not_orbax(tmp_path):
    with pytest.raises(CheckpointError, match="no orbax checkpoint"):
        restore_params(tmp_path / "nope")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\0" * 8)
    with pytest.raises(CheckpointError, match="_METADATA"):
        restore_params(tmp_path / "hf")


def test_restore_corrupt(tmp_path):
    path = save_params({"embed": np.ones((4, 4), np.float32), "layers": []}, tmp_path / "c")
    for f in path.rglob("*"):
        if f.is_file() and f.parent.name == "d":  # the ocdbt data files
            f.write_bytes(b"garbage")
    with pytest.raises(CheckpointError):
        restore_params(path)


def test_save_refuses_to_overwrite(saved, tmp_path):
    params, _ = saved
    path = save_params(params, tmp_path / "x")
    with pytest.raises(CheckpointError, match="already exists"):
        save_params(params, path)
    params2 = _params(seed=7)
    save_params(params2, path, overwrite=True)
    _assert_same(restore_params(path, abstract_params(CFG)), params2)


# --------------------------------------------------------------------------- allowed root


def test_resolve_inside_root(tmp_path):
    root = tmp_path / "weights"
    (root / "m").mkdir(parents=True)
    assert resolve_weights_path(root / "m", root) == (root / "m").resolve()
    assert resolve_weights_path("m", root) == (root / "m").resolve()  # relative = under the root
    assert resolve_weights_path(root / "m" / ".." / "m", root) == (root / "m").resolve()
    assert resolve_weights_path(root / "new_ckpt", root) == (root / "new_ckpt").resolve()  # need not exist


def test_resolve_rejects_dotdot(tmp_path):
    root = tmp_path / "weights"
    root.mkdir()
    with pytest.raises(WeightsPathNotAllowed, match="outside the allowed root"):
        resolve_weights_path(root / ".." / "etc", root)
    with pytest.raises(WeightsPathNotAllowed):
        resolve_weights_path("../etc", root)
    with pytest.raises(WeightsPathNotAllowed):
        resolve_weights_path("/etc/passwd", root)
    # A sibling whose name merely starts with the root's name is outside too.
    with pytest.raises(WeightsPathNotAllowed):
        resolve_weights_path(tmp_path / "weights_evil", root)


def test_resolve_rejects_symlink_outside(tmp_path):
    root, outside = tmp_path / "weights", tmp_path / "secret"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(WeightsPathNotAllowed):
        resolve_weights_path(root / "link", root)
    with pytest.raises(WeightsPathNotAllowed):
        resolve_weights_path("link/model.safetensors", root)


def test_resolve_symlinked_root(tmp_path):
    # The root itself may be a symlink (e.g. /weights -> /mnt/disk); paths are judged after resolving both.
    real = tmp_path / "real"
    (real / "m").mkdir(parents=True)
    (tmp_path / "root_link").symlink_to(real)
    assert resolve_weights_path(tmp_path / "root_link" / "m", tmp_path / "root_link") == real / "m"


def test_resolve_no_root_allows_anything(tmp_path):
    assert resolve_weights_path(tmp_path / "a" / ".." / "b", None) == (tmp_path / "b").resolve()

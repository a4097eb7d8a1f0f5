"""The C++ convert-and-check kernel of a CPU checkpoint update (`kernels/cpu_convert.py`) against
numpy, and where the update path takes it (about 3 s)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import hf_to_device

from hotswap.checkpoint import hf
from hotswap.checkpoint.create import create_checkpoint
from hotswap.kernels import cpu_build, cpu_convert
from hotswap.model.config import ModelConfig
from hotswap.model.params import abstract_params
from hotswap.weights import hf_device

convert = jax.jit(cpu_convert.convert, static_argnums=(1, 2))
# Ragged against the 16 x 16 register transpose and the 16-row work items, and whole ones.
SHAPES = [(1, 1), (3, 5), (16, 16), (17, 33), (65, 130), (128, 64), (100, 7)]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_transposes_or_copies_exactly(dtype, shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    r, c = shape
    y, ok = convert(jnp.asarray(x), (c, r), True)
    assert bool(ok) and y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y), x.T)
    y, ok = convert(jnp.asarray(x), (r * c,), False)
    assert bool(ok)
    np.testing.assert_array_equal(np.asarray(y), x.reshape(-1))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_flags_a_bad_value_anywhere(dtype, bad):
    """In a register tile, on a ragged edge, in the last copy piece's tail."""
    x = np.random.default_rng(1).standard_normal((65, 130)).astype(dtype)
    for at in [(0, 0), (40, 20), (64, 3), (7, 129), (64, 129)]:
        z = x.copy()
        z[at] = bad
        assert not bool(convert(jnp.asarray(z), (130, 65), True)[1]), at
        assert not bool(convert(jnp.asarray(z), z.shape, False)[1]), at
    big = np.ones((1 << 18) + 21, dtype)  # past one 1 MB copy piece
    big[-1] = bad
    assert not bool(convert(jnp.asarray(big), big.shape, False)[1])


def test_output_is_a_fresh_buffer():
    x = jnp.ones((32, 48), jnp.float32)
    y, _ = convert(x, x.shape, False)
    assert y.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()


@pytest.mark.parametrize("transpose", [True, False])
def test_widens_bf16_to_f32_exactly_and_matches_the_jnp_twin(transpose):
    x = np.random.default_rng(3).standard_normal((33, 48)).astype(ml_dtypes.bfloat16)
    x[5, 7] = np.inf
    shape = (48, 33) if transpose else (33, 48)
    got = jax.jit(cpu_convert.convert, static_argnums=(1, 2, 3))(jnp.asarray(x), shape, transpose, np.float32)
    want = jax.jit(cpu_convert.convert_jnp, static_argnums=(1, 2, 3))(
        jnp.asarray(x), shape, transpose, np.float32
    )
    assert got[0].dtype == np.float32 and not bool(got[1]) and not bool(want[1])
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_refuses_what_it_cannot_take():
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    f32, bf16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)
    assert cpu_convert.usable(f32, f32, dev) and cpu_convert.usable(bf16, bf16, dev)
    assert cpu_convert.usable(bf16, f32, dev)  # exact
    assert not cpu_convert.usable(f32, bf16, dev)  # a rounding cast: XLA converts, and checks what it made
    assert not cpu_convert.usable(np.dtype(np.int32), np.dtype(np.int32), dev)
    target = cpu_build.register("convert_finite", "HotswapConvertFinite")
    call = jax.ffi.ffi_call(
        target, (jax.ShapeDtypeStruct((3,), jnp.int32), jax.ShapeDtypeStruct((), jnp.uint8))
    )
    with pytest.raises(Exception, match="f32 or bf16 into the same dtype"):
        jax.block_until_ready(jax.jit(lambda x: call(x, transpose=np.int64(0)))(jnp.ones((3,), jnp.int32)))


@pytest.mark.parametrize(
    ("source", "engine", "fused"),
    [("float32", "float32", True), ("bfloat16", "float32", True), ("float32", "bfloat16", False)],
)
def test_the_update_path_takes_the_kernel_for_an_exact_cast(tmp_path, source, engine, fused):
    d = create_checkpoint(tmp_path / "ck", seed=2, overrides={"tie_word_embeddings": True})
    cfg = ModelConfig.from_dir(d)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev), abstract_params(cfg, engine)
    )
    tensors = {k: v.astype(hf.np_dtype(source)) for k, v in hf.read_hf_tensors(d).items()}
    x = jax.device_put(tensors[hf.EMBED])
    assert hf_device._fused(x, np.dtype(abstract["embed"].dtype), dev) == fused
    got = hf_to_device(cfg, tensors, abstract)
    want = hf.params_from_hf(cfg, tensors, dtype=engine)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)

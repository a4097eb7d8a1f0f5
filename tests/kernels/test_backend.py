"""The Backend choice (kernels/backend.py), the Pallas kernel under tensor parallelism, and the
engine's decode step compiled for real TPUs on this CPU host (programs/catalog.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import SUPPORT, soak

from hotswap.engine_config import EngineConfig
from hotswap.errors import ConfigError
from hotswap.kernels.backend import Backend
from hotswap.model.config import ModelConfig
from hotswap.programs import catalog, tpu_slice
from hotswap.programs.step import Buckets


@pytest.fixture(scope="module")
def v5e():
    """The 4 chips of a v5e:2x2 slice, for libtpu's compiler (no TPU attached)."""
    return tpu_slice.topology_devices("v5e:2x2")


def test_auto_is_pallas_on_tpu_devices_and_the_cpp_kernels_on_one_cpu_device(v5e):
    tpu = Backend.choose("auto", head_dim=64, devices=v5e[:1])
    assert (tpu.attention, tpu.platform, tpu.interpret, tpu.folded_pages) == ("pallas", "tpu", False, True)
    mesh = jax.make_mesh((4,), ("tp",), (jax.sharding.AxisType.Auto,), devices=v5e)
    sharded = Backend.choose("auto", head_dim=128, mesh=mesh, head_axis="tp")
    assert sharded.attention == "pallas" and sharded.mesh is mesh  # its kernel runs in shard_map
    cpu = Backend.choose("auto", head_dim=64)
    assert (cpu.attention, cpu.platform, cpu.folded_pages) == ("cpu", "cpu", False)
    assert Backend.choose("auto", head_dim=64, devices=jax.devices()[:1] * 2).attention == "reference"
    # A TPU model whose (K, V) pairs do not fill whole 128-lane groups: the reference, saying why.
    assert Backend.choose("auto", head_dim=48, devices=v5e[:1]).attention == "reference"
    assert "head_dim 48" in Backend.choose("auto", head_dim=48, devices=v5e[:1]).reason
    assert Backend.choose("pallas", head_dim=16).interpret  # off TPU: interpreted


def test_an_explicit_choice_that_cannot_run_says_why(v5e):
    with pytest.raises(ConfigError, match="CPU backend with the KV cache on one device"):
        Backend.choose("cpu", head_dim=64, devices=v5e[:1])
    with pytest.raises(ConfigError, match="head_dim 96 is not a multiple of 64"):
        Backend.choose("pallas", head_dim=96, devices=v5e[:1])
    with pytest.raises(ConfigError, match="use 'auto' or one of"):
        Backend.choose("triton", head_dim=64)


def test_the_backend_runs_the_row_chosen_once_and_is_a_static_value():
    """Each kind is one row of `KERNELS` (`FIXED` in deterministic mode); a Backend holds its row,
    and Backends of equal choices are equal and hash alike (a jit static argument)."""
    from hotswap.kernels import backend as b

    cpu = Backend.choose("cpu", head_dim=64)
    assert cpu.kernels is b.KERNELS["cpu"] and cpu.reason
    assert cpu == Backend("cpu", "cpu") and hash(cpu) == hash(Backend("cpu", "cpu"))  # reason aside
    fixed = Backend("cpu", "cpu", deterministic=True)
    assert fixed.kernels is b.FIXED["cpu"] and fixed != cpu
    # `Backend.matmuls` is the row's dense routine behind the quantized-weight dispatch (quant_matmul)
    assert (fixed.kernels.matmuls, fixed.mean_square) == (
        b.cpu_matmul.fixed_matmuls,
        b.cpu_sampling.row_mean_square,
    )
    ref = Backend("reference", "cpu")
    assert (ref.read_then_write, ref.flat_pages, ref.ragged_steps, ref.kernels.matmuls) == (
        True,
        True,
        False,
        b.jnp_matmuls,
    )
    assert Backend("pallas", "cpu").page_shape(4, 16, 2, 64) == (4, 16, 256)
    assert ref.page_shape(4, 16, 2, 64) == (4, 16, 4, 64)
    assert b.ATTENTIONS == tuple(b.KERNELS) and set(b.FIXED) <= set(b.KERNELS)
    with pytest.raises(ConfigError, match="no batch-invariant kernels"):
        Backend("reference", "cpu", deterministic=True)


def _model(head_dim: int) -> ModelConfig:
    return ModelConfig(
        arch="llama",
        vocab_size=1024,
        hidden_size=8 * head_dim,
        intermediate_size=1024,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=head_dim,
        dtype="bfloat16",
    )


@pytest.mark.slow
@pytest.mark.parametrize("tp, head_dim", [(1, 64), (4, 128)])  # each knob once: both kernel layouts
def test_decode_step_compiles_for_v5e_and_updates_the_cache_in_place(v5e, head_dim, tp):
    """The runner's own decode step, lowered with abstract params and pages on a v5e mesh and
    compiled by libtpu: one Mosaic call per layer, no copy of a page buffer, and the cache
    aliased to the output. (A 16,384-page cache: XLA keeps a toy-sized one in VMEM.)"""
    ecfg = EngineConfig(page_size=16, num_pages=16384, max_model_len=1024, max_num_seqs=64)
    mcfg = _model(head_dim)
    target = catalog.Target.first_chips(mcfg, "auto", v5e, tp)
    assert target.backend.attention == "pallas"
    buckets = Buckets.for_config(ecfg, target.backend)
    page = catalog.abstract_inputs(mcfg, ecfg, target)[1][0]
    ((name, lower),) = catalog.step_programs(mcfg, ecfg, target, [(64, 1, buckets.pages[-1])])
    step = catalog.compile_stats(name, lower, [page])
    kv = mcfg.num_layers * int(np.prod(page.sharding.shard_shape(page.shape))) * page.dtype.itemsize
    assert kv == 2 * 16384 * 16 * 2 * 4 * head_dim * 2 // tp
    assert step.pallas_calls == 2 and step.kv_copies == 0, step
    assert step.temp_bytes < 0.05 * kv, step
    assert step.alias_bytes >= kv, step


@pytest.fixture(scope="module")
def tp_result(tmp_path_factory):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / "pallas_tp_worker.py"), str(tmp_path_factory.mktemp("pallas_tp"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@soak  # interpreted Pallas on 8 fake devices at TP 1/2/4/8: 3-5 minutes on 2 cores
def test_pallas_under_tensor_parallelism_matches_one_device(tp_result):
    """attention="pallas" at TP 2/4/8 (each device its kv heads, in shard_map): the same greedy
    tokens as TP 1 and log-probs within 1e-4, over chunked prefill and prefix-cache hits."""
    assert tp_result["devices"] == 8
    base = tp_result["tp"]["1"]
    assert base["rounds"][1][0]["cached"] >= 24 and base["rounds"][1][1]["cached"] >= 16  # prefix hits
    for tp in ("1", "2", "4", "8"):
        got = tp_result["tp"][tp]
        assert got["attention"] == "pallas"
        if tp != "1":
            assert got["kv_spec"] == [None, None, "tp"]
            assert got["kv_shard_shape"][2] == 2 * 8 * 16 // int(tp)  # whole (K, V) pairs of 8/tp heads
        for r_got, r_base in zip(got["rounds"], base["rounds"], strict=True):
            for g, b in zip(r_got, r_base, strict=True):
                assert g["ids"] == b["ids"] and g["cached"] == b["cached"]
                np.testing.assert_allclose(g["lps"], b["lps"], atol=1e-4, rtol=0)

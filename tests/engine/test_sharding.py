"""Tensor parallelism on an 8-device fake CPU mesh (checks run in `sharding_worker.py`, a subprocess).

The subprocess is needed because the fake device count must be set before jax
starts and the rest of the suite runs single-device in this process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import SUPPORT, WORKER_PYTHONPATH

from hotswap.checkpoint.create import load_preset
from hotswap.model import sharding, spec
from hotswap.model.config import ModelConfig


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        # the worker imports tests/support/helpers.py, and this checkout's hotswap (not an installed one)
        "PYTHONPATH": WORKER_PYTHONPATH,
    }
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / "sharding_worker.py"), str(tmp_path_factory.mktemp("sharded"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _same(a: list[dict], b: list[dict], atol: float = 1e-4) -> None:
    assert [o["ids"] for o in a] == [o["ids"] for o in b]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x["lps"], y["lps"], atol=atol)


@pytest.mark.slow
def test_tensor_parallel_matches_single_device(result):
    assert result["devices"] == 8
    base = result["tp"]["1"]["out"]
    assert len({tuple(o["ids"]) for o in base}) == 3  # three different continuations
    for tp in ("2", "4", "8"):
        _same(result["tp"][tp]["out"], base)
    assert result["recompiles_second_generate"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_params_and_kv_are_sharded(result, tp):
    sh = result["tp"][str(tp)]["shardings"]
    kv = sh["kv"]  # [num_pages, page_size, 2*kv_heads=16, head_dim]
    assert kv["spec"] == [None, None, "tp", None]
    assert kv["devices"] == kv["distinct"] == tp
    assert kv["shard_shape"][2] == 16 // tp  # whole (K, V) pairs of 8/tp heads per device
    p = sh["params"]
    # attention is head-split ([D, Hq, hd], o [Hq, hd, D]): whole heads per device
    assert p["wq"]["spec"] == [None, "tp", None]
    assert p["wq"]["shard_shape"] == [128, 8 // tp, 16] and p["wq"]["distinct"] == tp
    assert p["wk"]["shard_shape"] == [128, 8 // tp, 16]
    assert p["wo"]["shard_shape"] == [8 // tp, 16, 128]
    assert p["w_down"]["shard_shape"] == [256 // tp, 128]
    assert p["lm_head"]["shard_shape"] == [128, 512 // tp]
    assert p["embed"]["shard_shape"] == [512 // tp, 128]  # vocab rows: see sharding.RULES
    assert p["attn_norm"]["distinct"] == 1  # replicated
    assert p["attn_norm"]["devices"] == tp


@pytest.mark.slow
def test_bad_tensor_parallel_size_names_both_head_counts(result):
    msg = result["tp3_error"]
    assert (
        "tensor_parallel_size=3" in msg and "num_attention_heads=8" in msg and "num_key_value_heads=8" in msg
    )


@pytest.mark.slow
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_kv_stays_local_in_compiled_step(result, step):
    """GSPMD keeps attention on the device holding the heads: no collective on a KV-sized array.

    The forward's only all-gathers are the sampler's, on logit-sized [B, V] rows or
    per-shard [B, tp] partials; its all-reduces are the Megatron ones on [B, C, D]
    (one per attention and MLP block, one for the vocab-sharded embedding lookup).
    The separate donated KV write has no collective at all and stays in place.
    """
    col = result["collectives"]
    for key in col[f"{step}/forward"]:
        op, shape = key.split(" ", 1)
        dims = [int(d) for d in re.match(r"\w+\[([\d,]*)\]", shape).group(1).split(",") if d]
        assert len(dims) <= 3, key
        if op == "all-gather":
            assert len(dims) == 2 and dims[1] in (512, 8), key
    c = 1 if step == "decode" else 16
    b = 4 if step == "decode" else 2  # the worker's packed prefill has two rows of 16
    assert col[f"{step}/forward"][f"all-reduce f32[{b},{c},128]{{2,1,0}}"] == 2 * 2 + 1
    assert col[f"{step}/write"] == {}
    assert col[f"{step}/write_in_place"]
    assert col[f"{step}/new_kv_sharding"] == [None, None, "tp", None]  # [B, C, kv_heads, hd] by head


@pytest.mark.slow
def test_update_from_fsdp_trainer_params(result):
    upd = result["update"]
    assert upd["versions"] == [2, 3]
    assert upd["recompiles"] == 0  # reshard + swap + generate, after one warm-up update
    _same(upd["out"], result["fresh_b"], atol=1e-5)


@pytest.mark.slow
def test_same_sharding_update_is_zero_copy(result):
    assert result["same_sharding_version"] == 4
    assert result["same_sharding_identity"] and result["same_sharding_buffers"]
    _same(result["after_same_sharding"], result["tp"]["8"]["out"], atol=1e-5)


def test_rules_table_is_the_only_mesh_naming():
    """Every logical axis used resolves through RULES to the one mesh axis or to replication."""
    used = set(sharding.KV_AXES)
    for arch in ("llama", "qwen2", "qwen3"):  # qwen2 adds the q/k/v biases, qwen3 the q/k norms
        cfg = ModelConfig.from_hf({**load_preset("tiny"), "model_type": arch})
        used |= {a for row in spec.hf_specs(cfg).values() for a in row.axes}
    assert used <= set(sharding.RULES)
    assert set(sharding.RULES.values()) <= {sharding.TP, None}

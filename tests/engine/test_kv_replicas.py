"""More tensor-parallel devices than kv heads: each kv head replicated over tp / kv heads devices
(`sharding.kv_replicas`), on an 8-device fake CPU mesh (checks run in `kv_replica_worker.py`, a
subprocess: the device count is fixed when jax starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import SUPPORT, WORKER_PYTHONPATH, soak

from hotswap.checkpoint.create import load_preset
from hotswap.errors import ConfigError
from hotswap.kernels.backend import Backend
from hotswap.model import sharding
from hotswap.model.config import ModelConfig
from hotswap.programs import kv_sizing


def _run(tmp: Path, attention: str, sizes: str, arch: str = "llama") -> dict:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": WORKER_PYTHONPATH,
    }
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / "kv_replica_worker.py"), str(tmp), attention, sizes, arch],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _matches_one_device(result: dict, sizes: list[int]) -> None:
    """Each TP size: the same greedy tokens as TP 1 and log-probs within 1e-4 (a chunked prefill and
    prefix-cache hits included); each device one kv head's (K, V) pair; wk replicated."""
    assert result["devices"] == 8
    base = result["tp"]["1"]
    assert base["kv_replicas"] == 1
    for tp in sizes:
        got = result["tp"][str(tp)]
        assert got["kv_replicas"] == tp // 2
        for want_round, got_round in zip(base["rounds"], got["rounds"], strict=True):
            assert [o["ids"] for o in got_round] == [o["ids"] for o in want_round]
            for o, w in zip(got_round, want_round, strict=True):
                np.testing.assert_allclose(o["lps"], w["lps"], atol=1e-4)
                assert o["cached"] == w["cached"]
        assert got["rounds"][1][1]["cached"] == 24  # the second round hit the first's pages
        kv = got["kv"]  # [pages, ps, 2 * tp cached heads (*16 lanes folded)]: one pair a device
        assert kv["devices"] == kv["distinct"] == tp
        lanes_or_pairs = kv["shard_shape"][2:]
        assert lanes_or_pairs in ([2, 16], [32]), kv
        assert got["wk"]["distinct"] == 1 and got["wk"]["shard_shape"] == [128, 2, 16]  # replicated
        assert got["wq"]["distinct"] == tp and got["wq"]["shard_shape"] == [128, 8 // tp, 16]


@pytest.mark.slow
def test_replicated_kv_heads_match_one_device(tmp_path):
    """TP 8 over 2 kv heads (4 devices a head), through the jnp reference a CPU mesh runs."""
    result = _run(tmp_path, "auto", "8")
    assert result["tp"]["8"]["attention"] == "reference"
    _matches_one_device(result, [8])


@soak  # Gemma 2's layer code (windows shorter than the prompt, both softcaps): the same check
def test_replicated_kv_heads_match_one_device_on_gemma2(tmp_path):
    _matches_one_device(_run(tmp_path, "auto", "8", "gemma2"), [8])


@soak  # interpreted Pallas in shard_map on 8 fake devices: minutes on 2 cores
def test_replicated_kv_heads_match_one_device_with_pallas(tmp_path):
    result = _run(tmp_path, "pallas", "4,8")
    assert result["tp"]["4"]["attention"] == "pallas"
    _matches_one_device(result, [4, 8])


def test_kv_replicas_and_per_chip_sizes():
    """qwen3-30b-a3b (32 q heads, 4 kv heads) at TP 8: two devices per kv head, one head's
    pages a chip; TP 3 divides neither head count and is refused naming both."""
    cfg = ModelConfig.from_hf(load_preset("qwen3-30b-a3b"))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 4, 128)
    assert [sharding.kv_replicas(cfg, tp) for tp in (1, 2, 4, 8)] == [1, 1, 1, 2]
    # 48 layers x 16 tokens x (K, V) x 128 dims x 2 bytes: one kv head a chip at TP 4 and TP 8
    one_head = 48 * 16 * 2 * 128 * 2
    assert kv_sizing.page_bytes(cfg, 16, 4) == kv_sizing.page_bytes(cfg, 16, 8) == one_head
    assert kv_sizing.page_bytes(cfg, 16, 2) == 2 * one_head
    with pytest.raises(ConfigError, match="num_attention_heads=32.*num_key_value_heads=4"):
        sharding.kv_replicas(cfg, 3)
    be = Backend(attention="pallas", platform="tpu", kv_replicas=2)
    assert be.page_shape(10, 16, 4, 128) == (10, 16, 2 * 8 * 128)

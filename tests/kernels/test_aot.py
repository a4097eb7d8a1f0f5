"""`hotswap aot`: TPU programs compiled on this CPU (libtpu, the [aot] extra), and the KV sizing.

A full bucket set of an 8B model is many minutes of compiling, so the three real models
compile their largest decode step (`buckets="decode"`; the cache is sized from its
temporaries) and the update's programs; the tiny model compiles every bucket, prefills
included. Each real step is a 16-36-layer program: 25-75 s on a 2-core machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from helpers import soak

from hotswap import cli
from hotswap.checkpoint.create import load_preset
from hotswap.errors import ConfigError, DeviceMemoryError
from hotswap.model.config import ModelConfig
from hotswap.programs import kv_sizing, tpu_slice

GIB = 2**30


def _decode(report: dict) -> dict:
    (step,) = [s for s in report["steps"] if s["name"].startswith("decode")]
    return step


def _check_in_place_pallas_decode(report: dict, num_layers: int) -> None:
    """The decode step: one Pallas call per layer, the cache updated in place, no copy of a
    layer's page buffer (into VMEM or anywhere: `kv_copies`, from the HLO) and temporaries under
    5% of the cache."""
    step, kv = _decode(report), report["kv_cache_bytes_per_chip"]
    assert report["fits"], report
    assert step["pallas_calls"] == num_layers, step
    assert step["kv_copies"] == 0, step
    assert step["alias_bytes"] >= kv, (step, kv)
    assert step["temp_bytes"] < 0.05 * kv, (step["temp_bytes"] / kv, step)


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize(
    "name, want",
    [
        ("llama-3-8b", dict(num_layers=32, vocab_size=128256, num_kv_heads=8, head_dim=128, tie=False)),
        ("llama-3.2-1b", dict(num_layers=16, vocab_size=128256, num_kv_heads=8, head_dim=64, tie=True)),
        ("qwen2.5-7b", dict(num_layers=28, vocab_size=152064, num_kv_heads=4, head_dim=128, tie=False)),
        ("qwen3-8b", dict(num_layers=36, vocab_size=151936, num_kv_heads=8, head_dim=128, tie=False)),
    ],
)
def test_presets_have_the_published_shapes(name, want):
    cfg = ModelConfig.from_hf(load_preset(name))
    assert cfg.dtype == "bfloat16"
    assert (cfg.num_layers, cfg.vocab_size, cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings) == (
        want["num_layers"],
        want["vocab_size"],
        want["num_kv_heads"],
        want["head_dim"],
        want["tie"],
    )
    assert cfg.qkv_bias == (name == "qwen2.5-7b") and cfg.qk_norm == (name == "qwen3-8b")
    assert (cfg.rope_scaling is not None) == (name == "llama-3.2-1b")
    if name == "llama-3.2-1b":
        assert cfg.rope_scaling.factor == 32.0 and cfg.rope_scaling.original_max_position_embeddings == 8192


def test_a_directory_with_only_config_json_is_a_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(load_preset("qwen2.5-7b")))
    assert tpu_slice.load_model_config(str(tmp_path), "bfloat16") == tpu_slice.load_model_config(
        "qwen2.5-7b", "bfloat16"
    )


def _qwen3_30b_a3b_as_transformers_5_saves(**changes) -> dict:
    """Qwen3-30B-A3B's config.json as transformers 5.25 saves it (`save_pretrained`): the expert
    count as `num_local_experts`, rope under `rope_parameters`, `dtype` (the preset has 4.x's names)."""
    preset = load_preset("qwen3-30b-a3b")
    old = ("num_experts", "rope_theta", "rope_scaling", "torch_dtype")
    return {
        **{k: v for k, v in preset.items() if k not in old},
        "num_local_experts": preset["num_experts"],
        "rope_parameters": {"rope_theta": preset["rope_theta"], "rope_type": "default"},
        "dtype": preset["torch_dtype"],
        "transformers_version": "5.25.0",
        **changes,
    }


def test_aot_reads_the_moe_config_transformers_5_saves(tmp_path, capsys):
    """The same model as the preset; `hotswap aot DIR` sizes its 128 experts' 56.87 GiB of params."""
    (tmp_path / "config.json").write_text(json.dumps(_qwen3_30b_a3b_as_transformers_5_saves()))
    assert tpu_slice.load_model_config(str(tmp_path), "bfloat16") == tpu_slice.load_model_config(
        "qwen3-30b-a3b", "bfloat16"
    )
    assert cli.main(["aot", str(tmp_path), "--topology", "v5e:1x1"]) == 2
    err = capsys.readouterr().err
    assert "no room for the KV cache" in err and "params 56.87 GiB" in err, err


# --------------------------------------------------------------------------- KV sizing


class FakeDevice(SimpleNamespace):
    def memory_stats(self):
        return self.stats


def _pages(devices, *, num_pages=None, params=GIB, temps=0, seen=None, preset="llama-3-8b", disable=False):
    cfg = ModelConfig.from_hf(load_preset(preset), dtype="bfloat16")

    def temps_at(n):
        if seen is not None:
            seen.append(n)
        return temps

    return kv_sizing.engine_pages(
        cfg,
        page_size=16,
        max_model_len=2048,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        disable_hybrid_kv_cache_manager=disable,
        num_pages=num_pages,
        gpu_memory_utilization=0.9,
        devices=devices,
        weights=kv_sizing.Weights(params, params, "copy"),  # a staged copy beside the params
        temps_at=temps_at,
    )


def test_kv_sizing_from_memory_stats():
    cfg = ModelConfig.from_hf(load_preset("llama-3-8b"))
    # bf16, 32 layers, 16 tokens, 2 x 8 kv heads / tp, 128 dims: 2 MiB a page on one chip.
    assert kv_sizing.page_bytes(cfg, 16) == 2 * 2**20 and kv_sizing.page_bytes(cfg, 16, 8) == 2**18
    chip = lambda used: FakeDevice(platform="tpu", stats={"bytes_limit": 16 * GIB, "bytes_in_use": used})  # noqa: E731
    seen = []
    # (16 GiB x 0.9 - 2 GiB of weights (1 GiB params and an update's staged copy) - 0.5 GiB temps)
    # / 2 MiB; the temps measured at the pool that fits without them.
    assert _pages([chip(0)], temps=GIB // 2, seen=seen) == int(16 * GIB * 0.9 - 2.5 * GIB) // (2 * 2**20)
    assert seen == [int(16 * GIB * 0.9 - 2 * GIB) // (2 * 2**20)]
    # Sharded over two chips: half the heads per page; the fuller chip decides.
    two = [chip(0), chip(4 * GIB)]
    assert _pages(two) == (int(12 * GIB * 0.9) - 2 * GIB) // 2**20
    # An explicit num_pages wins; CPU (no memory stats) keeps its rule.
    assert _pages([chip(0)], num_pages=77) == 77
    cpu = FakeDevice(platform="cpu", stats=None)
    assert _pages([cpu]) == kv_sizing.cpu_pages(2048, 16, 32) == 128 * 32 // 2 + 1
    with pytest.raises(DeviceMemoryError, match="no room for the KV cache"):
        _pages([chip(0)], params=15 * GIB)


def test_kv_sizing_takes_the_window_pool_off_the_budget_first():
    """Gemma 3 12B (40 of 48 layers sliding, window 1,024): the sliding layers get the pages 32
    sequences' windows and a step's chunks can need; the full layers take what is left."""
    cfg = ModelConfig.from_hf(load_preset("gemma-3-12b"), dtype="bfloat16")
    assert kv_sizing.window_layers(cfg) == 40
    window = kv_sizing.window_bound(cfg, 16, 32, 256)
    assert window == 32 * (1024 // 16 + 2) + 256 // 16 + 1
    assert kv_sizing.window_bound(cfg, 16, 32, 256, disable=True) is None
    one = kv_sizing.page_bytes(cfg, 16)
    full, local = kv_sizing.page_bytes(cfg, 16, layers=8), kv_sizing.page_bytes(cfg, 16, layers=40)
    assert full + local == one
    chip = FakeDevice(platform="tpu", stats={"bytes_limit": 80 * GIB, "bytes_in_use": 0})
    budget = int(80 * GIB * 0.9) - 2 * GIB
    pages = _pages([chip], preset="gemma-3-12b")
    assert pages == (budget - window * local) // full
    assert kv_sizing.pool_bytes(cfg, pages, window, 16) <= budget
    # Without the bound every layer takes every page: about 5x fewer tokens fit.
    assert _pages([chip], preset="gemma-3-12b", disable=True) == budget // one < pages / 4
    # Memory for fewer pages than the window pool would hold: no window pool (a twin per page).
    small = FakeDevice(platform="tpu", stats={"bytes_limit": 4 * GIB, "bytes_in_use": 0})
    assert _pages([small], preset="gemma-3-12b") == (int(4 * GIB * 0.9) - 2 * GIB) // one <= window


def test_engine_config_checks_gpu_memory_utilization():
    from hotswap.engine_config import EngineConfig
    from hotswap.errors import ConfigError

    assert EngineConfig().gpu_memory_utilization == 0.9
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


# --------------------------------------------------------------------------- serve flags


def test_serve_passes_tensor_parallel_size_and_memory_fraction(tmp_path, monkeypatch, capsys):
    from hotswap.engine import llm
    from hotswap.errors import HotswapError

    got = {}

    class Stop(HotswapError):
        pass

    def fake_llm(model, **kwargs):
        got.update(kwargs)
        raise Stop("stop before serving")

    monkeypatch.setattr(llm, "LLM", fake_llm)
    argv = ["serve", str(tmp_path), "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5"]
    assert cli.main(argv) == 2
    assert got["tensor_parallel_size"] == 2 and got["gpu_memory_utilization"] == 0.5
    assert "stop before serving" in capsys.readouterr().err


# --------------------------------------------------------------------------- errors


def test_bad_topology_fails_naming_it(capsys):
    assert cli.main(["aot", "tiny", "--topology", "v9x:2x2"]) == 2
    assert "unknown TPU topology 'v9x:2x2'" in capsys.readouterr().err
    assert cli.main(["aot", "tiny", "--topology", "v5e:3x7"]) == 2
    assert "bad TPU topology 'v5e:3x7'" in capsys.readouterr().err


def test_params_over_hbm_fail_before_compiling(capsys):
    """Llama-3-8B's 16 GB of bf16 params on one 16 GiB v5e chip: no room for a cache."""
    assert cli.main(["aot", "llama-3-8b", "--topology", "v5e:1x1"]) == 2
    err = capsys.readouterr().err
    assert "no room for the KV cache" in err and "params 14.96 GiB" in err
    assert "weight_update_staging 'in_place'" in err and "or weight_update_staging" not in err


def test_a_compile_error_names_the_program(capsys):
    """A pool far past the chip's HBM: XLA refuses the first step, and the error names it."""
    argv = ["aot", "tiny", "--topology", "v5e:1x1", "--num-pages", str(16 * 2**20), "--max-num-seqs", "2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hotswap aot: error: decode B=1 P=8:") and "RESOURCE_EXHAUSTED" in err, err


# --------------------------------------------------------------------------- real compiles


def test_tiny_compiles_every_bucket_for_one_v5e_chip():
    # tiny's head_dim 16 does not fill the kernel's 128-lane (K, V) groups: "auto" is the jnp
    # reference there (Backend.choose says why), so each step has its KV write beside it.
    acfg = tpu_slice.AotConfig(
        topology="v5e:1x1", max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, num_pages=64
    )
    report = tpu_slice.compile_for("tiny", acfg)
    names = [s["name"] for s in report["steps"]]
    assert report["attention"] == "reference"
    assert names[:3] == ["decode B=1 P=8", "kv write B=1 C=1", "decode B=2 P=8"]
    assert any(n.startswith("kv init") for n in names) and any(n.startswith("update convert") for n in names)
    assert any(n.startswith("prefill rows=2") for n in names)
    assert report["chips"] == report["tensor_parallel_size"] == 1 and report["fits"]
    assert report["hbm_bytes_per_chip"] == 16 * GIB and report["est_decode_tok_s"] > 0
    assert all(s["pallas_calls"] == 0 for s in report["steps"])
    with pytest.raises(ConfigError, match="head_dim 16 is not a multiple of 64"):
        tpu_slice.compile_for("tiny", dataclasses.replace(acfg, attention="pallas"))


@pytest.mark.slow
def test_llama3_8b_on_v5e_8_at_tp8():
    acfg = tpu_slice.AotConfig(topology="v5e:2x4", tensor_parallel_size=8, max_num_seqs=64, buckets="decode")
    report = tpu_slice.compile_for("llama-3-8b", acfg)
    assert report["chips"] == 8 and report["params_bytes_per_chip"] < 2.1e9
    assert report["update_fits"]  # the pool leaves room for an update's staged params
    _check_in_place_pallas_decode(report, 32)


@soak  # a second 8B compile (v6e, qk-norm): the v5e one above checks the same properties
def test_qwen3_8b_on_v6e_4_at_tp4():
    acfg = tpu_slice.AotConfig(topology="v6e:2x2", tensor_parallel_size=4, max_num_seqs=64, buckets="decode")
    _check_in_place_pallas_decode(tpu_slice.compile_for("qwen3-8b", acfg), 36)


@pytest.mark.slow
def test_llama32_1b_on_one_chip_of_v5e_4_through_the_command(tmp_path):
    """The real `hotswap aot --json`, on the first chip of a 4-chip slice; head_dim 64."""
    argv = ["aot", "llama-3.2-1b", "--topology", "v5e:2x2", "--tensor-parallel-size", "1"]
    argv += ["--max-num-seqs", "64", "--buckets", "decode", "--json"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-m", "hotswap.cli", *argv], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["chips"] == 4 and report["tensor_parallel_size"] == 1
    _check_in_place_pallas_decode(report, 16)


# --------------------------------------------------------------------------- Gemma presets


@pytest.mark.parametrize(
    "name, want",
    [
        (
            "gemma-2-9b",
            dict(layers=42, heads=16, kv=8, hd=256, window=4096, every=2, scalar=256, vocab=256000),
        ),
        (
            "gemma-3-12b",
            dict(layers=48, heads=16, kv=8, hd=256, window=1024, every=6, scalar=256, vocab=262208),
        ),
        (
            "gemma-3-27b",
            dict(layers=62, heads=32, kv=16, hd=128, window=1024, every=6, scalar=168, vocab=262208),
        ),
    ],
)
def test_gemma_presets_have_the_published_shapes(name, want):
    cfg = ModelConfig.from_hf(load_preset(name))
    assert cfg.dtype == "bfloat16" and cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (
        want["layers"],
        want["heads"],
        want["kv"],
        want["hd"],
        want["vocab"],
    )
    assert cfg.sliding_window == want["window"] and cfg.query_pre_attn_scalar == want["scalar"]
    full = [i for i in range(cfg.num_layers) if cfg.layer_window(i) is None]
    assert full == list(range(want["every"] - 1, cfg.num_layers, want["every"]))  # HF's layer_types
    if name == "gemma-2-9b":
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
        assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    else:
        assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None and cfg.qk_norm
        assert (cfg.rope_theta, cfg.rope_local_base_freq) == (1e6, 1e4)
        assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 8.0


# Each Gemma preset on both slices, bf16 with Pallas (window and softcap in the kernel, head_dim
# 256 and 128): one Pallas call per layer, no copy of a page buffer, temporaries under 5% of the
# cache. One preset per slice in the suite (a 42-62-layer compile: 1-3 minutes on 2 cores), the
# other four with HOTSWAP_SOAK=1. gemma-3-27b on v5e:2x4 is the case whose small pool XLA copied
# into VMEM and back around the kernel before the pool was pinned to HBM, and whose temporaries
# (the sampler's [32, V/tp] f32 rows at a 262k vocabulary, about 75 MB whatever the pool) were
# over 5% of the 1.2 GB of cache two copies of its params left; updated in place (the default on
# TPU, weights/place.py) it keeps one copy and about 5.4 GB of cache a chip.
GEMMA_AOT = [
    pytest.param("gemma-3-27b", "v5e:2x4", 8, 16384, 62, id="gemma-3-27b-v5e"),
    pytest.param("gemma-2-9b", "v6e:2x2", 4, 8192, 42, id="gemma-2-9b-v6e"),
    pytest.param("gemma-2-9b", "v5e:2x4", 8, 8192, 42, id="gemma-2-9b-v5e", marks=soak),
    pytest.param("gemma-3-12b", "v5e:2x4", 8, 32768, 48, id="gemma-3-12b-v5e", marks=soak),
    pytest.param("gemma-3-12b", "v6e:2x2", 4, 32768, 48, id="gemma-3-12b-v6e", marks=soak),
    pytest.param("gemma-3-27b", "v6e:2x2", 4, 16384, 62, id="gemma-3-27b-v6e", marks=soak),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, topology, tp, max_len, layers", GEMMA_AOT)
def test_gemma_presets_compile_with_pallas_in_place(name, topology, tp, max_len, layers):
    acfg = tpu_slice.AotConfig(
        topology=topology, tensor_parallel_size=tp, max_model_len=max_len, max_num_seqs=32, buckets="decode"
    )
    report = tpu_slice.compile_for(name, acfg)
    assert report["attention"] == "pallas" and report["dtype"] == "bfloat16"
    assert report["weight_update_staging"] == "in_place" and report["update_fits"], report
    _check_in_place_pallas_decode(report, layers)


def test_tiny_compiles_the_low_rank_path_for_v5e():
    """`--enable-lora --max-loras 4 --max-lora-rank 64`: the decode step compiles for TPU with the
    adapters' buffers as arguments, and the report counts their bytes (A [*in, 256] and B
    [256, *out] for 7 rows of 2 layers, f32, plus the column -> slot map)."""
    acfg = tpu_slice.AotConfig(
        topology="v5e:1x1",
        max_model_len=128,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        num_pages=64,
        buckets="decode",
        dtype="float32",
        enable_lora=True,
        max_loras=4,
        max_lora_rank=64,
    )
    report = tpu_slice.compile_for("tiny", acfg)
    ins_outs = (
        (64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64)
    )  # q, k, v, o, gate, up, down
    assert report["lora_bytes_per_chip"] == 2 * ins_outs * 256 * 4 + 256 * 4
    assert (report["max_loras"], report["max_lora_rank"]) == (4, 64)
    plain = tpu_slice.compile_for("tiny", dataclasses.replace(acfg, enable_lora=False))
    step = lambda r: next(s for s in r["steps"] if s["name"].startswith("decode"))  # noqa: E731
    grew = step(report)["argument_bytes"] - step(plain)["argument_bytes"]
    assert (
        0 <= grew - report["lora_bytes_per_chip"] < 1024
    )  # the buffers, and the TPU's padding of small ones
    assert "LoRA buffers (4 adapters x rank 64)" in tpu_slice.table(report)


# --------------------------------------------------------------------------- more chips than kv heads


def _moe_at_tp8(model: str, **kw) -> dict:
    acfg = tpu_slice.AotConfig(topology="v5e:2x4", tensor_parallel_size=8, buckets="decode", **kw)
    report = tpu_slice.compile_for(model, acfg)
    assert report["kv_replicas"] == 2 and report["attention"] == "pallas", report
    return report


def _check_moe_decode(report: dict, layers: int) -> None:
    """qwen3-30b-a3b's shapes (4 kv heads, 128 experts top-8) at TP 8: one kv head's pages a chip,
    one attention call a layer and the experts' three grouped matmuls as megablox calls (32
    rows x 8 pairs = 256 pairs), the cache updated in place and never copied."""
    step = _decode(report)
    one_head_page = layers * 16 * 2 * 128 * 2  # tokens x (K, V) x head_dim x bf16
    assert report["kv_cache_bytes_per_chip"] == report["num_pages"] * one_head_page
    assert step["pallas_calls"] == layers * (1 + 3), step
    assert step["kv_copies"] == 0 and step["alias_bytes"] >= report["kv_cache_bytes_per_chip"], step
    assert report["fits"], report


@pytest.mark.slow
def test_moe_with_fewer_kv_heads_than_chips_compiles_for_v5e_8(tmp_path):
    """qwen3-30b-a3b cut to 2 layers (as transformers 5 saves it): each of its 4 kv heads replicated
    over 2 of the 8 chips."""
    (tmp_path / "config.json").write_text(
        json.dumps(_qwen3_30b_a3b_as_transformers_5_saves(num_hidden_layers=2))
    )
    _check_moe_decode(_moe_at_tp8(str(tmp_path), num_pages=4096, max_num_seqs=32), 2)


@soak  # the whole 48-layer MoE: minutes on 2 cores
def test_qwen3_30b_a3b_on_v5e_8_at_tp8():
    """At the default gpu_memory_utilization (0.9): updated in place (the TPU default), one copy
    of the 7.3 GiB of params a chip leaves room for the cache; two copies would leave none."""
    report = _moe_at_tp8("qwen3-30b-a3b", max_num_seqs=32)
    _check_moe_decode(report, 48)
    assert report["update_fits"] and report["est_decode_tok_s"] > 0
    with pytest.raises(DeviceMemoryError, match="weight_update_staging"):
        _moe_at_tp8("qwen3-30b-a3b", max_num_seqs=32, weight_update_staging="copy")

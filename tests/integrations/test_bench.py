"""`hotswap bench`: the GEMV bandwidth probe, where it runs (next to each timing), and start-up."""

from __future__ import annotations

import pytest

from benchmarks import limits, workloads
from hotswap import LLM


def test_gemv_probe_streams_from_dram_and_reports_each_reader():
    probe = limits.GemvProbe(calls=4)
    # The working set is far beyond any L3, so no call reads a matrix still in cache.
    assert sum(w.nbytes for w in probe.mats) >= limits.PROBE_BYTES
    assert len({w.unsafe_buffer_pointer() for w in probe.mats}) == len(probe.mats)
    got = probe()
    readers = {k: v for k, v in got.items() if k.startswith("gemv_bytes_per_s_")}
    assert "gemv_bytes_per_s_xla" in readers and "gemv_bytes_per_s_hotswap" in readers  # CPU: both
    assert all(v > 1e8 for v in readers.values())
    assert got["gemv_bytes_per_s"] == max(readers.values())


def test_decode_timing_runs_the_probe_before_each_timed_repeat(tiny_dir):
    llm = LLM(tiny_dir, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64, page_size=16)
    calls = []
    tok_s = workloads.hotswap_decode(
        llm, [[5, 6, 7], [8, 9]], new_tokens=4, repeats=3, before_each=lambda: calls.append(1)
    )
    assert len(calls) == 3
    assert tok_s > 0


def test_startup_measures_a_cold_then_a_warm_process(tiny_dir):
    """`hotswap bench --only startup`: the second process loads every warm-up step from the cache."""
    got = workloads.startup(tiny_dir, {"max_model_len": 64, "max_num_seqs": 2, "max_num_batched_tokens": 32})
    n = sum(got["cold"]["warmup"].values())
    assert got["cold"]["warmup"]["compiled"] == n > 0
    assert got["warm"]["warmup"]["from_cache"] == n
    assert got["cache_bytes"] > 0
    assert got["speedup"] == got["cold"]["llm_s"] / got["warm"]["llm_s"]


def test_weight_updates_time_the_check_beside_the_bandwidth_probe(tiny_dir):
    """The checked same-sharding update is timed right after a probe each time, and reported
    over the params' bandwidth-time; the directory update beside a raw read + copy (~5 s)."""
    llm = LLM(tiny_dir, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64, page_size=16)
    calls = []
    got = workloads.weight_updates(llm, tiny_dir, probe=lambda: calls.append(1) or 1e10, repeats=3)
    assert len(calls) == 3
    assert got["zero_copy"]
    assert got["bandwidth_ms"] == got["param_bytes"] / 1e10 * 1e3
    # one bandwidth throughout: the median of the per-repeat ratios is the ratio of the medians
    assert got["same_sharding_vs_bandwidth"] == pytest.approx(got["same_sharding_ms"] / got["bandwidth_ms"])
    assert got["directory_vs_raw"] == got["directory_s"] / got["raw_read_copy_s"]


def test_engine_flags_override_the_workloads_engine_and_only_when_given():
    """`hotswap bench --dtype bfloat16 ...`: the engine options of `serve` (EngineArgs) are bench
    flags; one not given leaves the workloads' own setting (and no default of its own is written)."""
    import argparse

    from benchmarks import bench
    from hotswap.args import EngineArgs

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    flags = {opt for a in parser._actions for opt in a.option_strings}
    assert {EngineArgs.flag(f) for f in EngineArgs.fields("llm")} <= flags
    plain = bench.engine_options(parser.parse_args([]), [1, 16])
    assert plain == {**bench.WORKLOAD_ENGINE, "max_num_seqs": 16}
    given = bench.engine_options(
        parser.parse_args(["--dtype", "bfloat16", "--max-model-len", "512", "--no-enable-prefix-caching"]),
        [4],
    )
    assert given == {
        **bench.WORKLOAD_ENGINE,
        "max_num_seqs": 4,
        "dtype": "bfloat16",
        "max_model_len": 512,
        "enable_prefix_caching": False,
    }

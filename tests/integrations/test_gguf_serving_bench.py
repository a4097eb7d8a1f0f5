"""`hotswap bench --only gguf` (benchmarks/gguf_serving.py): the parts that run without the
engines: each child's own peak RSS as the kernel reports it, the bars, the peer request's new
fields, and the dispatch from `hotswap bench`. The benchmark itself takes tens of minutes."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import bench, bench_peers, gguf_serving
from benchmarks.bench_peers import PeerError, PeerRequest

# A child that touches `mb` MiB and reports its own peak, as the benchmark's children do.
TOUCH = """
import json, sys
import numpy as np
from benchmarks.bench_peers import peak_rss
a = np.ones(json.load(sys.stdin)["mb"] << 18, np.float32)  # 4 bytes each: mb MiB, every page written
print("GGUFBENCH_RESULT " + json.dumps({"peak_rss": peak_rss(), "sum": float(a.sum())}))
"""


def test_spawn_reports_each_childs_own_peak():
    # 512 MiB first, then 256: each child's peak is its own VmHWM, which starts afresh at exec.
    # (wait4's ru_maxrss would be this test process's own RSS when that is larger: Linux keeps
    # the peak across exec, and between fork and exec the child's RSS is its parent's.)
    big = gguf_serving.spawn([sys.executable, "-c", TOUCH], {"mb": 512})
    small = gguf_serving.spawn([sys.executable, "-c", TOUCH], {"mb": 256})
    assert big["sum"] == 512 << 18
    assert (256 - 16) << 20 <= big["peak_rss_bytes"] - small["peak_rss_bytes"] <= (256 + 16) << 20
    assert big["peak_rss_bytes"] == big["peak_rss"]["vmhwm"] >= 512 << 20


def test_a_failing_child_says_why():
    with pytest.raises(RuntimeError, match="no such engine"):
        gguf_serving.spawn([sys.executable, "-c", "import sys; sys.exit('no such engine')"], {})


def test_bars_are_the_issues_ratios():
    rows = [
        {"dtype": "float32", "batch": 1, "rss_ratio": 1.4, "tok_s_ratio": 1.0},
        {"dtype": "float32", "batch": 16, "rss_ratio": 3.0, "tok_s_ratio": 1.6},
    ]
    bars = gguf_serving._bars(rows)
    assert bars["float32_rss"]["met"] and not bars["float32_batch1_tok_s"]["met"]
    assert bars["float32_batch16_tok_s"] == {"ratio": 1.6, "bar_min": 1.5, "met": True}
    assert "float32_rss16" not in bars  # memory is judged on the one-sequence pool only


def test_one_sequence_pool_is_65_pages():
    assert gguf_serving._engine("float32", 1)["num_pages"] == gguf_serving.ONE_SEQUENCE_PAGES == 65
    assert gguf_serving._engine("bfloat16", 16)["num_pages"] == 16 * 64 + 1


def test_peer_request_takes_a_gguf_file_and_a_kv_type():
    req = PeerRequest("", "", 2, 8, 1, 1, [[[1, 2]]], gguf="/m.gguf", kv_dtype="float16", context_tokens=1024)
    assert json.loads(json.dumps(req.__dict__))["kv_dtype"] == "float16"
    with pytest.raises(PeerError, match="kv_dtype 'int4'"):
        PeerRequest("", "", 2, 8, 1, 1, [[[1, 2]]], kv_dtype="int4")


def test_timed_repeats_drop_the_warm_up():
    calls = iter([9.0, 1.0, 2.0, 3.0])
    assert bench_peers.timed_repeats(lambda: next(calls), 3) == [1.0, 2.0, 3.0]


def test_bench_only_gguf_runs_it(tmp_path, monkeypatch):
    seen = {}

    def fake_run(repeats, peers_dir):
        seen.update(repeats=repeats, peers_dir=str(peers_dir))
        return {"table": []}

    monkeypatch.setattr(gguf_serving, "run", fake_run)
    assert bench.main(["--only", "gguf", "--repeats", "2", "--out", str(tmp_path)]) == 0
    assert seen == {"repeats": 2, "peers_dir": "benchmarks/peers"}
    assert json.loads((tmp_path / "bench.json").read_text())["gguf_serving"] == {"table": []}

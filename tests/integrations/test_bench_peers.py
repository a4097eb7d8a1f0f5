"""`hotswap bench` peers: the JSON protocol and subprocess runner, with a fake driver in place of
llama.cpp / vLLM (the real ones live in their own venvs and never run in CI)."""

from __future__ import annotations

import argparse
import dataclasses
import stat
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from matplotlib.axes import Axes

from benchmarks import bench, bench_peers, rollout
from benchmarks.bench_peers import PeerError, PeerNotInstalled, PeerRequest

ROOT = Path(__file__).resolve().parents[2]

# Speaks the driver half of the protocol; FAKE_PEER picks how it behaves.
FAKE_DRIVER = """
import os, sys, time
from benchmarks.bench_peers import emit_result, read_request

req = read_request()
mode = os.environ.get("FAKE_PEER", "ok")
print("library chatter on stdout {not json")
if mode == "fail":
    sys.exit("driver broke: no libllama.so")
if mode == "silent":
    sys.exit(0)
if mode == "sleep":
    time.sleep(60)
if req.rollout is not None:
    spec = req.rollout
    tokens = len(spec["prompts"]) * spec["n"] * spec["max_tokens"]
    emit_result({
        "peer": "fake", "version": "0",
        "rollout": {"seconds": 2.0, "tokens": tokens, "tok_s": tokens / 2.0},
        "rl_step": {"update_s": 1.0, "rollout_s": 2.0, "step_s": 3.0},
    })
    sys.exit(0)
emit_result({
    "peer": "fake",
    "version": "0",
    "echo": {"model_dir": req.model_dir, "threads": req.threads, "max_num_seqs": req.max_num_seqs, "dtype": req.dtype},
    "decode": [
        {"batch": len(p), "tok_s": 5.0 * len(p), "tokens": [[7] * req.new_tokens for _ in p]}
        for p in req.decode
    ],
    "serving": {"throughput_tok_s": sum(req.serving_outputs) / 2.0, "ttft_p50_s": 0.5, "ttft_p99_s": 2.0},
})
"""


CFG = types.SimpleNamespace(vocab_size=32000, dtype="float32")  # the model config `_run_peers` reads


def _install_fake(peers_dir: Path, name: str) -> None:
    """A peer 'venv' whose python is this test's interpreter, and the fake driver."""
    python = peers_dir / f".venv-{name}" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    (peers_dir / f"{name}_peer.py").write_text(FAKE_DRIVER)


def _request(batches=(1, 2), serving_outputs=(3, 4)) -> PeerRequest:
    return PeerRequest(
        model_dir="/models/m",
        work_dir="/tmp/w",
        threads=3,
        new_tokens=4,
        repeats=1,
        max_num_seqs=max(batches),
        decode=[[[11] * 8 for _ in range(b)] for b in batches],
        serving_prompts=[[12] * 5 for _ in serving_outputs],
        serving_outputs=list(serving_outputs),
    )


def test_every_peer_has_a_setup_script_and_a_driver():
    for name, script in bench_peers.PEERS.items():
        assert (ROOT / "benchmarks" / "peers" / script).is_file(), script
        assert (ROOT / "benchmarks" / "peers" / f"{name}_peer.py").is_file(), name


def test_round_trip_through_a_driver_subprocess(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PEER", "ok")
    _install_fake(tmp_path, "llama_cpp")
    result = bench_peers.run_peer("llama_cpp", dataclasses.replace(_request(), dtype="bfloat16"), tmp_path)
    assert result["echo"] == {"model_dir": "/models/m", "threads": 3, "max_num_seqs": 2, "dtype": "bfloat16"}
    assert [d["tok_s"] for d in result["decode"]] == [5.0, 10.0]
    assert result["serving"] == {"throughput_tok_s": 3.5, "ttft_p50_s": 0.5, "ttft_p99_s": 2.0}


def test_a_missing_venv_says_how_to_install_it(tmp_path, capsys):
    with pytest.raises(PeerNotInstalled, match=r"bash .*setup_vllm_cpu\.sh"):
        bench_peers.run_peer("vllm", _request(), tmp_path)
    assert bench_peers.select_peers(None, tmp_path) == []  # the default: only what is installed
    out = capsys.readouterr().out
    assert "setup_llama_cpp.sh" in out and "setup_vllm_cpu.sh" in out
    with pytest.raises(PeerNotInstalled, match="setup_llama_cpp.sh"):  # asked for by name: fail early
        bench_peers.select_peers("llama_cpp", tmp_path)
    with pytest.raises(PeerError, match="unknown peer 'sglang'"):
        bench_peers.select_peers("sglang", tmp_path)
    assert bench_peers.select_peers("none", tmp_path) == []


def test_installed_peers_are_the_default(tmp_path):
    _install_fake(tmp_path, "vllm")
    assert bench_peers.installed_peers(tmp_path) == ["vllm"]
    assert bench_peers.select_peers(None, tmp_path) == ["vllm"]
    assert bench_peers.select_peers("vllm,none", tmp_path) == ["vllm"]


@pytest.mark.parametrize(
    ("mode", "message"),
    [("fail", "driver broke: no libllama.so"), ("silent", "without a result line"), ("sleep", "timed out")],
)
def test_a_failing_driver_is_a_peer_error_that_shows_why(tmp_path, monkeypatch, mode, message):
    monkeypatch.setenv("FAKE_PEER", mode)
    _install_fake(tmp_path, "llama_cpp")
    with pytest.raises(PeerError, match=message):
        bench_peers.run_peer("llama_cpp", _request(), tmp_path, timeout_s=5)


def test_request_validation():
    with pytest.raises(PeerError, match="one output length per prompt"):
        dataclasses.replace(_request(), serving_outputs=[1])
    with pytest.raises(PeerError, match="at least 2 tokens"):
        dataclasses.replace(_request(), new_tokens=1)
    with pytest.raises(PeerError, match="dtype 'float16'"):
        dataclasses.replace(_request(), dtype="float16")


def test_timing_helpers_match_numpy():
    xs = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
    for q in (0, 50, 99, 100):
        assert bench_peers.percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    calls = []
    assert bench_peers.median_of_repeats(lambda: calls.append(1) or len(calls), 3) == 3  # warm-up dropped
    summary = bench_peers.serving_summary([10, 30], [0.5, 1.5], 4.0)
    assert summary["throughput_tok_s"] == 10.0 and summary["ttft_p50_s"] == 1.0
    assert bench_peers.leading_matches([1, 2, 3], [1, 2, 4]) == 2
    ref = bench_peers.Reference(tokens=[[1, 2, 3], [4, 5, 6]], margins=[[0.5, 0.5, 0.5], [0.5, 1e-5, 0.5]])
    assert bench_peers.hf_agreement([[1, 2, 3], [4, 7, 8]], ref) == 1.0  # departs only at a near-tie
    assert bench_peers.hf_agreement([[1, 9, 3], [4, 7, 8]], ref) == 0.5
    assert bench_peers.hf_agreement([[1, 2, 3]], ref) == 1.0  # a smaller batch: a prefix of the prompts


def test_bench_adds_peer_columns_serving_ratio_and_a_plot_line(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PEER", "ok")
    _install_fake(tmp_path, "llama_cpp")
    args = argparse.Namespace(new_tokens=4, repeats=1, prompt_len=8, peers_dir=str(tmp_path))
    rows = [
        {"batch": b, "hotswap_tok_s": 20.0, "mem_limit_tok_s": 50.0, "compute_limit_tok_s": 90.0}
        for b in (1, 2)
    ]
    serving = {"throughput_tok_s": 7.0, "ttft_p50_s": 0.25, "ttft_p99_s": 4.0}
    plan = ([6, 9], [3, 4])
    bench._run_peers(["llama_cpp"], args, tmp_path / "m", tmp_path / "out", rows, serving, plan, None, CFG)
    assert [r["llama_cpp_tok_s"] for r in rows] == [5.0, 10.0]
    assert [r["ratio_vs_llama_cpp"] for r in rows] == [4.0, 2.0]
    assert serving["llama_cpp"] == {"throughput_tok_s": 3.5, "ttft_p50_s": 0.5, "ttft_p99_s": 2.0}
    assert serving["ratio_vs_llama_cpp"] == 2.0
    assert serving["ttft_p50_ratio_vs_llama_cpp"] == 0.5 and serving["ttft_p99_ratio_vs_llama_cpp"] == 2.0
    labels = []
    real_plot = Axes.plot
    monkeypatch.setattr(
        Axes, "plot", lambda ax, *a, **k: labels.append(k.get("label")) or real_plot(ax, *a, **k)
    )
    bench._plot(rows, tmp_path / "throughput.png")
    assert "llama_cpp" in labels and "vllm" not in labels
    assert (tmp_path / "throughput.png").stat().st_size > 0


def test_peer_ratios_use_hotswap_measured_just_before_and_after_the_peer(tmp_path, monkeypatch):
    """A-B-A: the machine drifts, so a peer is compared with hotswap measured around it."""
    monkeypatch.setenv("FAKE_PEER", "ok")
    _install_fake(tmp_path, "llama_cpp")
    args = argparse.Namespace(new_tokens=4, repeats=1, prompt_len=8, peers_dir=str(tmp_path))
    rows = [{"batch": b, "hotswap_tok_s": 20.0} for b in (1, 2)]
    serving = {"throughput_tok_s": 7.0, "ttft_p50_s": 9.0, "ttft_p99_s": 9.0}
    around = [(9.0, 1.0, 3.0), (5.0, 0.0, 1.0)]  # throughput, TTFT p50, p99 before and after
    keys = ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s")
    again = iter(
        {"decode": decode, "serving": dict(zip(keys, s, strict=True))}
        for decode, s in zip([[30.0, 40.0], [10.0, 20.0]], around, strict=True)
    )
    bench._run_peers(
        ["llama_cpp"],
        args,
        tmp_path / "m",
        tmp_path / "out",
        rows,
        serving,
        ([6, 9], [3, 4]),
        None,
        CFG,
        lambda: next(again),
    )
    assert [r["hotswap_tok_s_around_llama_cpp"] for r in rows] == [[30.0, 10.0], [40.0, 20.0]]
    assert [r["ratio_vs_llama_cpp"] for r in rows] == [20.0 / 5.0, 30.0 / 10.0]
    assert rows[0]["hotswap_tok_s"] == 20.0  # the first measurement (beside its limit) stays
    assert serving["throughput_tok_s_around_llama_cpp"] == [9.0, 5.0]
    assert serving["ratio_vs_llama_cpp"] == 7.0 / 3.5
    assert serving["ttft_p50_s_around_llama_cpp"] == [1.0, 0.0]
    assert serving["ttft_p50_ratio_vs_llama_cpp"] == 0.5 / 0.5  # the peer's p50 is 0.5 s
    assert serving["ttft_p99_ratio_vs_llama_cpp"] == 2.0 / 2.0


def test_hf_reference_is_hf_greedy_with_its_margins(tiny_dir):
    import torch
    import transformers
    from helpers import hf_greedy

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompts = [[5, 17, 42, 99], [300, 12, 7, 64]]
    ref = bench_peers.hf_reference(model, prompts, 6)
    assert ref.tokens == hf_greedy(tiny_dir, prompts, 6)
    assert np.array(ref.margins).shape == (2, 6) and min(min(m) for m in ref.margins) >= 0
    assert bench_peers.hf_agreement(ref.tokens, ref) == 1.0


def test_rollout_runs_hotswap_around_the_vllm_peer(tiny_dir, tmp_path, monkeypatch):
    """`hotswap bench --only rollout` on a tiny model (4 new tokens): the group rollout and an RL
    step through hotswap, the peer's through its driver, hotswap again, ratios to the mean."""
    monkeypatch.setenv("FAKE_PEER", "ok")
    _install_fake(tmp_path, "vllm")
    _install_fake(tmp_path, "llama_cpp")
    peers = ["vllm", "llama_cpp"]
    result = rollout.run(tiny_dir, {"warmup": False}, peers, tmp_path, tmp_path / "w", 4, shape=(2, 3, 16))
    tokens = 2 * 3 * 4
    runs = result["hotswap"]
    assert len(runs) == 2 and all(r["rollout"]["tokens"] == tokens for r in runs)
    assert all(r["rl_step"]["step_s"] == r["rl_step"]["update_s"] + r["rl_step"]["rollout_s"] for r in runs)
    mine = sum(r["rollout"]["tok_s"] for r in runs) / 2
    assert result["vllm"]["ratio_vs_vllm"] == pytest.approx(mine / (tokens / 2.0))
    assert result["vllm"]["rl_step_ratio"] == pytest.approx(
        3.0 / (sum(r["rl_step"]["step_s"] for r in runs) / 2)
    )
    assert "skipped" in result["llama_cpp"]
    assert result["workload"]["dtype"] == "bfloat16" and result["workload"]["max_num_seqs"] == 6

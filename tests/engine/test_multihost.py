"""Two CPU processes on loopback serve one tensor-parallel model (examples/multihost_cpu.py).

Process 0 drives and broadcasts every engine command; process 1 follows. Both
must see the same tokens and versions as each other and as one process alone.
A trainer's per-process transfer offer is pulled by each process, its own shards
only; an offer that is wrong for one process fails the update on both.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT, SUPPORT, soak

from hotswap import LLM, SamplingParams

EXAMPLE = ROOT / "examples" / "multihost_cpu.py"


def _example():
    spec = importlib.util.spec_from_file_location("multihost_cpu", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# 2 x 2 spans the processes' own devices too; 2 x 1 adds nothing it lacks but a minute of CI.
@pytest.mark.slow
@pytest.mark.parametrize("local_devices", [pytest.param(1, marks=soak), 2])
def test_two_processes_serve_one_model(tmp_path, local_devices):
    """tp = 2 processes x 1 device, and 2 x 2 (fake CPU devices): the mesh spans both processes."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, str(EXAMPLE), "--workdir", str(tmp_path), "--timeout", "280"]
    proc = subprocess.run(
        cmd + ["--local-devices", str(local_devices)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert re.findall(r"\[process (\d)\] exit (\d+)", proc.stdout) == [("0", "0"), ("1", "0")]
    records = [json.loads(m) for m in re.findall(r"^\[process \d\] (\{.*\})$", proc.stdout, re.M)]
    driver, follower = sorted(records, key=lambda r: r["process"])
    assert driver["devices"] == follower["devices"] == 2 * local_devices

    # Process 0's lifecycle calls took effect on both: same versions, same tokens.
    assert driver["versions_served"] == [1, 2, 3, 3, 4, 5]
    assert driver["weights_version"] == follower["weights_version"] == 5
    assert follower["commands"] > 10
    assert driver["rejected"] == "CheckpointError"  # ...and version 5 kept serving on both
    assert driver["outputs"] == follower["outputs"]
    want_version = {"v1": 1, "v2": 2, "v3": 3, "v3-woken": 3, "v4": 4, "v5-lora": 5}
    for rid, out in driver["outputs"].items():
        assert out["versions"] == [want_version[rid.rsplit("-", 1)[0]]], rid

    # And they are the tokens one process alone produces from the same weights.
    ex = _example()
    sp = SamplingParams(**ex.GREEDY)
    for ckpt, tags in (("v1", ("v1", "v3", "v3-woken")), ("v2", ("v2", "v4"))):
        alone = LLM(tmp_path / ckpt, **ex.ENGINE).generate(ex.PROMPTS, sp, use_tqdm=False)
        for tag in tags:
            got = [driver["outputs"][f"{tag}-{k}"]["ids"] for k in range(len(ex.PROMPTS))]
            assert got == [o.outputs[0].token_ids for o in alone], tag
    assert driver["outputs"]["v1-0"]["ids"] != driver["outputs"]["v2-0"]["ids"]
    # The adapter crossed processes: what one process serves after merging it into v2's weights.
    solo = LLM(tmp_path / "v2", **ex.ENGINE)
    solo.update_weights(ex.lora_tree(solo), lora_alpha=ex.LORA_ALPHA)
    want = [o.outputs[0].token_ids for o in solo.generate(ex.PROMPTS, sp, use_tqdm=False)]
    got = [driver["outputs"][f"v5-lora-{k}"]["ids"] for k in range(len(ex.PROMPTS))]
    assert got == want
    assert got != [driver["outputs"][f"v4-{k}"]["ids"] for k in range(len(ex.PROMPTS))]  # it took effect


TRAINER = SUPPORT / "transfer_trainer.py"


@pytest.mark.slow
def test_each_process_pulls_its_own_shards(tmp_path):
    """A tp=2 trainer publishes one offer per engine process; each of the 2 processes pulls
    only its shards. Then three bad offers each fail on both processes and change nothing:
    process 1's part wrong-shaped, process 1's weights never offered (it times out while
    process 0 has pulled), and a NaN (found by the collective check after the pulls)."""
    from hotswap.checkpoint.create import create_checkpoint

    ex = _example()
    ckpt = create_checkpoint(tmp_path / "trained", preset="tiny", seed=2, overrides=ex.SHAPES)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    trainer_env = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    trainers = [
        subprocess.Popen(
            [sys.executable, str(TRAINER), str(ckpt), mode],
            env=trainer_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for mode in ("procs", "procs-shape1", "procs-stall1", "procs-nan")
    ]
    try:
        refs = [json.loads(t.stdout.readline() or "null") for t in trainers]
        assert all(refs), "a trainer exited early"
        assert [r["processes"] for r in refs] == [2, 2, 2, 2]
        refs[2]["timeout_s"] = 3
        cmd = [sys.executable, str(EXAMPLE), "--workdir", str(tmp_path), "--timeout", "280"]
        proc = subprocess.run(
            cmd + ["--transfer", json.dumps(refs)], env=env, capture_output=True, text=True, timeout=300
        )
    finally:
        for t in trainers:
            t.stdin.close()
            t.wait(30)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert re.findall(r"\[process (\d)\] exit (\d+)", proc.stdout) == [("0", "0"), ("1", "0")]
    records = [json.loads(m) for m in re.findall(r"^\[process \d\] (\{.*\})$", proc.stdout, re.M)]
    driver, follower = sorted(records, key=lambda r: r["process"])

    # The good offer swapped on both; each bad one was refused on both, with one error.
    assert driver["versions_served"] == [1, 2, 2]
    assert driver["weights_version"] == follower["weights_version"] == 2
    shape, stall, nan = driver["rejected"]
    assert shape[0] == "WeightsMismatch" and "process 1: " in shape[1], shape
    assert "layers.0.wq: expected (64, 4, 16) float32, got (66, 4, 16) float32" in shape[1], shape
    assert stall[0] == "TransferError" and "process 1: " in stall[1], stall
    assert "no weights within 3 s" in stall[1], stall
    assert nan[0] == "NonFiniteWeights" and "layers.1.w_up: contains NaN" in nan[1], nan
    assert driver["outputs"] == follower["outputs"]

    # Each process pulled only its own shards: about half the weights (norms are replicated).
    # Process 0 pulled its half of all four offers; process 1 of the good and the NaN ones
    # (it refused the wrong shape at the manifest and never got the stalled weights).
    for r in (driver, follower):
        assert r["own_shard_bytes"] < 0.75 * r["param_bytes"], r
    assert driver["own_shard_bytes"] + follower["own_shard_bytes"] >= driver["param_bytes"]
    assert driver["pulled_bytes"] == 4 * driver["own_shard_bytes"]
    assert follower["pulled_bytes"] == 2 * follower["own_shard_bytes"]

    # The tokens equal a fresh engine's on the trainer's weights, before and after the bad offer.
    sp = SamplingParams(**ex.GREEDY)
    alone = LLM(ckpt, **ex.ENGINE).generate(ex.PROMPTS, sp, use_tqdm=False)
    for tag in ("t", "t-after"):
        got = [driver["outputs"][f"{tag}-{k}"]["ids"] for k in range(len(ex.PROMPTS))]
        assert got == [o.outputs[0].token_ids for o in alone], tag
        assert all(driver["outputs"][f"{tag}-{k}"]["versions"] == [2] for k in range(len(ex.PROMPTS)))
    assert driver["outputs"]["v1-0"]["ids"] != driver["outputs"]["t-0"]["ids"]

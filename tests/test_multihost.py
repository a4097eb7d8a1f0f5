"""Two CPU processes on loopback serve one tensor-parallel model (examples/multihost_cpu.py).

Process 0 drives and broadcasts every engine command; process 1 follows. Both
must see the same tokens and versions as each other and as one process alone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hotswap import LLM, SamplingParams

EXAMPLE = Path(__file__).parent.parent / "examples" / "multihost_cpu.py"


def _example():
    spec = importlib.util.spec_from_file_location("multihost_cpu", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.parametrize("local_devices", [1, 2])
def test_two_processes_serve_one_model(tmp_path, local_devices):
    """tp = 2 processes x 1 device, and 2 x 2 (fake CPU devices): the mesh spans both processes."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, str(EXAMPLE), "--workdir", str(tmp_path), "--timeout", "110"]
    proc = subprocess.run(
        cmd + ["--local-devices", str(local_devices)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert re.findall(r"\[process (\d)\] exit (\d+)", proc.stdout) == [("0", "0"), ("1", "0")]
    records = [json.loads(m) for m in re.findall(r"^\[process \d\] (\{.*\})$", proc.stdout, re.M)]
    driver, follower = sorted(records, key=lambda r: r["process"])
    assert driver["devices"] == follower["devices"] == 2 * local_devices

    # Process 0's lifecycle calls took effect on both: same versions, same tokens.
    assert driver["versions_served"] == [1, 2, 3, 3, 4]
    assert driver["weights_version"] == follower["weights_version"] == 4
    assert follower["commands"] > 10
    assert driver["rejected"] == "CheckpointError"  # ...and version 4 kept serving on both
    assert driver["outputs"] == follower["outputs"]
    want_version = {"v1": 1, "v2": 2, "v3": 3, "v3-woken": 3, "v4": 4}
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

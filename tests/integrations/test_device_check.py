"""benchmarks/device_check.py in --smoke mode (CPU, tiny shapes): the prepared device check
runs end to end and writes its summary, so it cannot rot while no device is lent."""

from __future__ import annotations

import json

from benchmarks import device_check


def test_device_check_smoke(tmp_path):
    out = tmp_path / "summary.json"
    summary = device_check.main(["--smoke", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(summary, default=str))
    parts = summary["parts"]
    assert set(parts) == {"kernel", "engine", "decode"}, parts  # kernel_tests: the suite's own job here
    assert summary["ok"], json.dumps(parts, indent=1, default=str)
    assert parts["kernel"]["pallas"] == "interpreted" and parts["kernel"]["cases"]
    rows = parts["decode"]["rows"]
    assert [r["batch"] for r in rows] == [1, 4] and all(r["tok_s"] > 0 for r in rows)
    assert parts["decode"]["dtype"] == "bfloat16"
    assert all(r["bytes_read_per_step"] > parts["decode"]["weight_bytes"] for r in rows)


def test_chip_names_map_to_their_peak_bandwidth():
    class Dev:
        def __init__(self, kind):
            self.device_kind = kind

    names = {
        k: device_check.chip_name(Dev(k))
        for k in ("TPU v5 lite", "TPU v5e", "TPU v6 lite", "TPU v5p", "TPU v4", "NVIDIA H200", "cpu")
    }
    assert names == {
        "TPU v5 lite": "v5e",
        "TPU v5e": "v5e",
        "TPU v6 lite": "v6e",
        "TPU v5p": "v5p",
        "TPU v4": "v4",
        "NVIDIA H200": "H200",
        "cpu": None,
    }
    assert device_check.PEAK_BYTES_PER_S["v5e"] == 819e9 and device_check.PEAK_BYTES_PER_S["H200"] == 4.8e12

"""`hotswap demo` end to end (in process, and over REST) and the example notebook (nbclient)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import soak

from hotswap.cli import demo as demo_command
from hotswap.rl import train_while_serving

ROOT = Path(__file__).resolve().parents[2]


def _run(capsys, argv: list[str]) -> tuple[int, dict]:
    rc = train_while_serving.main(demo_command.parse([*argv, "--no-progress"]))
    out = capsys.readouterr().out.strip().splitlines()
    return rc, json.loads(out[-1])  # the last stdout line is the JSON summary


@pytest.mark.slow
def test_demo_learns_and_never_serves_stale_kv(tmp_path, capsys):
    # Small and fixed-seed: 20 steps of 4 prompts x 4 samples at a high learning rate.
    argv = ["--steps", "20", "--prompts-per-step", "4", "--n", "4", "--lr", "1e-2", "--seed", "0"]
    rc, s = _run(capsys, [*argv, "--out", str(tmp_path)])
    assert rc == 0
    assert s["steps"] == 20 and s["weights_version"] == s["steps"] + 1  # one version per update
    assert s["max_logprob_mismatch"] < 1e-3  # engine logprobs == trainer's recomputation
    assert s["stale_prefix_hits"] == 0 and s["stale_tokens"] == 0
    assert s["prefix_cache_hit_rate"] > 0.5  # the shared prefix hits within every step
    assert s["reward_last"] > s["reward_first"] + 0.05
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["weights_version"] for r in rows] == list(range(2, 22))
    assert all(r["generated_by"] == r["weights_version"] - 1 for r in rows)
    assert all(r["first_cached_tokens"] == 0 for r in rows)  # each update emptied the cache


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["abort", pytest.param("keep", marks=soak)])
def test_demo_other_policies(tmp_path, capsys, policy):
    # Same engine shapes as above: the compiled steps are reused, so this is quick.
    argv = ["--steps", "3", "--prompts-per-step", "4", "--n", "4", "--policy", policy]
    rc, s = _run(capsys, [*argv, "--out", str(tmp_path)])
    assert rc == 0 and s["policy"] == policy
    assert s["weights_version"] == 4 and s["max_logprob_mismatch"] < 1e-3 and s["stale_prefix_hits"] == 0


@pytest.mark.slow
def test_demo_deterministic_mismatch_is_zero(tmp_path, capsys):
    """--deterministic: the engine's own score of every sampled token equals the rollout's bit
    for bit (the mismatch column), while the jnp trainer still differs by float noise."""
    argv = ["--steps", "3", "--prompts-per-step", "4", "--n", "4", "--deterministic"]
    rc, s = _run(capsys, [*argv, "--out", str(tmp_path)])
    assert rc == 0 and s["deterministic"] and s["stale_prefix_hits"] == 0
    assert s["max_logprob_mismatch"] == 0.0
    assert 0.0 <= s["trainer_mismatch"] < 1e-3


def test_demo_catches_stale_kv_from_a_broken_engine(tmp_path, capsys, monkeypatch):
    """The demo's checks are evidence, not trust: re-create the bug class hotswap prevents (a prefix
    index that survives an update and matches any version) and they must all fire."""
    import dataclasses

    import numpy as np

    from hotswap.engine import lifecycle, prefix, scheduler
    from hotswap.engine.prefix import PrefixIndex

    update, page_key = lifecycle.update_weights, prefix.page_key
    monkeypatch.setattr(
        lifecycle,
        "update_weights",
        lambda st, p, **kw: dataclasses.replace(update(st, p, **kw), prefix=st.prefix),
    )
    monkeypatch.setattr(
        scheduler, "page_key", lambda parent, tokens, version, *adapter: page_key(parent, tokens, 0, *adapter)
    )
    monkeypatch.setattr(
        PrefixIndex,
        "find",
        lambda self, key, version, *adapter: int(next(iter(np.flatnonzero(self.key == key)), 0)),
    )
    rc, s = _run(capsys, ["--steps", "3", "--prompts-per-step", "4", "--n", "4", "--out", str(tmp_path)])
    assert rc == 1  # the CLI fails
    assert s["stale_prefix_hits"] > 0  # reused pages written under an older version
    assert s["max_logprob_mismatch"] > 1e-2  # and the served logprobs really were wrong


@pytest.mark.slow
def test_demo_via_http(tmp_path, capsys):
    argv = ["--steps", "3", "--prompts-per-step", "2", "--n", "4", "--max-tokens", "8", "--via-http"]
    rc, s = _run(capsys, [*argv, "--out", str(tmp_path)])
    assert rc == 0 and s["via_http"]
    assert s["weights_version"] == 4 and s["max_logprob_mismatch"] < 1e-3
    assert s["stale_prefix_hits"] == 0 and s["stale_tokens"] == 0


@pytest.mark.slow
def test_notebook_executes(tmp_path, monkeypatch):
    import nbclient
    import nbformat
    from ipykernel import kernelspec

    # A kernelspec for *this* interpreter, found first on JUPYTER_PATH: works in a clean venv with no
    # registered kernel, and is not shadowed by a system-wide "python3" of another environment.
    kernelspec.write_kernel_spec(
        tmp_path / "jupyter" / "kernels" / "hotswap-test",
        overrides={"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]},
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    nb = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="hotswap-test", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    html = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "text/html" in o.get("data", {})
    ]
    assert html and "weights_version" in html[-1]["data"]["text/html"]

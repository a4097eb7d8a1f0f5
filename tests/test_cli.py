"""The `hotswap` command line: create-model writes a loadable checkpoint; unknown commands fail clearly;
`bench` runs the checkout's benchmarks, and says where they are when there is none."""

from __future__ import annotations

import json
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


def test_bad_input_is_one_error_line_not_a_traceback(tmp_path, capsys):
    """A typed error from a command (here an unknown peer, caught before any benchmark runs)
    exits 2 with the error's message on stderr."""
    model = tmp_path / "m"
    cli.main(["create-model", "--preset", "tiny", "--out", str(model)])
    capsys.readouterr()
    assert cli.main(["bench", str(model), "--peers", "sglang", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hotswap bench: error: unknown peer 'sglang'") and "Traceback" not in err


def test_bench_runs_the_checkouts_benchmarks_and_says_where_they_are_without_one(
    tmp_path, monkeypatch, capsys
):
    from benchmarks import bench

    assert cli.checkout() == Path(__file__).resolve().parents[1]
    model = tmp_path / "m"
    cli.main(["create-model", "--preset", "tiny", "--out", str(model)])
    capsys.readouterr()
    # `python -m benchmarks.bench`: the same flags and the same one-line errors
    assert bench.main([str(model), "--peers", "sglang", "--out", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err.startswith("python -m benchmarks.bench: error: unknown peer 'sglang'")
    # An installed wheel has no benchmarks/: `hotswap bench` is still listed, and running it says why not.
    monkeypatch.setattr(cli, "checkout", lambda: None)
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

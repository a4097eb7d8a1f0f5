"""Caches of machine code are keyed by the CPU they were built for (kernels/cpu_target.py).

A cache directory can travel between machines; code built for AVX-512 must never run on an
AVX2 box, and code built for AVX2 should not keep running on an AVX-512 one."""

from __future__ import annotations

import json
import os

import pytest

from hotswap.kernels import cpu_build, cpu_target
from hotswap.programs import compile_cache, step_cache

AVX2_BOX = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz
flags\t\t: fpu vme de pse tsc msr sse sse2 ssse3 fma cx16 sse4_1 sse4_2 popcnt aes avx f16c avx2 bmi1 bmi2 hypervisor

processor\t: 1
model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz
flags\t\t: fpu
"""
ZEN4_BOX = AVX2_BOX.replace("Intel(R) Xeon(R) CPU @ 2.20GHz", "AMD EPYC 9R14").replace(
    "avx2 bmi1", "avx2 avx512f avx512bw avx512_bf16 avx512_vnni bmi1"
)


def test_cpuinfo_gives_the_first_cores_model_and_only_instruction_set_flags():
    avx2 = cpu_target.parse_cpuinfo(AVX2_BOX)
    assert avx2.model == "Intel(R) Xeon(R) CPU @ 2.20GHz"
    # Only the first core's entry, only instruction sets (not tsc, cx16 or hypervisor), sorted.
    assert avx2.isa == tuple("aes avx avx2 bmi1 bmi2 f16c fma popcnt sse sse2 sse4_1 sse4_2 ssse3".split())
    zen4 = cpu_target.parse_cpuinfo(ZEN4_BOX)
    assert {"avx512f", "avx512_bf16", "avx512_vnni"} <= set(zen4.isa)
    assert zen4.key != avx2.key
    # A flag that is no instruction set (a hypervisor's, a bug list) does not split the cache.
    assert cpu_target.parse_cpuinfo(AVX2_BOX.replace("hypervisor", "")).key == avx2.key
    assert "AMD EPYC 9R14 (" in zen4.describe() and "avx512_vnni" in zen4.describe()


def test_this_hosts_cpu_is_read():
    here = cpu_target.host()
    assert here.model and len(here.key) == 12
    if os.uname().machine == "x86_64":
        assert "sse2" in here.isa


def _built_file(name: str):
    path = cpu_build.built(name)
    return path, path.stat().st_mtime_ns, json.loads(path.with_suffix(".json").read_text())


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTSWAP_CACHE_DIR", str(tmp_path))
    return tmp_path / "kernels"


def test_a_kernel_built_for_another_cpu_is_rebuilt_not_loaded(kernel_cache):
    path, mtime, manifest = _built_file("categorical")
    assert path.parent == kernel_cache
    cxx = cpu_build._compiler()
    assert manifest["target"] == cpu_target.native_target(cxx)  # the ISA -march=native resolved to
    again, mtime_again, _ = _built_file("categorical")
    assert (again, mtime_again) == (path, mtime)  # same CPU: the cached library is used
    # A cache carried from an AVX2 box: same file name, its manifest names that box's target.
    path.with_suffix(".json").write_text(json.dumps({"target": "haswell:-mavx -mavx2 -mfma"}))
    rebuilt, mtime_rebuilt, manifest = _built_file("categorical")
    assert rebuilt == path and mtime_rebuilt != mtime  # rebuilt before anything loaded it
    assert manifest["target"] == cpu_target.native_target(cxx)
    # A library with no manifest (copied without it) is not trusted either.
    path.with_suffix(".json").unlink()
    assert _built_file("categorical")[1] != mtime_rebuilt


def test_a_kernel_key_names_the_target(kernel_cache, monkeypatch):
    """Another CPU resolves -march=native differently: its libraries live under other names, so
    two machines sharing one cache directory each build and load their own."""
    here = cpu_build.built("categorical")
    monkeypatch.setattr(cpu_build, "native_target", lambda cxx: "x86-64-v3:-mavx2 -mfma")
    there = cpu_build.built("categorical")
    assert there != here and here.exists() and there.exists()
    assert json.loads(there.with_suffix(".json").read_text())["target"] == "x86-64-v3:-mavx2 -mfma"


def test_compiled_steps_are_keyed_by_the_cpu(tmp_path, monkeypatch, jax_cache_settings):
    """JAX's cache and the step cache: another CPU's programs are a miss, never loaded."""
    import jax

    monkeypatch.setenv("HOTSWAP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    assert compile_cache.enable(True) == tmp_path / "xla" / cpu_target.host().key
    other = cpu_target.parse_cpuinfo(AVX2_BOX if "avx512f" in cpu_target.host().isa else ZEN4_BOX)
    args = [jax.numpy.zeros((2, 3))]
    tree = jax.tree.structure(args)
    device = jax.devices()[0]
    here = step_cache._key(args, tree, "cfg", _FakeBackend, device)
    monkeypatch.setattr(step_cache, "host", lambda: other)
    assert step_cache._key(args, tree, "cfg", _FakeBackend, device) != here


class _FakeBackend:
    attention, platform, deterministic = "reference", "cpu", False


@pytest.fixture
def jax_cache_settings():
    import jax

    saved = {
        k: getattr(jax.config, k)
        for k in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    }
    yield
    for k, v in saved.items():
        jax.config.update(k, v)


def test_no_compiler_is_a_typed_error(kernel_cache, monkeypatch):
    monkeypatch.setattr(cpu_build, "_compiler", lambda: None)
    with pytest.raises(cpu_build.ConfigError, match="C\\+\\+ compiler"):
        cpu_build.built("categorical")

"""JAX's persistent compilation cache (programs/compile_cache.py): a second process loads the
warm-up's programs, the C++ kernels' custom calls still resolve, and the off switches work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from hotswap.cache_dir import cache_dir
from hotswap.kernels.cpu_target import host
from hotswap.programs import compile_cache

# Cache settings of this process that would change what the fresh processes do.
_CACHE_SETTINGS = (
    "HOTSWAP_COMPILATION_CACHE",
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
)
# A fresh process: start an LLM on the C++ kernels, report what warm-up did and greedy tokens.
# `traced`: how many times JAX traced the step (the step cache loads it untraced).
_START = """
import json, sys
from jax import monitoring
from hotswap import LLM, SamplingParams
traced = []
monitoring.register_event_duration_secs_listener(
    lambda e, s, fun_name=None, **kw: traced.append(1) if fun_name == "_step" else None)
llm = LLM(sys.argv[1], attention="cpu", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
          deterministic=sys.argv[2] == "1")
sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
outs = llm.generate([[5, 6, 7, 8], [9, 10]], sp, use_tqdm=False)
print(json.dumps({"warmup": llm.engine.runner.warmup_counts, "traced": len(traced),
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def _start(model_dir, root, deterministic: bool = False, **env_extra):
    env = {k: v for k, v in os.environ.items() if k not in _CACHE_SETTINGS}
    # The tiny model's steps compile in far under JAX's default 1 s threshold: written anyway.
    env |= {"HOTSWAP_CACHE_DIR": str(root), **env_extra}
    out = subprocess.run(
        [sys.executable, "-c", _START, str(model_dir), "1" if deterministic else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1]), out.stderr


def _fresh_root(path):
    """A fresh hotswap cache dir sharing the real `kernels/`, so the C++ kernels are not rebuilt."""
    kernels = cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (path / "kernels").symlink_to(kernels.resolve(), target_is_directory=True)
    return path


@pytest.fixture
def cache_root(tmp_path):
    return _fresh_root(tmp_path)


@pytest.fixture(scope="module")
def first_start(tiny_dir, tmp_path_factory):
    """One default start into a fresh cache dir: what it reported, its stderr and the dir. The
    tests below add processes to this dir (one start fewer on 2 cores)."""
    root = _fresh_root(tmp_path_factory.mktemp("compile-cache"))
    return (*_start(tiny_dir, root), root)


def test_a_second_process_loads_every_step_from_the_cache_and_generates_the_same(tiny_dir, first_start):
    first, first_err, cache_root = first_start
    assert first["warmup"]["compiled"] > 0 and first["warmup"]["from_cache"] == 0
    assert any((cache_root / "xla").iterdir())  # under the one hotswap cache dir
    second, second_err = _start(tiny_dir, cache_root)
    n = sum(first["warmup"].values())
    # Every bucket loaded, none compiled: the cached programs' custom calls found their targets.
    assert second["warmup"] == {"compiled": 0, "from_cache": n, "in_memory": 0}
    assert second["tokens"] == first["tokens"]
    # ... by the step cache: neither warm-up nor serving traced the step again.
    assert first["traced"] >= n and second["traced"] == 0
    assert len(list((cache_root / "steps").glob("*.bin"))) == n
    assert f"{n} from cache" in second_err and f"{n} compiled" in first_err  # the progress bar


def test_a_deterministic_engine_compiles_its_own_steps(tiny_dir, first_start):
    """The default engine's cached steps call other kernels: deterministic mode never loads them."""
    first, _, cache_root = first_start
    det, _ = _start(tiny_dir, cache_root, deterministic=True)
    assert det["warmup"] == {"compiled": sum(first["warmup"].values()), "from_cache": 0, "in_memory": 0}
    again, _ = _start(tiny_dir, cache_root, deterministic=True)
    assert again["warmup"]["compiled"] == 0 and again["tokens"] == det["tokens"]


def test_off_by_env_var_writes_nothing(tiny_dir, cache_root):
    got, _ = _start(tiny_dir, cache_root, HOTSWAP_COMPILATION_CACHE="0")
    assert got["warmup"]["compiled"] > 0
    assert not (cache_root / "xla").exists() and not (cache_root / "steps").exists()


_SETTINGS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_enable_compilation_cache",
)


@pytest.fixture
def jax_cache_settings():
    """Restores JAX's cache settings after the test (nothing compiles meanwhile)."""
    before = {k: getattr(jax.config, k) for k in _SETTINGS}
    yield
    for k, v in before.items():
        jax.config.update(k, v)


def test_enable_respects_the_switches_and_a_users_own_cache(tmp_path, monkeypatch, jax_cache_settings):
    monkeypatch.setenv("HOTSWAP_CACHE_DIR", str(tmp_path))
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)  # JAX's default
    monkeypatch.setenv(compile_cache.ENV, "0")
    assert compile_cache.enable(True) is None
    monkeypatch.delenv(compile_cache.ENV)
    assert compile_cache.enable(False) is None  # EngineConfig(compilation_cache=False)
    assert jax.config.jax_compilation_cache_dir is None
    assert compile_cache.enable(True) == tmp_path / "xla" / host().key
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla" / host().key)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0  # every warm-up step is written
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))  # the user's own
    assert compile_cache.enable(True) == tmp_path / "mine"
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")


def test_a_changed_write_threshold_is_left_as_it_is(tmp_path, monkeypatch, jax_cache_settings):
    monkeypatch.setenv("HOTSWAP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.5)
    assert compile_cache.enable(True) == tmp_path / "xla" / host().key
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.5


def test_progress_text_leaves_zero_counts_out():
    assert (
        compile_cache.describe({"compiled": 3, "from_cache": 8, "in_memory": 0}) == "3 compiled, 8 from cache"
    )


def test_the_step_cache_hits_only_the_same_code_and_bucket(
    tiny_dir, tmp_path, monkeypatch, jax_cache_settings
):
    """A stored step loads for the same arguments and gives the same outputs; a change of the
    package's code or of the bucket is a miss (their programs would differ)."""
    from hotswap import LLM
    from hotswap.kernels.backend import Backend
    from hotswap.programs import step_cache
    from hotswap.programs.step import compile_step, fused_jit, placeholder_inputs

    monkeypatch.setenv("HOTSWAP_CACHE_DIR", str(tmp_path))
    jax.config.update("jax_enable_compilation_cache", False)  # compiled here: whole to serialize
    llm = LLM(
        tiny_dir, attention="cpu", max_model_len=64, max_num_seqs=2, warmup=False, compilation_cache=False
    )
    st, cfg, cpu = llm.engine.state, llm.engine.mcfg, llm.engine.backend
    ref = Backend.choose("reference", head_dim=cfg.head_dim)
    args = (st.params, st.kv.pages, *placeholder_inputs(2, 1, 4, cpu, vocab_size=cfg.vocab_size))
    assert step_cache.eligible(args, cpu) and not step_cache.eligible(args, ref)
    assert step_cache.load(args, cfg=cfg, backend=cpu) is None
    step_cache.store(compile_step(*args, cfg=cfg, backend=cpu), args, cfg=cfg, backend=cpu)
    loaded = step_cache.load(args, cfg=cfg, backend=cpu)
    assert loaded is not None
    fresh = [jax.numpy.zeros_like(x) for x in st.kv.pages]
    want = fused_jit(st.params, tuple(x.copy() for x in fresh), *args[2:], cfg=cfg, backend=cpu)
    got = loaded(st.params, tuple(x.copy() for x in fresh), *args[2:])
    assert all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True))
    other = (st.params, st.kv.pages, *placeholder_inputs(1, 1, 4, cpu, vocab_size=cfg.vocab_size))
    assert step_cache.load(other, cfg=cfg, backend=cpu) is None
    monkeypatch.setattr(step_cache, "code_hash", lambda: "an edited package")
    assert step_cache.load(args, cfg=cfg, backend=cpu) is None


def test_the_compile_counter_gives_each_thread_its_own_counts():
    """Warm-up compiles steps on several threads under one counter: each reads only its own."""
    import threading

    import jax.numpy as jnp

    seen = {}
    with compile_cache.CompileCounter() as counter:

        def compile_one(n: int) -> None:
            jax.jit(lambda x: x * n + 1).lower(jax.ShapeDtypeStruct((n,), jnp.float32)).compile()
            seen[n] = counter.mine()

        threads = [threading.Thread(target=compile_one, args=(n,)) for n in (3, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert counter.mine() == (0, 0)  # this thread compiled nothing
    assert seen == {3: (1, 0), 5: (1, 0)} and counter.programs == 2 and counter.loaded == 0

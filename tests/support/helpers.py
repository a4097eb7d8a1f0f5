"""Test helpers: small engine options, an HF transformers oracle and a compilation counter."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from jax import monitoring

# Tests that take many minutes on the 2-core CI machine (a real model through transformers, an
# engine over 8 host devices, a second TPU compile of a large preset): run with HOTSWAP_SOAK=1,
# as the long reliability soaks are, so the suite stays within its half hour.
soak = pytest.mark.skipif(os.environ.get("HOTSWAP_SOAK") != "1", reason="a long run: HOTSWAP_SOAK=1")

# tests/support (these helpers and the subprocess workers) and the checkout. A worker process finds
# both on WORKER_PYTHONPATH, as the test files find them through pyproject.toml's `pythonpath`.
SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]
WORKER_PYTHONPATH = os.pathsep.join([str(SUPPORT), str(ROOT)])

# Small engine options for the tiny model: 3 step buckets to compile. A test that needs other
# values derives them where it is read, e.g. `{**KNOBS, "max_num_seqs": 4}`.
KNOBS = {"max_model_len": 128, "max_num_seqs": 2, "max_num_batched_tokens": 16, "page_size": 16}

_compiles = [0]


def _on_event(name: str, _duration: float, **_kw) -> None:
    if name == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1


monitoring.register_event_duration_secs_listener(_on_event)


@contextlib.contextmanager
def count_compiles():
    """`with count_compiles() as n: ...; assert n() == 0` counts XLA backend compilations."""
    start = _compiles[0]
    yield lambda: _compiles[0] - start


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers `generate`, one prompt at a time, greedy, float32, no EOS stop."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def hf_to_device(cfg, tensors, abstract, *, base=None, check_finite=True):
    """HF-named tensors converted onto `abstract` as the engine's pipeline does it: planned
    (`weights/plan.py`, the one validator call) then converted (`weights/hf_device.py`)."""
    from hotswap.weights import hf_device, plan, readers
    from hotswap.weights.options import UpdateOptions

    options = UpdateOptions(partial=base is not None, check_finite=check_finite)
    checked = plan.plan(readers.read(tensors, cfg), cfg, abstract, options=options)
    return hf_device.hf_to_device(
        cfg, checked.tensors, checked.chosen, abstract, base=base, check_finite=check_finite
    )

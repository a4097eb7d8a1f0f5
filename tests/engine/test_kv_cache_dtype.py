"""`kv_cache_dtype`: the KV pages in a dtype of their own (vLLM's option), here bf16 pages under an
f32 model, as llama.cpp keeps 16-bit KV under f32 weights. The pool's bytes halve, HF's greedy
tokens stay, the C++ kernel reads the bf16 pages as the jnp reference does, an update keeps
the pages' dtype, and a dtype a kernel cannot read is a ConfigError naming why."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import hf_greedy

from hotswap import LLM, SamplingParams
from hotswap.errors import ConfigError
from hotswap.kernels.backend import Backend

PROMPTS = [list(range(10, 40)), list(range(50, 67)), [7, 300, 12, 99]]
NEW = 8
SP = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)


def _engine(tiny_dir, kv: str, attention: str) -> LLM:
    return LLM(tiny_dir, dtype="float32", kv_cache_dtype=kv, attention=attention, max_model_len=128,
               max_num_seqs=4, warmup=False)  # fmt: skip


def _run(llm: LLM) -> tuple[list[list[int]], np.ndarray]:
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, SP, use_tqdm=False)]
    lps = np.array([o.logprobs for o in outs], np.float64)  # each sampled token's log-prob
    return [o.token_ids for o in outs], lps


@pytest.fixture(scope="module")
def f32_run(tiny_dir):
    llm = _engine(tiny_dir, "auto", "cpu")
    return llm.engine.state.kv.nbytes, _run(llm)


@pytest.mark.parametrize("attention", ["cpu", "reference"])
def test_bf16_pages_under_an_f32_model(tiny_dir, f32_run, attention):
    llm = _engine(tiny_dir, "bfloat16", attention)
    kv = llm.engine.state.kv
    assert {str(p.dtype) for p in kv.pages} == {"bfloat16"}
    assert kv.nbytes * 2 == f32_run[0]  # the same pages, half the bytes
    tokens, lps = _run(llm)
    assert tokens == hf_greedy(tiny_dir, PROMPTS, NEW) == f32_run[1][0]
    # K/V rounded to bf16 (8 bits) moves a token's log-prob by ~1e-4 here
    np.testing.assert_allclose(lps, f32_run[1][1], atol=2e-3)
    assert not np.array_equal(lps, f32_run[1][1])  # the pages really are bf16
    # an update empties the cache into pages of the same dtype
    version = llm.update_weights(tiny_dir)
    assert version == 2 and {str(p.dtype) for p in llm.engine.state.kv.pages} == {"bfloat16"}
    assert _run(llm)[0] == tokens


def test_the_cpu_kernel_reads_bf16_pages_as_the_reference_does(tiny_dir):
    got = {a: _run(_engine(tiny_dir, "bfloat16", a)) for a in ("cpu", "reference")}
    assert got["cpu"][0] == got["reference"][0]
    # on AVX512_BF16 the kernel also rounds each pair of softmax weights to bf16 for vdpbf16ps
    # (kernels/cpu_attention.py): ~1e-4 here, as much as the pages' own rounding
    np.testing.assert_allclose(got["cpu"][1], got["reference"][1], atol=5e-4)


def test_a_dtype_the_kernel_cannot_read_is_refused(tiny_dir):
    with pytest.raises(ConfigError, match="C\\+\\+ CPU kernels read float32 or bfloat16 pages"):
        _engine(tiny_dir, "float16", "cpu")
    with pytest.raises(
        ConfigError, match="kv_cache_dtype='fp8'; use one of auto, float32, bfloat16, float16"
    ):
        _engine(tiny_dir, "fp8", "cpu")
    with pytest.raises(ConfigError, match="Pallas kernel reads its pages in the queries' dtype"):
        Backend.choose("pallas", head_dim=64, dtype="bfloat16", kv_dtype="float32")
    # "auto" takes the jnp reference where the C++ kernels cannot read the pages
    assert Backend.choose("auto", head_dim=64, dtype="float32", kv_dtype="float16").attention == "reference"
    assert Backend.choose("auto", head_dim=64, dtype="float32", kv_dtype="bfloat16").attention == "cpu"

"""Weights served quantized (`quantization`: int8, GGUF blocks, fp8) and re-quantized at every
update, through `LLM`: the tiny seeded checkpoints and a tiny GGUF written in Q8_0/Q4_0/Q4_1
blocks by the `gguf` package (llama.cpp's own writer and quantizer)."""

from __future__ import annotations

import shutil

import gguf
import jax
import ml_dtypes
import numpy as np
import pytest

from hotswap import LLM, SamplingParams
from hotswap.api.protocol import version_fields
from hotswap.checkpoint import hf
from hotswap.engine.outputs import CompletionOutput
from hotswap.errors import ConfigError, NonFiniteWeights
from hotswap.kernels import qtensor
from hotswap.kernels.qtensor import QTensor
from tests.support.gguf_files import Q, write_gguf

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
ENGINE = dict(num_pages=64, max_model_len=128, max_num_seqs=4, warmup=False)


def _tokens(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb, strict=True)
    )


def _bf16_tree(model_dir):
    """The checkpoint's tensors as bf16 numpy: a trainer's bf16 update, HF-named."""
    return {
        n: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)
        for n, a in hf.read_hf_tensors(model_dir).items()
    }


def test_a_bf16_update_into_an_int8_engine_is_a_fresh_engine_on_those_weights(tiny_dir, tiny_dir_b):
    llm = LLM(str(tiny_dir), quantization="int8", dtype="bfloat16", **ENGINE)
    wq = llm.params["layers"][0]["wq"]
    assert isinstance(wq, QTensor) and wq.data.dtype == np.int8 and wq.scales.shape == (1, *wq.shape[1:])
    assert not isinstance(llm.params["embed"], QTensor)  # the embedding stays in the model's dtype
    _tokens(llm)  # fills the prefix cache under version 1
    llm.update_weights(_bf16_tree(tiny_dir_b))
    assert llm.state.weights_version == 2
    assert llm.state.prefix.num_cached == 0
    fresh = LLM(str(tiny_dir_b), quantization="int8", dtype="bfloat16", **ENGINE)
    assert _leaves_equal(llm.params, fresh.params)  # the same bits, quantized on the way in
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _tokens(fresh)
    assert outs[0].outputs[0].quantization == {2: "int8"}
    assert outs[0].num_cached_tokens == 0  # nothing cached under version 1 is served


def test_int8_group_scales_follow_the_group_size(tiny_dir):
    llm = LLM(str(tiny_dir), quantization="int8", quantization_group_size=32, **ENGINE)
    w = llm.params["layers"][0]["w_down"]  # [F=128, D]: 4 groups of 32 inputs
    assert w.scales.shape == (4, w.shape[1])
    dense = LLM(str(tiny_dir), **ENGINE).params["layers"][0]["w_down"]
    err = np.abs(np.asarray(qtensor.dequantize(w)) - np.asarray(dense))
    assert err.max() <= np.abs(np.asarray(dense)).max() / 127  # half a step of the coarsest scale, twice
    before = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert before[0].outputs[0].quantization == {1: "int8-g32"}
    llm.sleep(level=1)  # the QTensors go to host memory and come back as they were
    llm.wakeup()
    assert _leaves_equal(llm.params["layers"][0]["w_down"], w)
    assert _tokens(llm) == [o.outputs[0].token_ids for o in before]


@pytest.mark.parametrize(
    ("options", "names"),
    [
        (dict(quantization="int4"), "int4"),
        (dict(quantization="int8", quantization_group_size=48), "layers.0.w_down's input size 128"),
        (dict(quantization="fp8"), "fp8 matmuls"),
        (dict(quantization="gguf"), "not a .gguf file"),
        (dict(quantization_group_size=32), "quantization='int8'"),
        (dict(quantization="int8", deterministic=True), "deterministic"),
    ],
)
def test_a_scheme_that_cannot_serve_is_refused_before_loading(tiny_dir, options, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.").replace("(", r"\(")):
        LLM(str(tiny_dir), **options, **ENGINE)


# ---- GGUF blocks served as they are ---------------------------------------------------------


def _mixed(name: str, a: np.ndarray):
    """Q8_0 token_embd, Q4_1 attention, Q4_0 MLP, F32 norms: one file, three block formats."""
    if a.ndim != 2:
        return a, Q.F32
    kind = Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1 if ".attn_" in name else Q.Q4_0
    return gguf.quants.quantize(a, kind), kind


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dir, tmp_path_factory):
    return write_gguf(tiny_dir, tmp_path_factory.mktemp("q") / "tiny-mixed.gguf", encode=_mixed)


def test_gguf_blocks_serve_what_their_dequantized_model_serves(tiny_gguf):
    blocks = LLM(str(tiny_gguf), quantization="gguf", dtype="float32", **ENGINE)
    layer = blocks.params["layers"][0]
    assert (layer["wq"].fmt, layer["w_up"].fmt, blocks.params["embed"].fmt) == ("q4_1", "q4_0", "q8_0")
    assert layer["wq"].data.dtype == np.uint8
    dense = LLM(str(tiny_gguf), dtype="float32", **ENGINE)
    for name in ("wq", "wk", "w_down"):  # q/k rows unpermuted as the dense load does
        np.testing.assert_array_equal(
            np.asarray(qtensor.dequantize(layer[name])), np.asarray(dense.params["layers"][0][name])
        )
    p_blocks = blocks.score(PROMPTS[0], [11, 12, 13])
    p_dense = dense.score(PROMPTS[0], [11, 12, 13])
    np.testing.assert_allclose(np.asarray(p_blocks), np.asarray(p_dense), atol=1e-4)
    assert _tokens(blocks) == _tokens(dense)
    assert blocks.generate(PROMPTS, GREEDY, use_tqdm=False)[0].outputs[0].quantization == {
        1: "gguf:q4_0+q4_1+q8_0"
    }


def test_gguf_updates_keep_their_blocks_and_a_nan_scale_is_refused(tiny_gguf, tiny_dir_b, tmp_path):
    llm = LLM(str(tiny_gguf), quantization="gguf", dtype="float32", **ENGINE)
    before = _tokens(llm)
    # A block's f16 scale set to NaN: refused naming the tensor, nothing serving changes.
    bad = tmp_path / "nan-scale.gguf"
    shutil.copy(tiny_gguf, bad)
    reader = gguf.GGUFReader(str(bad), "r+")
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    t.data[3, 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)  # block 0's d of output row 3
    reader.data.flush()
    del reader, t
    with pytest.raises(NonFiniteWeights, match="mlp.down_proj"):
        llm.update_weights(str(bad))
    assert llm.state.weights_version == 1 and _tokens(llm) == before
    # The same file again: a new version, its blocks kept as they are.
    llm.update_weights(str(tiny_gguf))
    assert llm.state.weights_version == 2 and llm.params["layers"][0]["wq"].fmt == "q4_1"
    assert _tokens(llm) == before
    # Full-precision weights into a GGUF-served engine: checked, then quantized to Q8_0 blocks.
    llm.update_weights(str(tiny_dir_b))
    assert llm.state.weights_version == 3 and llm.params["layers"][0]["wq"].fmt == "q8_0"
    assert llm.generate(PROMPTS, GREEDY, use_tqdm=False)[0].outputs[0].quantization == {3: "gguf:q8_0"}


def test_the_wire_names_each_versions_quantization():
    comp = CompletionOutput(
        0, "ab", [5, 6, 7], [0.0] * 3, [1, 1, 2], quantization={1: "gguf:q4_1+q8_0", 2: "gguf:q8_0"}
    )
    fields = version_fields(comp)
    assert fields["quantization"] == "gguf:q8_0"  # the last token's version
    assert [s["quantization"] for s in fields["weights_version_spans"]] == ["gguf:q4_1+q8_0", "gguf:q8_0"]
    assert "quantization" not in version_fields(
        CompletionOutput(0, "a", [5], [0.0], [1], quantization={1: None})
    )

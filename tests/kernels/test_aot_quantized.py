"""`hotswap aot --quantization int8`: int8 matmul weights through the TPU programs, compiled
for v5e by libtpu on this CPU, and the per-chip accounting that sizes the KV cache from them.

One compile: a 2-layer Llama with head_dim 128 (the Pallas kernel's lane groups) and 8 kv
heads on v5e:2x4 at TP 8, its largest decode step. The bf16 side of each comparison is the
same accounting without a compile (the step's temporaries taken from the int8 compile).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from helpers import hf_to_device

from hotswap.checkpoint import hf
from hotswap.checkpoint.create import create_checkpoint
from hotswap.errors import ConfigError
from hotswap.kernels.qtensor import is_qtensor
from hotswap.model.config import ModelConfig
from hotswap.model.params import abstract_params
from hotswap.programs import catalog, kv_sizing, tpu_slice
from hotswap.weights import quantize

GIB = 2**30
# 8 query and 8 kv heads of 128, every matmul 1,024 x 1,024, a 1,024-token vocabulary
SMALL = {
    "hidden_size": 1024,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
ENGINE = dict(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=512)
V5E_8 = dict(topology="v5e:2x4", tensor_parallel_size=8, buckets="decode")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("aot_quantized") / "small.json"  # a preset file: `hotswap aot PATH`
    path.write_text(json.dumps(SMALL))
    return str(path)


@pytest.mark.slow
def test_int8_compiles_for_v5e_8_with_int8_matmuls_and_more_kv(small):
    acfg = tpu_slice.AotConfig(quantization="int8", **V5E_8, **ENGINE)
    report = tpu_slice.compile_for(small, acfg)
    assert report["quantization"] == "int8" and report["dtype"] == "bfloat16"
    assert report["attention"] == "pallas" and report["fits"] and report["update_fits"], report
    (step,) = [s for s in report["steps"] if s["name"].startswith("decode")]
    # Attention is still the Pallas kernel, one call a layer, the cache donated and never copied;
    # every matmul (7 a layer and the LM head) multiplies int8 by int8 into int32 on the MXU.
    assert step["pallas_calls"] == 2 and step["kv_copies"] == 0, step
    assert step["alias_bytes"] >= report["kv_cache_bytes_per_chip"], step
    assert step["matmuls"] == {"s8 x s8 -> s32": 15}, step
    # An update quantizes each tensor as it converts it: that program too, per shape and sharding.
    quantizers = {s["name"] for s in report["steps"] if s["name"].startswith("update quantize")}
    assert quantizers == {f"update quantize {d}" for d in ("1024x1024", "1024x8x128", "8x128x1024")}
    assert "int8 weights" in tpu_slice.table(report)

    # The same model in bf16 on the same chips, by the same accounting.
    devices = tpu_slice.topology_devices("v5e:2x4")
    mcfg = tpu_slice.load_model_config(small, "bfloat16")
    bf16 = catalog.weights_per_chip(mcfg, catalog.Target.first_chips(mcfg, "auto", devices, 8), "auto")
    # Per chip, int8 keeps an eighth of the 15 quantized matrices at 1 byte an element instead
    # of 2, and adds their f32 scales: one per output column, split with the columns of q, k,
    # v, gate, up and the head, whole on every chip for o and down (their outputs are not split).
    scales = 2 * (5 * 1024 * 4 // 8 + 2 * 1024 * 4) + 1024 * 4 // 8
    assert report["params_bytes_per_chip"] == bf16.params - 15 * 2**20 // 8 + scales
    # An update's tensors arrive at full precision: the same reserve beside the params ...
    assert report["update_reserve_bytes_per_chip"] == bf16.reserve
    # ... so the cache gets what int8 saves: one page is 2 layers x 16 tokens x K,V x 128 x bf16.
    page = kv_sizing.page_bytes(mcfg, 16, 8)
    assert page == 2 * 16 * 2 * 128 * 2
    bf16_pages = kv_sizing.pages_that_fit(16 * GIB, 0.9, bf16, report["step_temp_bytes"], page)
    saved = bf16.params - report["params_bytes_per_chip"]
    assert saved // page <= report["num_pages"] - bf16_pages <= saved // page + 1, (
        report["num_pages"],
        bf16_pages,
    )
    # A decode step reads the params and 32 rows x 1,024 tokens of K/V: fewer bytes, more tokens/s.
    kv_read = 32 * 1024 * page // 16
    assert report["decode_bytes_read_per_chip"] == report["params_bytes_per_chip"] + kv_read
    assert report["est_decode_tok_s"] > round(32 * 819e9 / (bf16.params + kv_read), 1)


def test_fp8_is_refused_on_v5e(small):
    with pytest.raises(ConfigError, match=r"fp8 matmuls .* this is TPU v5 lite \(tpu\): use 'int8'"):
        tpu_slice.compile_for(small, tpu_slice.AotConfig(quantization="fp8", **V5E_8, **ENGINE))


def test_a_group_size_that_does_not_divide_a_row_is_refused_naming_it(small):
    acfg = tpu_slice.AotConfig(quantization="int8", quantization_group_size=384, **V5E_8, **ENGINE)
    with pytest.raises(
        ConfigError, match=r"quantization_group_size=384 does not divide layers\.0\.\w+'s input size 1024"
    ):
        tpu_slice.compile_for(small, acfg)


def test_an_unknown_quantization_is_refused(small):
    with pytest.raises(ConfigError, match="int4"):
        tpu_slice.compile_for(small, tpu_slice.AotConfig(quantization="int4", **V5E_8, **ENGINE))
    # gguf serves a GGUF file's blocks: a config.json or preset has none
    with pytest.raises(ConfigError, match="not a .gguf"):
        tpu_slice.compile_for(small, tpu_slice.AotConfig(quantization="gguf", **V5E_8, **ENGINE))


def test_an_update_is_quantized_tensor_by_tensor(tmp_path):
    """The reserve above holds only the tensors in flight at full precision: the HF conversion
    quantizes each quantized row as it converts it (the tied head too), to the same values the
    whole-tree quantize step gives."""
    d = create_checkpoint(tmp_path / "tied", seed=5, overrides={"tie_word_embeddings": True})
    cfg = dataclasses.replace(ModelConfig.from_dir(d), quantization="int8", quantization_group_size=32)
    tensors = hf.read_hf_tensors(d)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev), abstract_params(cfg)
    )
    got = hf_to_device(cfg, tensors, abstract)
    want = quantize.serve(cfg, hf.params_from_hf(cfg, tensors))
    assert is_qtensor(got["lm_head"]) and is_qtensor(got["layers"][0]["wq"]) and not is_qtensor(got["embed"])
    flat_got = jax.tree_util.tree_leaves_with_path(got, is_leaf=is_qtensor)
    flat_want = jax.tree_util.tree_leaves_with_path(want, is_leaf=is_qtensor)
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
    for (path, a), (_, b) in zip(flat_got, flat_want, strict=True):
        assert is_qtensor(a) == is_qtensor(b), path
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))

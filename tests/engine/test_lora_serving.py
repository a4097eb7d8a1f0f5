"""LoRA adapters served by name (`enable_lora`): one batch mixing the base model and two
adapters equals HF transformers + PEFT per row; loading writes fixed-shape buffers (no step
recompiles); the prefix cache is keyed by (adapter, adapter version); bad adapters get typed
errors naming the problem while serving goes on unchanged."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from helpers import KNOBS, count_compiles
from lora_helpers import make_adapter, peft_logprobs

from hotswap import LLM, LoRARequest, SamplingParams
from hotswap.checkpoint import payload
from hotswap.checkpoint.create import create_checkpoint
from hotswap.checkpoint.safetensors_io import read_safetensors
from hotswap.engine.adapters import AdapterError, AdapterNotFound
from hotswap.errors import LifecycleConflict, PickleRefused, WeightsMismatch

PROMPTS = [[1, 17, 42, 99, 7], [2, 5, 9], [1, 17, 42, 99, 7, 8], [3, 4, 250]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
LONG = list(range(10, 50))  # 40 tokens: two full 16-token pages to cache


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serving")
    return {
        "a": make_adapter(tiny_dir, root / "a", seed=11),
        "b": make_adapter(tiny_dir, root / "b", seed=12, rank=4, alpha=4.0, targets=["q_proj", "down_proj"]),
        "c": make_adapter(tiny_dir, root / "c", seed=13),
        "wide": make_adapter(tiny_dir, root / "wide", seed=14, rank=16, alpha=16.0),
        "root": root,
    }


@pytest.fixture(scope="module")
def llm(tiny_dir, adapters):
    return LLM(
        tiny_dir,
        dtype="float32",
        warmup=False,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        weights_root=str(adapters["root"]),
        **{**KNOBS, "max_num_seqs": 4},
    )


def _check_vs_peft(tiny_dir, prompts, requests, outs) -> float:
    worst = 0.0
    for p, r, o in zip(prompts, requests, outs, strict=True):
        c = o.outputs[0]
        want = peft_logprobs(tiny_dir, None if r is None else r.lora_path, [(p, c.token_ids)])[0]
        worst = max(worst, float(np.max(np.abs(np.asarray(c.logprobs) - want))))
    return worst


def test_a_batch_mixing_base_and_two_adapters_equals_peft(llm, tiny_dir, adapters):
    """Each row's greedy tokens' log-probs are HF + PEFT's on the same tokens (f32, 1e-4), the
    adapter alone and in one batch with the base model and the other adapter."""
    a = LoRARequest("a", 1, str(adapters["a"]))
    b = LoRARequest("b", 2, str(adapters["b"]))
    alone = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=a)
    assert _check_vs_peft(tiny_dir, PROMPTS[:1], [a], alone) <= 1e-4
    mixed = [None, a, a, b]
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=mixed)
    assert _check_vs_peft(tiny_dir, PROMPTS, mixed, outs) <= 1e-4
    assert (
        outs[1].outputs[0].token_ids
        != llm.generate(PROMPTS[1:2], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    )
    assert {x.name: x.rank for x in llm.engine.lora_adapters()} == {"a": 8, "b": 4}


def test_loading_an_adapter_never_recompiles_a_step(llm, adapters):
    """Buffers are [max_loras * max_lora_rank] wide: reloading an adapter (another rank in the
    same slot) and serving it compile nothing once the shapes ran."""
    reqs = [None, LoRARequest("a", 1, str(adapters["a"])), None, LoRARequest("b", 2, str(adapters["b"]))]
    llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=reqs)
    llm.load_lora_adapter("b", str(adapters["c"]))  # rank 8 where rank 4 was: the write program compiles once
    with count_compiles() as n:
        llm.load_lora_adapter("a", str(adapters["c"]))
        llm.load_lora_adapter("a", str(adapters["a"]))
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=reqs[:3] + [LoRARequest("b", 2, "")])
    assert n() == 0


def _cached(llm, name: str | None) -> int:
    req = LoRARequest(name, 0, "") if name else None
    out = llm.generate([LONG], SamplingParams(max_tokens=1), use_tqdm=False, lora_request=req)
    return out[0].num_cached_tokens


def test_prefix_cache_is_keyed_by_adapter_and_its_version(llm, adapters):
    """A prefix cached under A is not reused by B, nor by A after A's reload; B's survives it."""
    llm.load_lora_adapter("a", str(adapters["a"]))
    llm.load_lora_adapter("b", str(adapters["b"]))
    llm.reset_prefix_cache()
    assert _cached(llm, "a") == 0
    assert _cached(llm, "a") == 32  # two full pages, under A
    assert _cached(llm, "b") == 0  # not A's
    assert _cached(llm, None) == 0  # nor the base's
    assert _cached(llm, "b") == 32
    version = {x.name: x.version for x in llm.engine.lora_adapters()}["a"]
    llm.load_lora_adapter("a", str(adapters["a"]))  # the same adapter, reloaded: a new version
    assert {x.name: x.version for x in llm.engine.lora_adapters()}["a"] == version + 1
    assert _cached(llm, "a") == 0  # A's old pages do not match its new version
    assert _cached(llm, "b") == 32  # B's survive A's reload
    st = llm.engine.state
    ids = {tuple(x) for x in st.prefix.adapter[st.prefix.key != 0].tolist()}
    assert len(ids) == 4  # (0,0) base, A's old and new versions, B: every entry records its adapter


def _bad_dirs(adapters, tmp):
    a = adapters["a"]
    config = json.loads((a / "adapter_config.json").read_text())
    tensors = dict(read_safetensors(a / "adapter_model.safetensors"))

    def write(name, tensors=tensors, config=config, pickled=False):
        d = tmp / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps(config))
        if pickled:
            (d / "adapter_model.bin").write_bytes(pickle.dumps(tensors))
        else:
            (d / "adapter_model.safetensors").write_bytes(payload.encode_safetensors(tensors))
        return str(d)

    q = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    return {
        "rank": (str(adapters["wide"]), WeightsMismatch, "rank 16 is above max_lora_rank=8"),
        "module": (
            write("module", config={**config, "target_modules": ["embed_tokens"]}),
            WeightsMismatch,
            "embed_tokens",
        ),
        "model": (
            write("model", {**tensors, q: np.zeros((8, 96), np.float32)}),
            WeightsMismatch,
            "another model",
        ),
        "pickle": (write("pickle", pickled=True), PickleRefused, "never unpickled"),
    }


def test_bad_adapters_refused_with_serving_unchanged(llm, adapters):
    tmp = adapters["root"] / "bad"  # under the engine's weights root
    tmp.mkdir()
    llm.load_lora_adapter("a", str(adapters["a"]))
    llm.load_lora_adapter("b", str(adapters["b"]))
    reqs = [None, LoRARequest("a", 1, ""), None, LoRARequest("b", 2, "")]
    before = [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=reqs)
    ]
    loaded = {(x.name, x.version) for x in llm.engine.lora_adapters()}
    for name, (path, error, match) in _bad_dirs(adapters, tmp).items():
        with pytest.raises(error, match=match):
            llm.load_lora_adapter("a", path)
        assert {(x.name, x.version) for x in llm.engine.lora_adapters()} == loaded, name
    with pytest.raises(AdapterError, match="max_loras=2"):
        llm.load_lora_adapter("third", str(adapters["c"]))
    with pytest.raises(AdapterNotFound):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("nope", 3, ""))
    after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=reqs)]
    assert after == before
    # A reload while a request of that adapter is in flight would change its slot under it: 409.
    llm.engine.add_request(None, PROMPTS[0], GREEDY, lora_name="a")
    with pytest.raises(LifecycleConflict, match="in flight"):
        llm.load_lora_adapter("a", str(adapters["a"]))
    while llm.engine.has_unfinished():
        llm.engine.step()


def test_gemma3_adapters_served_by_name_equal_peft(tmp_path):
    """Gemma's own layer (`model/gemma.py`: sandwich norms, GeGLU, windows) takes the same
    low-rank path: a Gemma 3 checkpoint (a sliding and a full layer, window 16) with an adapter
    on all seven projections, in one batch with the base model, equals HF + PEFT (f32, 1e-4) on
    prompts longer than the window."""
    base = create_checkpoint(
        tmp_path / "gemma3", preset="tiny", arch="gemma3", seed=5, overrides={"tie_word_embeddings": True}
    )
    adapter = make_adapter(base, tmp_path / "adapter", seed=21)
    llm = LLM(
        base,
        dtype="float32",
        warmup=False,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        weights_root=str(tmp_path),
        **{**KNOBS, "max_num_seqs": 2},
    )
    req = LoRARequest("g", 1, str(adapter))
    prompts = [list(range(3, 40)), list(range(5, 30))]  # 37 and 25 tokens: past the 16-token window
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[req, None])
    assert _check_vs_peft(base, prompts, [req, None], outs) <= 1e-4

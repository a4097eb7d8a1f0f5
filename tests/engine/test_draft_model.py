"""Speculative decoding with a separate draft checkpoint (speculative_config `{"method":
"draft_model", "model": <path>}`), on the tiny seeded checkpoints: the tokens are those of
decoding without speculation (greedy, seeded, chunked prefill, prefix hits, after updates of
either model); a draft equal to the target accepts nearly everything (its catch-up KV is right);
a draft cut from the target's first layer drafts what the self-draft of that layer drafts; the
draft has its own version, updated in place, refused with another vocabulary, over HTTP with
the admin key only; it sleeps and wakes with the target.
"""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from thread_server import serving

from hotswap import LLM, SamplingParams
from hotswap.api.server import create_app
from hotswap.checkpoint.create import create_checkpoint
from hotswap.errors import ConfigError

KNOBS = dict(
    max_model_len=512,
    max_num_seqs=64,
    max_num_batched_tokens=64,  # prompts past 64 tokens are prefilled (and caught up) in chunks
    num_pages=512,
    warmup=False,
)
K = 3
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, top_k=40, seed=4, ignore_eos=True)


def _spec(model) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": K}


def _prompts() -> list[list[int]]:
    """A looping prompt, a short one, a chunked one (150 tokens: its draft catches up over three
    steps before it drafts), a random one past the budget."""
    rng = np.random.default_rng(0)
    loop = [17, 40, 99, 5, 230]
    return [loop * 4, [7, 8, 9, 10, 7, 8, 9, 10, 7], (loop * 30)[:150], rng.integers(4, 512, 90).tolist()]


def _run(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _first_layer(src, out):
    """A checkpoint of `src`'s first layer, its norm and head: the self-draft of one layer, as
    a separate checkpoint."""
    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    tensors = load_file(src / "model.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith("model.layers.1.")}, out / "model.safetensors"
    )
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    return out


@pytest.fixture(scope="module")
def drafts(weights_root, tiny_dir):
    """Draft checkpoints under the suite's weights root (the route reads them there): the
    target's first layer, a 1-layer seeded one, and one with a 384-token vocabulary."""
    root = weights_root / "drafts"
    if not root.exists():
        root.mkdir()
        _first_layer(tiny_dir, root / "layer0")
        create_checkpoint(
            root / "seed2", preset="tiny", arch="llama", seed=2, overrides={"num_hidden_layers": 1}
        )
        create_checkpoint(
            root / "vocab384", preset="tiny", arch="llama", seed=0, overrides={"vocab_size": 384}
        )
    return {name: root / name for name in ("layer0", "seed2", "vocab384")}


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return LLM(tiny_dir, **KNOBS)


@pytest.fixture(scope="module")
def spec(tiny_dir, drafts):
    """The target drafted for by its own first layer, a separate checkpoint."""
    return LLM(tiny_dir, speculative_config=_spec(drafts["layer0"]), **KNOBS)


def _same(want, got):
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert g.weights_versions == w.weights_versions
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)


def test_tokens_equal_decoding_without_speculation(plain, spec):
    """Greedy and seeded; chunked prefill and chunked catch-up; round 2 hits the prefix cache
    (the draft recomputes its own KV from position 0 for every new sequence)."""
    prompts = _prompts()
    before = dict(spec.engine.stats)
    for round_ in range(2):
        if round_ == 1:
            assert spec.engine.stats["cached_tokens"] > before["cached_tokens"]
        for params in (GREEDY, SEEDED):
            got = _run(spec, prompts, params)
            _same(_run(plain, prompts, params), got)
            assert all(g.num_drafts and g.draft_versions == [1] for g in got)
    stats = spec.engine.stats
    accepted = stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    drafted = stats["spec_draft_tokens"] - before["spec_draft_tokens"]
    print(f"\nfirst-layer draft: {accepted}/{drafted} accepted")
    assert 0 < accepted < drafted
    spec.engine.check_invariants()
    assert spec.engine.state.pool.usage(spec.engine.state.prefix)["owned"] == 0


def test_a_draft_equal_to_the_target_accepts_nearly_everything(plain, tiny_dir):
    """The target as its own draft: at greedy, a draft token is rejected only where the draft's
    KV differs from the target's, so a near-total acceptance shows the catch-up KV is right:
    chunked catch-up of the 150- and 90-token prompts, and a pool of 34 pages, so sequences
    are preempted and readmitted (on prefix hits and new pages) while they draft. n = 2
    samples share their prompt's pages (a fork): the tokens are still decoding's."""
    same = LLM(tiny_dir, speculative_config=_spec(tiny_dir), **{**KNOBS, "num_pages": 34})
    prompts = _prompts() * 3
    got = _run(same, prompts, GREEDY)
    _same(_run(plain, prompts, GREEDY), got)
    stats = same.engine.stats
    rate = stats["spec_accepted_tokens"] / stats["spec_draft_tokens"]
    preempted = same.engine.sched.num_preemptions
    print(
        f"\ndraft = target: acceptance {rate:.3f} of {stats['spec_draft_tokens']} drafted, {preempted} preemptions"
    )
    assert rate > 0.9 and preempted > 0
    forks = SamplingParams(n=2, max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)
    want, got = (llm.generate(prompts[:2], forks, use_tqdm=False) for llm in (plain, same))
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert all(c.num_drafts for o in got for c in o.outputs)
    same.engine.check_invariants()


def test_packed_prefill_backends(tiny_dir):
    """The reference attention (no ragged steps: a catch-up chunk goes through a packed
    prefill call, drafted rows through decode calls) gives decoding's tokens and, with the
    target as its draft, near-total acceptance (the 150-token prompt catches up in chunks)."""
    knobs = {**KNOBS, "attention": "reference"}
    prompts = [_prompts()[0], _prompts()[2]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    same = LLM(tiny_dir, speculative_config=_spec(tiny_dir), **knobs)
    got = _run(same, prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in _run(LLM(tiny_dir, **knobs), prompts, params)]
    stats = same.engine.stats
    assert stats["spec_accepted_tokens"] > 0.9 * stats["spec_draft_tokens"] > 0, stats
    same.engine.check_invariants()


def test_a_cut_checkpoint_drafts_as_the_self_draft_does(spec, tiny_dir):
    """The target's first layer as a checkpoint accepts what the self-draft of that layer
    (which reads the target's own KV) accepts: the draft's own KV is that layer's KV."""
    self_draft = LLM(
        tiny_dir,
        speculative_config={
            "method": "draft_model",
            "model": "self",
            "draft_layers": 1,
            "num_speculative_tokens": K,
        },
        **KNOBS,
    )
    prompts = _prompts()[:2]  # short: both draft from their first decode step
    counts = []
    for llm in (self_draft, spec):
        got = _run(llm, prompts, GREEDY)
        counts.append([(g.num_drafts, g.num_accepted_tokens) for g in got])
    print(f"\n(drafts, accepted) per prompt: self {counts[0]}, checkpoint {counts[1]}")
    assert counts[0] == counts[1]


def test_a_draft_update_bumps_the_draft_version_only(plain, spec, drafts, tiny_dir, tiny_dir_b):
    """`update_weights(..., draft=True)` swaps the draft in place: its version + 1, the
    target's version and cache untouched, the tokens still decoding's. A policy update leaves
    the draft (and its version) and forgets its KV: the tokens are still decoding's."""
    engine = spec.engine
    v, cached = engine.weights_version, engine.state.prefix.num_cached
    assert engine.draft_version == 1
    assert spec.update_weights(str(drafts["seed2"]), draft=True) == 2
    assert (engine.weights_version, engine.state.prefix.num_cached) == (v, cached)
    got = _run(spec, _prompts(), SEEDED)
    _same(_run(plain, _prompts(), SEEDED), got)
    assert {tuple(g.draft_versions) for g in got} == {(2,)}

    assert spec.update_weights(str(drafts["layer0"]), draft=True) == 3
    for llm in (plain, spec):
        llm.update_weights(str(tiny_dir_b))
    assert engine.draft_version == 3
    _same(_run(plain, _prompts(), GREEDY), _run(spec, _prompts(), GREEDY))
    for llm in (plain, spec):
        llm.update_weights(str(tiny_dir))
    with pytest.raises(ConfigError, match="update options"):
        spec.update_weights(str(drafts["layer0"]), draft=True, policy="abort")
    engine.check_invariants()


def test_another_vocabulary_is_refused(tiny_dir, spec, drafts):
    """At load and at a draft update, naming both sizes; the serving draft is unchanged."""
    with pytest.raises(ConfigError, match="vocab_size 384, the target has 512"):
        LLM(tiny_dir, speculative_config=_spec(drafts["vocab384"]), **KNOBS)
    v = spec.engine.draft_version
    with pytest.raises(ConfigError, match="vocab_size 384, the target has 512"):
        spec.update_weights(str(drafts["vocab384"]), draft=True)
    assert spec.engine.draft_version == v
    with pytest.raises(ConfigError, match="no draft checkpoint"):
        LLM(tiny_dir, **KNOBS).update_weights(str(drafts["layer0"]), draft=True)
    with pytest.raises(ConfigError, match="draft_layers is for model"):
        LLM(tiny_dir, speculative_config={**_spec(drafts["layer0"]), "draft_layers": 1}, **KNOBS)


@pytest.mark.parametrize("level", [1, 2])
def test_the_draft_sleeps_and_wakes_with_the_target(plain, spec, tiny_dir, level):
    """Its params and KV follow the target's: after a wakeup it drafts (and is accepted) again."""
    spec.sleep(level)
    assert spec.engine.draft_model.pages is None
    spec.wakeup(["weights"])
    if level == 2:  # the target's weights were dropped: an update brings them back
        spec.update_weights(str(tiny_dir))
        plain.update_weights(str(tiny_dir))
    spec.wakeup(["kv_cache"])
    before = dict(spec.engine.stats)
    _same(_run(plain, _prompts()[:2], GREEDY), _run(spec, _prompts()[:2], GREEDY))
    assert spec.engine.stats["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    spec.engine.check_invariants()


# ---- over HTTP ----------------------------------------------------------------------------

API_KEY, ADMIN_KEY = "k-draft", "a-draft"


@pytest.fixture(scope="module")
def served(spec, weights_root):
    """The speculating engine behind a real server on 127.0.0.1 (uvicorn), paths under the
    suite's weights root."""
    app = create_app(spec.engine, api_key=API_KEY, admin_key=ADMIN_KEY, weights_root=str(weights_root))
    with serving(app) as base, httpx.Client(base_url=base, timeout=60) as http:
        yield http


def test_the_draft_route_takes_the_admin_key(served, spec):
    """`POST /update_weights {"path", "draft": true}`: 403 with the api key, nothing changed;
    with the admin key the draft's version + 1, the target's as it was; `/get_model_info` and a
    completion's `usage.spec_decode` report it; a bad vocabulary is a 400 naming both sizes."""
    engine = spec.engine
    body = {"path": "drafts/seed2", "draft": True}
    v, draft_v = engine.weights_version, engine.draft_version
    denied = served.post("/update_weights", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert denied.status_code == 403 and engine.draft_version == draft_v
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    ok = served.post("/update_weights", json=body, headers=admin)
    assert ok.status_code == 200, ok.text
    assert ok.json() == {"draft_version": draft_v + 1, "weights_version": v}
    assert served.get("/get_model_info", headers=admin).json()["draft_version"] == draft_v + 1

    bad = served.post("/update_weights", json={"path": "drafts/vocab384", "draft": True}, headers=admin)
    assert bad.status_code == 400 and "vocab_size 384" in bad.text, bad.text
    extra = served.post("/update_weights", json={**body, "policy": "abort"}, headers=admin)
    assert extra.status_code == 400 and "no update options" in extra.text, extra.text
    assert engine.draft_version == draft_v + 1

    auth = {"Authorization": f"Bearer {API_KEY}"}
    loop = " ".join(["a b c d"] * 8)
    done = served.post(
        "/v1/completions",
        json={
            "model": served.get("/v1/models", headers=auth).json()["data"][0]["id"],
            "prompt": loop,
            "max_tokens": 24,
            "temperature": 0,
        },
        headers=auth,
    )
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["spec_decode"]["draft_versions"] == [draft_v + 1]
    engine.check_invariants()

"""`logprobs_mode` and the kept set end to end: `LLM.generate` on the tiny seeded checkpoint
(engine option and per-request override), then the same requests through a real
`hotswap serve` of that checkpoint: the official `openai` client (`extra_body`) on completions
and chat, a stream, SGLang's `/generate`, and bad values answered with a 400 naming the
allowed ones. Raw log-probs are checked against `LLM.score`; processed ones against their own
definition: with top-k 5 the 5 top entries are the whole kept set, so their probabilities sum
to 1 and the kept ids are exactly the top ids."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
from api_helpers import AUTH, MODEL, admin
from helpers import KNOBS

from hotswap import LLM, EngineArgs, SamplingParams
from hotswap.errors import ConfigError

PROMPT = "The orchard keeper counted the pears that fell in the night and"
TOP5 = dict(temperature=0.9, top_k=5, seed=11, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    """The served checkpoint in this process, processed log-probs by default (engine option)."""
    return LLM(tiny_dir, **KNOBS, warmup=False, logprobs_mode="processed_logprobs")


def _check_top5(token_ids, logprobs, tops, counts, kept_ids):
    for t, tok in enumerate(token_ids):
        assert counts[t] == len(kept_ids[t]) == 5 and tok in kept_ids[t]
        assert sorted(tops[t]) == sorted(kept_ids[t])  # the processed top entries: the kept set
        np.testing.assert_allclose(np.logaddexp.reduce(list(tops[t].values())), 0.0, atol=1e-5)
        np.testing.assert_allclose(logprobs[t], tops[t][tok], atol=1e-6)


def test_generate_reports_the_processed_distribution_and_its_kept_set(llm):
    ids = llm.engine.tokenizer.encode(PROMPT)
    sp = SamplingParams(**TOP5, logprobs=5, return_kept_set="ids")
    c = llm.generate([ids], sp, use_tqdm=False)[0].outputs[0]
    _check_top5(
        c.token_ids, c.logprobs, c.top_logprobs, c.kept_counts, [k.tolist() for k in c.kept_token_ids]
    )
    # The request's mode overrides the engine's: raw log-probs, those `score` returns, same tokens.
    raw = SamplingParams(**TOP5, logprobs=5, logprobs_mode="raw_logprobs", return_kept_set="mask")
    r = llm.generate([ids], raw, use_tqdm=False)[0].outputs[0]
    assert r.token_ids == c.token_ids and r.kept_counts == c.kept_counts and r.kept_token_ids is None
    np.testing.assert_allclose(r.logprobs, llm.score(ids, r.token_ids), atol=1e-5)
    assert all(lp < p for lp, p in zip(r.logprobs, c.logprobs, strict=True))  # top-5 mass < 1
    for words, kept in zip(r.kept_masks, c.kept_token_ids, strict=True):
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        np.testing.assert_array_equal(np.flatnonzero(bits), kept)
    # Greedy: processed == raw (no mask, no filter: vLLM's all-greedy batch); the kept set is the token.
    g = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, return_kept_set=True), use_tqdm=False)
    g = g[0].outputs[0]
    assert g.kept_counts == [1] * 4 and g.kept_token_ids is None and g.kept_masks is None
    np.testing.assert_allclose(g.logprobs, llm.score(ids, g.token_ids), atol=1e-5)


def test_an_unknown_engine_mode_is_a_typed_error():
    with pytest.raises(ConfigError, match="raw_logprobs, raw_logits, processed_logprobs, processed_logits"):
        EngineArgs(logprobs_mode="processed")


def test_the_openai_routes_carry_the_mode_and_the_kept_set(api_client, api_http, llm):
    ids = llm.engine.tokenizer.encode(PROMPT)
    want = llm.generate([ids], SamplingParams(**TOP5, logprobs=5, return_kept_set="ids"), use_tqdm=False)
    want = want[0].outputs[0]
    extra = {
        "top_k": 5,
        "logprobs_mode": "processed_logprobs",
        "return_kept_set": "ids",
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    r = api_client.completions.create(
        model=MODEL, prompt=ids, max_tokens=6, temperature=0.9, seed=11, logprobs=5, extra_body=extra
    )
    c = r.choices[0]
    tokens, kept = c.model_extra["token_ids"], c.model_extra["kept_token_ids"]
    tops = [{int(k.split(":")[1]): v for k, v in d.items()} for d in c.logprobs.top_logprobs]
    assert tokens == want.token_ids  # the same seeded draws as in this process
    _check_top5(tokens, c.logprobs.token_logprobs, tops, c.model_extra["kept_counts"], kept)
    np.testing.assert_allclose(c.logprobs.token_logprobs, want.logprobs, atol=1e-5)

    # Chat, the mask form: base64 of the packed words, the same sets as the ids.
    chat = api_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        temperature=0.9,
        seed=3,
        logprobs=True,
        top_logprobs=5,
        extra_body={"top_k": 5, "logprobs_mode": "processed_logprobs", "return_kept_set": "mask"},
    )
    ch = chat.choices[0]
    for entry, mask, count in zip(
        ch.logprobs.content, ch.model_extra["kept_masks"], ch.model_extra["kept_counts"], strict=True
    ):
        bits = np.unpackbits(np.frombuffer(base64.b64decode(mask), np.uint8), bitorder="little")
        assert bits.sum() == count == 5
        np.testing.assert_allclose(
            np.logaddexp.reduce([t.logprob for t in entry.top_logprobs]), 0.0, atol=1e-5
        )

    # A stream's chunks carry their tokens' counts: together, the whole choice's.
    body = {"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0.9, "seed": 11, "stream": True}
    body.update(extra)
    counts = []
    with api_http.stream("POST", "/v1/completions", json=body, headers=AUTH) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    counts += ch.get("kept_counts", [])
    assert counts == want.kept_counts


def test_filtered_top_entries_are_clamped_and_sglang_reports_counts(api_server, api_http):
    # top_k 2 with 4 top log-probs: two of them are -inf, sent as vLLM sends them (-9999.0).
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 1.0, "seed": 5, "top_k": 2}
    body.update(logprobs=4, logprobs_mode="processed_logprobs", return_kept_set="count")
    r = api_http.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["kept_counts"] == [2, 2]
    assert all(sorted(d.values())[:2] == [-9999.0, -9999.0] for d in c["logprobs"]["top_logprobs"])
    sampling = {"temperature": 0.7, "top_k": 3, "max_new_tokens": 3, "ignore_eos": True}
    sampling.update(logprobs_mode="processed_logits", return_kept_set="ids")
    g = httpx.post(
        f"{api_server.base}/generate",
        json={"text": PROMPT, "sampling_params": sampling, "return_logprob": True, "top_logprobs_num": 4},
        headers=admin(),
        timeout=60,
    )
    meta = g.json()["meta_info"]
    assert meta["kept_counts"] == [3, 3, 3] and [len(k) for k in meta["kept_token_ids"]] == [3, 3, 3]
    assert all(sorted(lp for lp, _, _ in top)[0] == -9999.0 for top in meta["output_top_logprobs"])


@pytest.mark.parametrize(
    "field, value, names",
    [
        ("logprobs_mode", "processed", "raw_logprobs, raw_logits, processed_logprobs, processed_logits"),
        ("return_kept_set", "all", "count, ids, mask"),
    ],
)
def test_bad_values_are_400s_naming_the_allowed_ones(api_server, api_http, field, value, names):
    r = api_http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, field: value}, headers=AUTH)
    assert r.status_code == 400 and names in r.json()["error"]["message"], r.text
    g = httpx.post(
        f"{api_server.base}/generate",
        json={"text": "x", "sampling_params": {field: value}},
        headers=admin(),
        timeout=60,
    )
    assert g.status_code == 400 and names in g.text, g.text

"""Prompt log-probs on every route of a real `hotswap serve`: OpenAI's `echo` + `logprobs` through the
official client (an eval harness's loglikelihood request included), vLLM's `prompt_logprobs` on
completions and chat, SGLang's `input_token_logprobs` / `input_top_logprobs`. Each equals
`LLM.score` of the same checkpoint in this process, with the prompt in the prefix cache or not
and over chunked prefill (the server's chunk is 16 tokens)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from api_helpers import ADMIN_KEY, AUTH, MODEL, SMOL, admin, openai_client
from helpers import KNOBS

from hotswap import LLM

# Not the other server tests' prompts: their first request must find an empty prefix cache.
PROMPT = (
    "A lighthouse keeper kept a logbook of the gulls that landed on the rail each evening, "
    "and of the ships that passed"
)


@pytest.fixture(scope="module")
def oracle(tiny_dir):
    """The served checkpoint in this process: `score` (the cache-free forward) and its tokenizer."""
    return LLM(tiny_dir, **KNOBS, warmup=False)


def _score(oracle: LLM, ids: list[int]) -> np.ndarray:
    return oracle.score(ids[:1], ids[1:])


def test_echo_logprobs_equal_score_with_and_without_a_prefix_hit(api_client, oracle):
    ids = oracle.engine.tokenizer.encode(PROMPT)
    assert len(ids) > 2 * KNOBS["max_num_batched_tokens"]  # spread over several steps
    want = _score(oracle, ids)
    plain = api_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    exact = {"return_tokens_as_token_ids": True, "return_token_ids": True}  # ids, not ambiguous strings
    for _ in range(2):  # the prompt is cached now: recomputed for its log-probs
        r = api_client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2, extra_body=exact
        )
        c = r.choices[0]
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert c.text.startswith(PROMPT + plain.choices[0].text)  # greedy: the same first tokens
        lp, gen = c.logprobs, c.model_extra["token_ids"]
        assert lp.tokens == [f"token_id:{t}" for t in ids + gen] and len(gen) == 3
        assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 3
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1 : len(ids)], want, atol=1e-5)
        for t in range(1, len(ids)):  # the prompt's token and the 2 likeliest
            assert (
                lp.top_logprobs[t][lp.tokens[t]] == lp.token_logprobs[t] and 2 <= len(lp.top_logprobs[t]) <= 3
            )
        np.testing.assert_allclose(lp.token_logprobs[len(ids) :], oracle.score(ids, gen), atol=1e-5)


def test_echo_with_max_tokens_0_returns_the_prompt_alone(api_client, api_http, oracle):
    ids = oracle.engine.tokenizer.encode(PROMPT)[:20]
    r = api_client.completions.create(
        model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0, temperature=0
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text == oracle.engine.tokenizer.decode(ids) and len(lp.tokens) == len(ids)
    np.testing.assert_allclose(lp.token_logprobs[1:], _score(oracle, ids), atol=1e-5)
    assert lp.top_logprobs is None  # logprobs=0: no alternatives
    assert lp.text_offset[0] == 0 and (np.diff(lp.text_offset) >= 0).all()
    bad = api_http.post("/v1/completions", json={"prompt": ids, "max_tokens": 0}, headers=AUTH)
    assert bad.status_code == 400 and "max_tokens" in bad.text


def test_echo_logprobs_stream_leads_with_the_prompt(api_client, oracle):
    ids = oracle.engine.tokenizer.encode(PROMPT)[:30]
    chunks = list(
        api_client.completions.create(
            model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True, logprobs=1, stream=True
        )
    )
    firsts = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs]
    echoed = oracle.engine.tokenizer.decode(ids)
    assert firsts[0].text.startswith(echoed)
    np.testing.assert_allclose(
        firsts[0].logprobs.token_logprobs[1 : len(ids)], _score(oracle, ids), atol=1e-5
    )
    # the generated tokens' offsets count the echoed prompt before them, in every chunk
    assert all(c.logprobs.text_offset[0] >= len(echoed) for c in firsts[1:] if c.logprobs.tokens)


def test_vllm_prompt_logprobs_on_completions_and_chat(api_http, oracle):
    ids = oracle.engine.tokenizer.encode(PROMPT)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}
    r = api_http.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    got = [plp[t][str(ids[t])]["logprob"] for t in range(1, len(ids))]
    np.testing.assert_allclose(got, _score(oracle, ids), atol=1e-5)
    for t in range(1, len(ids)):
        entry = plp[t]
        assert next(iter(entry)) == str(ids[t]) and 3 <= len(entry) <= 4
        assert sorted(e["rank"] for e in entry.values() if e["rank"] <= 3) == [1, 2, 3]
        tok = oracle.engine.tokenizer
        assert all(
            e["decoded_token"] == tok.decode([int(k)], skip_special_tokens=False) for k, e in entry.items()
        )
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}
    r = api_http.post("/v1/chat/completions", json={**chat, "return_token_ids": True}, headers=AUTH)
    assert r.status_code == 200, r.text
    prompt_ids, plp = r.json()["prompt_token_ids"], r.json()["prompt_logprobs"]
    got = [plp[t][str(prompt_ids[t])]["logprob"] for t in range(1, len(prompt_ids))]
    np.testing.assert_allclose(got, _score(oracle, prompt_ids), atol=1e-5)
    bad = api_http.post("/v1/completions", json={**body, "prompt_logprobs": 21}, headers=AUTH)
    assert bad.status_code == 400 and "prompt_logprobs" in bad.text


def test_sglang_input_token_logprobs(api_server, oracle):
    ids = oracle.engine.tokenizer.encode(PROMPT)[:40]
    want = _score(oracle, ids)
    sp = {"max_new_tokens": 2, "temperature": 0}
    for start in (0, 5):
        body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True, "logprob_start_len": start}
        body.update(top_logprobs_num=2, return_text_in_logprobs=True)
        meta = httpx.post(f"{api_server.base}/generate", json=body, headers=admin(), timeout=60).json()[
            "meta_info"
        ]
        inp = meta["input_token_logprobs"]
        # SGLang's: the tokens from `start`, the first one's log-prob null whatever `start` is
        assert [t for _, t, _ in inp] == ids[start:] and inp[0][0] is None
        np.testing.assert_allclose([lp for lp, _, _ in inp[1:]], want[start:], atol=1e-5)
        assert inp[1][2] == oracle.engine.tokenizer.decode([ids[start + 1]], skip_special_tokens=False)
        tops = meta["input_top_logprobs"]
        assert tops[0] is None and all(len(p) == 2 and p[0][0] >= p[1][0] for p in tops[1:])
        assert len(meta["output_top_logprobs"]) == len(meta["output_token_logprobs"]) == 2
    # SGLang's default start (-1): the last prompt token alone, and nothing recomputed for it
    body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True}
    meta = httpx.post(f"{api_server.base}/generate", json=body, headers=admin(), timeout=60).json()[
        "meta_info"
    ]
    assert meta["input_token_logprobs"] == [[None, ids[-1], None]]
    body["logprob_start_len"] = len(ids)
    r = httpx.post(f"{api_server.base}/generate", json=body, headers=admin(ADMIN_KEY), timeout=60)
    assert r.status_code == 400 and "logprob_start_len" in r.text


def test_loglikelihood_request_of_an_eval_harness_ranks_the_right_answer(smol_server):
    """lm-eval-harness's loglikelihood request shape: the context and continuation as one echoed
    prompt, logprobs=1, max_tokens=0, temperature 0; its score is the continuation tokens' sum."""
    client = openai_client(smol_server)
    context = "The capital of France is"

    def loglikelihood(continuation: str) -> float:
        n_ctx = len(
            client.completions.create(model=SMOL, prompt=context, max_tokens=0, echo=True, logprobs=1)
            .choices[0]
            .logprobs.tokens
        )
        r = client.completions.create(
            model=SMOL, prompt=context + continuation, max_tokens=0, echo=True, logprobs=1, temperature=0
        )
        lp = r.choices[0].logprobs
        assert lp.token_logprobs[0] is None and len(lp.tokens) > n_ctx
        for t in range(1, len(lp.tokens)):  # the greedy check lm-eval makes reads the top-1 here
            assert max(lp.top_logprobs[t].values()) >= lp.token_logprobs[t]
        return sum(lp.token_logprobs[n_ctx:])

    assert loglikelihood(" Paris") > loglikelihood(" banana")

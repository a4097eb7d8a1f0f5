"""Completions and chat completions through the official `openai` client on the shared
`api_server` (weights version 1): usage and the prefix cache, n/echo/logprobs, seeded sampling,
and the 4xx answers to requests that can never succeed."""

from __future__ import annotations

import openai
import pytest
from api_helpers import AUTH, MODEL, chat, complete


def test_completion_usage_and_prefix_cache(api_client):
    first = complete(api_client)
    assert first.model_extra["weights_version"] == 1
    assert first.choices[0].finish_reason in ("stop", "length")
    assert "weights_version_spans" not in first.choices[0].model_extra  # a single version
    u = first.usage
    assert u.prompt_tokens > 32 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0
    again = complete(api_client)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].text == first.choices[0].text


def test_completion_variants(api_client):
    ids = [5, 6, 7, 8, 9]
    r = complete(api_client, [ids, ids], max_tokens=4, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) == 1  # greedy: all samples agree
    assert r.usage.prompt_tokens == 10
    r = api_client.completions.create(model=MODEL, prompt=["Hello", "The capital"], max_tokens=3, logprobs=2)
    for c in r.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
    r = complete(api_client, "Hello there", max_tokens=3, echo=True)
    assert r.choices[0].text.startswith("Hello there")
    a, b = (complete(api_client, "Hello", max_tokens=6, temperature=0.9, seed=7) for _ in range(2))
    assert a.choices[0].text == b.choices[0].text  # seeded sampling is reproducible


def test_seed_reproducibility(api_client):
    """temperature 1: the same seed gives the same text, another seed another text."""
    kw = {"max_tokens": 12, "temperature": 1.0}
    a, b, c = (complete(api_client, "Hello", seed=s, **kw).choices[0].text for s in (1234, 1234, 4321))
    assert a == b != c
    x, y, z = (chat(api_client, "Hi", seed=s, **kw).choices[0].message.content for s in (5, 5, 6))
    assert x == y != z


def test_chat_with_logprobs(api_client):
    r = chat(api_client, "Hello!", max_tokens=5, logprobs=True, top_logprobs=3, user="someone")
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert len(choice.logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert r.model_extra["weights_version"] == 1


def test_request_errors(api_server, api_client, api_http):
    with pytest.raises(openai.BadRequestError) as e:
        api_client.completions.create(model=MODEL, prompt="x", extra_body={"max_token": 3})
    assert "max_token" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        api_client.completions.create(model=MODEL, prompt="x " * 200, max_tokens=4)
    assert "128" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        api_client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        chat(api_client, "x", presence_penalty=1)
    assert "presence_penalty" in str(e.value)
    r = api_http.post("/v1/completions", json={"prompt": "x", "n": 5}, headers=AUTH)
    # n=5 can never fit --max-waiting 4: a 400 (retrying cannot help), not a 429
    assert r.status_code == 400 and "max_waiting" in r.json()["error"]["message"]

"""Streamed responses on the shared `api_server`: the client's stream equals the whole response,
SSE on the wire ends with [DONE], and a client that hangs up aborts its request."""

from __future__ import annotations

import json
import time

import httpx
from api_helpers import AUTH, MODEL, chat, complete, metrics


def test_streaming(api_server, api_client):
    full = complete(api_client, "Weather report:", max_tokens=10, n=2)
    opts = {"stream_options": {"include_usage": True}}
    stream = complete(api_client, "Weather report:", max_tokens=10, n=2, stream=True, **opts)
    texts, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        assert chunk.model_extra["weights_version"] == 1
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in full.choices}
    assert set(finish) == {0, 1} and usage.completion_tokens == full.usage.completion_tokens

    pieces = [c.choices[0].delta.content or "" for c in chat(api_client, "Hi", stream=True) if c.choices]
    assert "".join(pieces) == chat(api_client, "Hi").choices[0].message.content

    # On the wire: SSE `data:` lines, each a JSON chunk with weights_version, then [DONE].
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", api_server.base + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(json.loads(line[6:])["weights_version"] == 1 for line in lines[:-1])


def test_client_disconnect_aborts(api_server, api_http):
    before = metrics(api_http)["hotswap_generation_tokens_total"]
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", api_server.base + "/v1/completions", json=body, headers=AUTH) as r:
        next(r.iter_lines())  # first chunk arrived: the request is running; now hang up
    deadline = time.monotonic() + 10
    while metrics(api_http)["hotswap_num_requests_running"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert metrics(api_http)["hotswap_generation_tokens_total"] - before < 100  # aborted, not run to the end

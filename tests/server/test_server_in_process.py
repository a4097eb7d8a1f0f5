"""In-process pieces of the server: per-choice version labels, the error table, and an engine
step failing after a stream started (the app on an engine of its own, no server process)."""

from __future__ import annotations

import json

import pytest
from api_helpers import MODEL
from fastapi.testclient import TestClient
from helpers import KNOBS

from hotswap.api.http_errors import QueueFull, ShuttingDown, WeightsPathNotAllowed, exception_body
from hotswap.api.protocol import response_version, version_fields
from hotswap.api.server import create_app
from hotswap.engine.outputs import CompletionOutput, RequestOutput


@pytest.fixture(scope="module")
def llm(tiny_dir):
    from hotswap.engine.llm import LLM

    return LLM(tiny_dir, **KNOBS, warmup=False)


def test_protocol_helpers():
    """Mixed versions are labelled per choice (stream deltas: test_outputs.py)."""

    def comp(text, versions, finish=None):
        return CompletionOutput(0, text, list(range(len(versions))), [0.0] * len(versions), versions, finish)

    mixed = comp("xyz", [1, 1, 2], finish="length")
    spans = [{"version": 1, "start": 0, "end": 2}, {"version": 2, "start": 2, "end": 3}]
    assert version_fields(mixed) == {"weights_version_spans": spans}
    assert version_fields(comp("x", [3])) == {}
    assert response_version([RequestOutput("r", None, [1], [mixed], 0, True, 2)]) == 2
    assert exception_body(QueueFull("full"))[2] == {"Retry-After": "1"}
    statuses = [exception_body(e())[0] for e in (WeightsPathNotAllowed, ShuttingDown, KeyError)]
    assert statuses == [403, 503, 500]


def test_error_after_stream_started_is_reported(llm):
    """A failing engine step after the first byte: an error event, then [DONE] (no silent cut)."""
    engine = llm.engine
    app = create_app(engine, model_name=MODEL)

    def broken(*a, **k):
        raise RuntimeError("device lost")

    engine.runner.run = broken  # this module's own engine; every step now fails
    with TestClient(app) as tc:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True}
        with tc.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        app.state.ctx.shutting_down = True  # what SIGTERM sets: new work gets a clear 503
        assert tc.post("/v1/completions", json=body).status_code == tc.get("/health").status_code == 503
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][6:])["error"]
    assert err["type"] == "internal_server_error" and "device lost" in err["message"]

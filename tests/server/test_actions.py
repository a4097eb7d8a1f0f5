"""The REST actions layer under the three dialects (api/actions.py, api/streaming.py), in
process on an app of this module's own: one set of update options, one pickle refusal for
`serialized_named_tensors`, one count of committed updates whichever dialect commits, and
SGLang's `/generate` streamed by the same code as the OpenAI routes."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from helpers import KNOBS

from hotswap.api import actions
from hotswap.api.server import create_app
from hotswap.checkpoint.hf import read_hf_tensors
from hotswap.checkpoint.payload import encode_safetensors
from hotswap.weights.options import UpdateOptions

OCTET = {"content-type": "application/octet-stream"}
API = Path(__file__).resolve().parents[2] / "hotswap" / "api"


@pytest.fixture(scope="module")
def app(tiny_dir, weights_root):
    from hotswap.engine.llm import LLM

    return create_app(
        LLM(tiny_dir, **KNOBS, warmup=False).engine, model_name="tiny", weights_root=str(weights_root)
    )


@pytest.fixture(scope="module")
def tc(app):
    with TestClient(app) as client:
        yield client


def _metric(tc, name: str) -> float:
    for line in tc.get("/metrics").text.splitlines():
        if line.startswith(f"hotswap_{name} "):
            return float(line.split()[1])
    raise KeyError(name)


def _api_files_matching(pattern: str) -> set[str]:
    return {p.name for p in sorted(API.glob("*.py")) if re.search(pattern, p.read_text())}


def test_one_body_reader_no_payload_decoder():
    """Bodies are read in actions.py only (one JSON parse, one pickle sniff), and no module of
    the HTTP layer decodes payload bytes: the engine's `wire_tensors` does, in its one place."""
    assert _api_files_matching(r"\bjson\.loads\(|\bsniff_refuse_pickle\(|\.body\(\)") == {"actions.py"}
    decoders = r"b64decode|frombuffer|decode_payload|decode_json|decode_safetensors|wire_tensors\(|safetensors_layout"
    assert not _api_files_matching(decoders)
    # The engine is asked to update (and its counter written) by the actions layer alone.
    assert _api_files_matching(r"\.update_weights(?:_chunk)?\b(?!_)|weight_updates \+=") == {"actions.py"}


def test_update_fields_are_update_options():
    """The REST fields are UpdateOptions' own, defaults included; query strings are coerced."""
    fields = actions.UpdateFields.model_fields
    assert set(fields) == {f.name for f in dataclasses.fields(UpdateOptions)}
    assert actions.UpdateFields().options() == UpdateOptions()
    chunk = actions.ChunkFields.model_validate({"partial": "true", "version": "7", "finished": "false"})
    assert chunk.options() == UpdateOptions(partial=True, version=7) and chunk.finished is False


def test_serialized_named_tensors_is_one_status_everywhere(tc):
    """PickleRefused's 400 (code pickle_refused) on each route that can see the field; a body
    whose bytes are a pickle keeps its dialect's status (hotswap 400, SGLang and vLLM 415)."""
    field = {"serialized_named_tensors": [pickle.dumps({"w": [1.0]}).hex()]}
    routes = {
        "/update_weights": field,
        "/update_weights_from_tensor": field,
        "/vllm/update_weights": {"update_info": field},
    }
    for path, body in routes.items():
        r = tc.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "pickle_refused", (path, r.text)
        assert "never" in r.json()["error"]["message"]
    blob = pickle.dumps({"w": [1.0]})
    statuses = {path: tc.post(path, content=blob, headers=OCTET).status_code for path in routes}
    assert statuses == {
        "/update_weights": 400,
        "/update_weights_from_tensor": 415,
        "/vllm/update_weights": 415,
    }


def test_every_dialect_counts_and_labels_its_commits_once(tc, app, tiny_dir):
    """hotswap's /update_weights, SGLang's /update_weights_from_tensor and vLLM's four phases
    each commit one version, counted once in /metrics; SGLang's and vLLM's labels stick."""
    blob = encode_safetensors(dict(read_hf_tensors(tiny_dir)))
    before, version = _metric(tc, "weight_updates_total"), app.state.ctx.engine.weights_version

    r = tc.post("/update_weights", content=blob, headers=OCTET, params={"policy": "abort"})
    assert r.status_code == 200 and r.json() == {"weights_version": version + 1, "policy": "abort"}, r.text
    r = tc.post("/update_weights_from_tensor", content=blob, headers=OCTET, params={"weight_version": "rl-a"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert tc.get("/get_weight_version").json() == {"weight_version": "rl-a"}
    assert (
        tc.post("/vllm/init_weight_transfer_engine", json={"init_info": {"backend": "http"}}).status_code
        == 200
    )
    assert tc.post("/vllm/start_weight_update", json={}).status_code == 200
    assert tc.post("/vllm/update_weights", content=blob, headers=OCTET).status_code == 200
    assert tc.post("/vllm/finish_weight_update", json={"weight_version": "rl-b"}).status_code == 200
    assert tc.get("/vllm/weight_info").json() == {"weight_version": "rl-b"}

    assert app.state.ctx.engine.weights_version == version + 3
    assert _metric(tc, "weight_updates_total") == before + 3
    # A refused update counts nothing.
    r = tc.post("/update_weights", json={"path": "seed1", "colour": 1})
    assert r.status_code == 400 and "colour" in r.json()["error"]["message"]
    assert _metric(tc, "weight_updates_total") == before + 3


def _sse(tc, path: str, body: dict) -> tuple[dict, list[str]]:
    with tc.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        return dict(r.headers), [line for line in r.iter_lines() if line]


def test_generate_streams_through_the_openai_stream(tc, app):
    """SGLang's /generate: the same SSE headers as /v1/completions, [DONE] last, and an error
    after the first byte sent in-band before [DONE] (not a silent cut)."""
    sglang = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
        "stream": True,
    }
    openai = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0, "stream": True}
    headers, lines = _sse(tc, "/generate", sglang)
    openai_headers, _ = _sse(tc, "/v1/completions", openai)
    for h in ("content-type", "cache-control", "x-accel-buffering"):
        assert headers[h] == openai_headers[h], h
    assert headers["x-accel-buffering"] == "no"
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["meta_info"]["finish_reason"] == {"type": "length"} and len(last["output_ids"]) == 4
    plain = tc.post("/generate", json={**sglang, "stream": False}).json()
    assert plain["output_ids"] == last["output_ids"]

    engine = app.state.ctx.engine

    def broken(*a, **k):
        raise RuntimeError("device lost")

    engine.runner.run = broken  # this module's own engine, and its last test: every step now fails
    _, lines = _sse(tc, "/generate", sglang)
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][6:])["error"]
    assert err["type"] == "internal_server_error" and "device lost" in err["message"]

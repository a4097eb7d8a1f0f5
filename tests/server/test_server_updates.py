"""Weight updates on a real `hotswap serve` of this file's own, driven by the official `openai`
client and plain httpx. Each test first puts the server on the weights it starts from
(`serving("seed0")`: a path update, awake) and checks versions relative to that one, so the
tests run alone and in any order.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from api_helpers import (
    AUTH,
    GREEDY,
    LONG_PROMPT,
    MODEL,
    admin,
    chat,
    complete,
    metrics,
    start_server,
    update_bytes,
)
from helpers import KNOBS

from hotswap.checkpoint.hf import read_hf_tensors
from hotswap.checkpoint.payload import encode_json_entries, encode_safetensors


@pytest.fixture(scope="module")
def api_server(weights_root, tmp_path_factory, request):
    """Overrides the shared server of tests/conftest.py: these tests change its weights and sleep it."""
    with start_server(weights_root, tmp_path_factory.mktemp("log") / "server.log") as server:
        request.getfixturevalue("oracle")  # built while the server compiles its buckets
        server.wait_healthy(180)
        yield server


@pytest.fixture(scope="module")
def oracle(tiny_dir_b):
    """A fresh in-process engine on the seed-1 weights: what the server must say after updating to them."""
    from hotswap import SamplingParams
    from hotswap.engine.llm import LLM

    llm = LLM(tiny_dir_b, **KNOBS, warmup=False)
    out = llm.generate([LONG_PROMPT], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    return {"llm": llm, "text": out.text}


@pytest.fixture(scope="module")
def serving(api_http):
    """`serving("seed0")` puts the server on that checkpoint of the weights root, awake, and
    returns the new weights version: the state a test starts from."""

    def at(checkpoint: str) -> int:
        r = api_http.post("/update_weights", json={"path": checkpoint, "policy": "abort"}, headers=admin())
        assert r.status_code == 200, r.text
        if api_http.get("/is_sleeping", headers=admin()).json()["is_sleeping"]:
            assert api_http.post("/wakeup", headers=admin()).json()["is_sleeping"] is False
        return r.json()["weights_version"]

    return at


@pytest.fixture(scope="module")
def seed0_text(api_client, serving):
    """What the server says on the seed-0 weights (the greedy completion of LONG_PROMPT)."""
    serving("seed0")
    return complete(api_client).choices[0].text


def test_update_with_safetensors_bytes(api_client, api_http, oracle, tiny_dir_b, serving, seed0_text):
    v = serving("seed0")
    assert complete(api_client).choices[0].text == seed0_text  # and now cached
    r = update_bytes(api_http, read_hf_tensors(tiny_dir_b), policy="drain")
    assert r.status_code == 200, r.text
    assert r.json() == {"weights_version": v + 1, "policy": "drain"}
    out = complete(api_client)
    assert out.model_extra["weights_version"] == v + 1
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # the old KV is never reused
    assert out.choices[0].text == oracle["text"] != seed0_text
    assert complete(api_client).usage.prompt_tokens_details.cached_tokens > 0  # new pages are cached now


class _Canary:
    """Unpickling this calls os.makedirs(path): a payload that would run code on the server."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.makedirs, (self.path,))


def test_pickle_refused_keeps_serving(api_client, api_http, tiny_dir, tmp_path, oracle, serving):
    v = serving("seed1")
    arrays = {k: np.asarray(v) for k, v in list(read_hf_tensors(tiny_dir).items())[:2]}
    for ctype in ("application/octet-stream", "application/python-pickle", "application/json"):
        headers = {**admin(), "Content-Type": ctype}
        r = api_http.post("/update_weights", content=pickle.dumps(arrays), headers=headers)
        assert r.status_code == 400 and "pickle" in r.json()["error"]["message"].lower()

    # A live gadget: loading it here creates its directory, so the server must never load it.
    pickle.loads(pickle.dumps(_Canary(tmp_path / "control")))
    assert (tmp_path / "control").is_dir()
    canary = tmp_path / "canary"
    octet, json_type = {**admin(), "Content-Type": "application/octet-stream"}, admin()
    attempts = []
    for protocol in (0, 2, 5):
        body = pickle.dumps({"model.norm.weight": _Canary(canary)}, protocol=protocol)
        attempts += [(body, octet), (body, {**json_type, "Content-Type": "application/json"})]
    b64 = base64.b64encode(pickle.dumps(_Canary(canary))).decode()
    entry = {"name": "model.norm.weight", "dtype": "float32", "shape": [4], "data": b64}
    for obj in ({"serialized_named_tensors": [b64]}, {"tensors": [entry]}):  # pickles inside JSON fields
        attempts.append((json.dumps(obj).encode(), {**json_type, "Content-Type": "application/json"}))
    errors = []
    for body, headers in attempts:
        r = api_http.post("/update_weights", content=body, headers=headers)
        assert 400 <= r.status_code < 500, r.text
        errors.append(r.json()["error"])
    # Whole-pickle bodies and the pickle-carrying field say why and what is accepted; the last
    # (pickle bytes as a tensor's raw data) is only ever read as numbers, and is the wrong size.
    assert all(e["code"] == "pickle_refused" and "safetensors" in e["message"] for e in errors[:-1]), errors
    assert errors[-1]["code"] == "bad_payload"
    assert not canary.exists()
    assert api_http.get("/weights_version", headers=admin()).json()["weights_version"] == v
    assert complete(api_client).choices[0].text == oracle["text"]


def test_update_from_path(api_client, api_http, oracle, serving):
    v = serving("seed0")
    for bad in ("../model", "/etc", "seed1/../../model"):
        r = api_http.post("/update_weights", json={"path": bad}, headers=admin())
        assert r.status_code == 403, (bad, r.text)
    r = api_http.post(
        "/update_weights", json={"path": "seed1", "policy": "abort", "colour": 1}, headers=admin()
    )
    assert r.status_code == 400 and "colour" in r.json()["error"]["message"]
    r = api_http.post("/update_weights", json={"path": "seed1", "policy": "abort"}, headers=admin())
    assert r.json() == {"weights_version": v + 1, "policy": "abort"}
    out = complete(api_client)
    assert out.usage.prompt_tokens_details.cached_tokens == 0 and out.choices[0].text == oracle["text"]


def test_chunked_update(api_client, api_http, tiny_dir, serving, seed0_text):
    v = serving("seed1")
    tensors = read_hf_tensors(tiny_dir)  # back to the seed-0 weights
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    r = update_bytes(api_http, {k: tensors[k] for k in first}, finished="false", update_id="u1")
    assert r.status_code == 200 and r.json()["staged"] == len(first)
    version = api_http.get("/weights_version", headers=admin()).json()["weights_version"]
    assert version == v  # nothing committed
    second = {k: tensors[k] for k in second}
    r = update_bytes(api_http, second, finished="true", update_id="u1", policy="recompute")
    assert r.json() == {"weights_version": v + 1, "policy": "recompute"}
    out = complete(api_client)
    assert out.usage.prompt_tokens_details.cached_tokens == 0 and out.choices[0].text == seed0_text


def test_json_tensors_and_reject_policy(api_client, api_http, tiny_dir, serving, seed0_text):
    v = serving("seed0")
    complete(api_client)  # its pages are cached now
    name = "model.norm.weight"
    entry = {"tensors": encode_json_entries({name: read_hf_tensors(tiny_dir)[name]}), "partial": True}
    r = api_http.post("/update_weights", json={**entry, "policy": "reject"}, headers=admin())
    assert r.status_code == 409 and "reject" in r.json()["error"]["message"]  # cached pages exist
    assert api_http.post("/reset_prefix_cache", headers=admin()).status_code == 200
    r = api_http.post("/update_weights", json={**entry, "policy": "reject"}, headers=admin())
    assert r.json() == {"weights_version": v + 1, "policy": "reject"}
    assert complete(api_client).choices[0].text == seed0_text  # same values: same output


def test_sleep_wakeup_update_sequence(api_client, api_http, oracle, tiny_dir_b, serving):
    v = serving("seed0")
    r = api_http.post("/sleep", params={"level": 2}, headers=admin())
    assert r.status_code == 200 and r.json()["is_sleeping"]
    # Asleep: 503 at once (the api_client fixture has max_retries=0; by default the client retries 503s).
    for call in (lambda: complete(api_client), lambda: chat(api_client, "Hi", stream=True)):
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as e:
            call()
        assert time.monotonic() - t0 < 2
        assert e.value.status_code == 503 and e.value.body["code"] == "engine_asleep"
        assert "wakeup" in e.value.body["message"] and e.value.response.headers["Retry-After"] == "1"
    # after level 2 there are no weights to wake: "weights" stays asleep until the update lands
    assert api_http.post("/wakeup", params={"tags": "weights"}, headers=admin()).json()["asleep"] == [
        "kv_cache",
        "weights",
    ]
    tensors = read_hf_tensors(tiny_dir_b)
    names = sorted(tensors)
    r = update_bytes(api_http, {k: tensors[k] for k in names[:3]}, finished="false")
    assert r.json()["staged"] == 3
    r = update_bytes(api_http, {k: tensors[k] for k in names[3:]}, finished="true")
    assert r.json()["weights_version"] == v + 1
    assert api_http.get("/is_sleeping", headers=admin()).json()["is_sleeping"]  # kv_cache still asleep
    assert (
        api_http.post("/wakeup", params={"tags": "kv_cache"}, headers=admin()).json()["is_sleeping"] is False
    )
    out = complete(api_client)
    assert out.model_extra["weights_version"] == v + 1 and out.choices[0].text == oracle["text"]


LONG_RUN = {"max_tokens": 120, "temperature": 0.0}  # all 120 tokens (the prompts are <= 8 tokens)
IGNORE_EOS = {"ignore_eos": True}


def _via_client(client, prompt: str, first: threading.Event, finished: threading.Event) -> dict:
    """A streamed completion through the official client (which hides [DONE])."""
    versions, text, last = set(), "", None
    kw = {"stream": True, "extra_body": IGNORE_EOS, **LONG_RUN}
    for chunk in client.completions.create(model=MODEL, prompt=prompt, **kw):
        versions.add(chunk.model_extra["weights_version"])
        text, last = text + chunk.choices[0].text, chunk.choices[0]
        first.set()
        if last.finish_reason:
            finished.set()
    return {"versions": versions, "text": text, "finish": last.finish_reason, "last": last.model_extra}


def _via_sse(base: str, prompt: str, first: threading.Event, finished: threading.Event) -> dict:
    """A streamed completion read as raw SSE lines, so [DONE] can be seen."""
    body = {"model": MODEL, "prompt": prompt, "stream": True, **IGNORE_EOS, **LONG_RUN}
    lines = []
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line:
                lines.append(line)
                first.set()
                if '"finish_reason":"' in line:
                    finished.set()
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    last = events[-1]["choices"][0]
    return {
        "versions": {e["weights_version"] for e in events},
        "text": "".join(e["choices"][0]["text"] for e in events),
        "finish": last["finish_reason"],
        "last": last,
    }


def test_update_while_streaming(api_server, api_client, api_http, oracle, tiny_dir, serving, seed0_text):
    """A plain drain update arrives while streams run: each reports the version that made its tokens.

    Decoding 120 tokens takes ~0.1 s here, so the server is paused (SIGSTOP) while a and b are
    mid-stream and the update (and c) are sent: they reach it with both streams in flight.
    """
    v = serving("seed1")
    prompts = {"a": "Hello", "b": "The weather today", "c": "Once upon"}
    ref_v = {
        k: complete(api_client, p, extra_body=IGNORE_EOS, **LONG_RUN).choices[0].text
        for k, p in prompts.items()
    }
    assert complete(api_client).choices[0].text == oracle["text"]  # version v (seed1), and now cached
    assert complete(api_client).usage.prompt_tokens_details.cached_tokens > 0
    body = encode_safetensors(read_hf_tensors(tiny_dir))  # back to seed0
    proc, base = api_server.proc, api_server.base

    def update():
        headers = {**admin(), "Content-Type": "application/octet-stream"}
        return httpx.post(base + "/update_weights", content=body, headers=headers, timeout=120)

    for _attempt in range(5):
        ev = {k: (threading.Event(), threading.Event()) for k in prompts}  # first token, finished
        with ThreadPoolExecutor(3) as pool:
            # a and b fill both slots (--max-num-seqs 2)
            a = pool.submit(_via_client, api_client, prompts["a"], *ev["a"])
            b = pool.submit(_via_sse, base, prompts["b"], *ev["b"])
            assert ev["a"][0].wait(60) and ev["b"][0].wait(60)
            proc.send_signal(signal.SIGSTOP)
            try:
                time.sleep(0.2)  # whatever the server wrote before the pause reaches the clients
                if ev["a"][1].is_set() or ev["b"][1].is_set():
                    continue  # one had finished already: resume, let both end, try again
                c = pool.submit(_via_sse, base, prompts["c"], *ev["c"])
                time.sleep(0.05)
                upd = pool.submit(update)
                time.sleep(0.1)  # c's request and the update wait in the paused server's sockets
            finally:
                proc.send_signal(signal.SIGCONT)
            r = upd.result(120)
            streams = {"a": a.result(120), "b": b.result(120), "c": c.result(120)}
        break
    else:
        pytest.fail("a and b never were both still streaming when the server was paused")
    assert r.status_code == 200 and r.json() == {"weights_version": v + 1, "policy": "drain"}, r.text

    for k, s in streams.items():  # drain never mixes: one version per stream, on every chunk
        assert len(s["versions"]) == 1 and s["finish"] == "length", (k, s)
        assert "weights_version_spans" not in s["last"], k
    version = {k: next(iter(s["versions"])) for k, s in streams.items()}
    # a and b were streaming when the update arrived: drained, they finish on v, with v's text.
    assert version["a"] == version["b"] == v
    assert streams["a"]["text"] == ref_v["a"] and streams["b"]["text"] == ref_v["b"]
    # c either got a slot before the drain began (v) or was held by it and ran on v + 1; either
    # way its text is what the version it reports produces.
    ref_next = complete(api_client, prompts["c"], extra_body=IGNORE_EOS, **LONG_RUN)
    assert ref_next.model_extra["weights_version"] == v + 1 and ref_next.choices[0].text != ref_v["c"]
    assert streams["c"]["text"] == {v: ref_v["c"], v + 1: ref_next.choices[0].text}[version["c"]], version

    # The prompt cached under v is recomputed under v + 1, and the output is seed0's again.
    out = complete(api_client)
    assert out.model_extra["weights_version"] == v + 1
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    assert out.choices[0].text == seed0_text != oracle["text"]


def test_metrics(api_client, api_http, serving):
    v = serving("seed0")  # an update, and a prompt served twice (its second time from the cache)
    complete(api_client)
    complete(api_client)
    values = metrics(api_http)
    assert values["hotswap_weights_version"] == v
    assert values["hotswap_weight_updates_total"] == v - 1  # every committed update, since version 1
    assert values["hotswap_prefix_cache_hit_tokens_total"] > 0
    assert values["hotswap_num_requests_running"] == 0

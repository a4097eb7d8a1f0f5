"""A real uvicorn server on loopback, driven by the official `openai` client and plain httpx.

One server process serves the whole module (start-up compiles the step buckets);
tests run in file order and share its weights history:
v1 seed0 -> v2 seed1 (safetensors) -> v3 seed1 (path) -> v4 seed0 (2 chunks) -> v5 (partial JSON)
-> sleep level 2 -> v6 seed1 (chunks) -> v7 seed0 (safetensors while streams run) -> SIGTERM.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from hotswap.api.errors import QueueFull, ShuttingDown, WeightsPathNotAllowed, exception_body
from hotswap.api.protocol import response_version, version_fields
from hotswap.api.server import create_app
from hotswap.checkpoint.create import create_checkpoint
from hotswap.checkpoint.hf import read_hf_tensors
from hotswap.checkpoint.payload import encode_json_entries, encode_safetensors
from hotswap.engine.outputs import CompletionOutput, RequestOutput

API_KEY, ADMIN_KEY = "test-api-key", "test-admin-key"
MODEL = "tiny"
KNOBS = {"max_model_len": 128, "max_num_seqs": 2, "max_num_batched_tokens": 16, "page_size": 16}  # 3 buckets
# Long enough to fill several 16-token pages, so a repeat hits the prefix cache.
LONG_PROMPT = (
    "Once upon a time there was a little robot who lived in a quiet town by the sea. Every morning the robot "
    "walked to the harbour, counted the boats, and wrote the number in a notebook."
)
GREEDY = {"max_tokens": 8, "temperature": 0.0}
SEEN: dict[str, str] = {}  # outputs recorded by earlier tests (module order) for later comparison


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _admin(token: str = ADMIN_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


AUTH = _admin(API_KEY)


def _metrics(http) -> dict[str, float]:
    lines = [ln.split() for ln in http.get("/metrics").text.splitlines() if ln and not ln.startswith("#")]
    return {name: float(value) for name, value in lines}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    seed1 = create_checkpoint(root / "weights/seed1", seed=1)
    return {"model": create_checkpoint(root / "model", seed=0), "root": root / "weights", "seed1": seed1}


@pytest.fixture(scope="module")
def server(dirs, tmp_path_factory, request):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log_path = tmp_path_factory.mktemp("log") / "server.log"
    args = [sys.executable, "-m", "hotswap.cli", "serve", str(dirs["model"]), "--port", str(port)]
    args += ["--api-key", API_KEY, "--admin-key", ADMIN_KEY, "--weights-root", str(dirs["root"])]
    args += ["--served-model-name", MODEL, "--max-waiting", "4", "--shutdown-timeout", "30"]
    for k, v in KNOBS.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        request.getfixturevalue("oracle")  # built while the server compiles its buckets
        deadline = time.monotonic() + 180
        while not _healthy(base):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server not healthy (exit {proc.poll()}):\n{log_path.read_text()[-3000:]}")
            time.sleep(0.25)
        yield {"base": base, "proc": proc, "log": log_path}
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server["base"], timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oracle(dirs):
    """A fresh in-process engine on the seed-1 weights: what the server must say after updating to them."""
    from hotswap import SamplingParams
    from hotswap.engine.llm import LLM

    llm = LLM(dirs["seed1"], **KNOBS, warmup=False)
    out = llm.generate([LONG_PROMPT], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    return {"llm": llm, "text": out.text}


def _complete(client, prompt=LONG_PROMPT, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, **{**GREEDY, **kw})


def _chat(client, content: str, **kw):
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model=MODEL, messages=messages, **{**GREEDY, **kw})


def _update_bytes(http, tensors: dict, **params) -> httpx.Response:
    headers = {**_admin(), "Content-Type": "application/octet-stream"}
    return http.post("/update_weights", content=encode_safetensors(tensors), params=params, headers=headers)


# --------------------------------------------------------------------------- basics and auth


def test_the_server_runs_on_2mb_pages_where_the_kernel_gives_them_on_request(server):
    """`hotswap serve` restarts itself (same pid) with glibc's huge-page tunable when THP is in
    `madvise` mode, so XLA's large buffers (the weights it streams every step) sit on 2 MB
    pages; elsewhere it runs as started."""
    from hotswap import host_memory

    pid = server["proc"].pid
    environ = dict(
        kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv
    )
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    huge_kb = int(next(ln.split()[1] for ln in rollup.splitlines() if ln.startswith("AnonHugePages")))
    started = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if host_memory.reexec_env(started) is None:
        assert host_memory.TUNABLE not in environ.get("GLIBC_TUNABLES", "")
    else:
        assert host_memory.TUNABLE in environ["GLIBC_TUNABLES"]
        assert huge_kb > 0, rollup


def test_health_models_and_auth(server, client, http):
    assert http.get("/health").json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http.get("/v1/models").status_code == 401
    bad = openai.OpenAI(base_url=server["base"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        _chat(bad, "x", max_tokens=1)
    for path, body in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": []})]:
        for headers in ({}, _admin("wrong"), {"Authorization": API_KEY}):  # none, wrong, not Bearer
            r = http.post(path, json={"model": MODEL, "max_tokens": 1, **body}, headers=headers)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", (path, headers)
    # Lifecycle routes: no or an unknown key is 401; the api key is known but not allowed: 403.
    posts = ["/sleep", "/wakeup", "/reset_prefix_cache", "/update_weights"]
    for method, route in [("POST", r) for r in posts] + [
        ("GET", "/is_sleeping"),
        ("GET", "/weights_version"),
    ]:
        assert http.request(method, route).status_code == 401, route
        assert http.request(method, route, headers=_admin("wrong")).status_code == 401, route
        r = http.request(method, route, headers=AUTH)
        assert r.status_code == 403, (route, r.text)
        assert r.json()["error"]["type"] == "permission_error" and "admin key" in r.json()["error"]["message"]
    assert http.get("/is_sleeping", headers=_admin()).json()["is_sleeping"] is False  # nothing happened
    r = http.get("/weights_version", headers=_admin())
    assert r.status_code == 200 and r.json() == {"weights_version": 1}


def test_completion_usage_and_prefix_cache(client):
    first = _complete(client)
    assert first.model_extra["weights_version"] == 1
    assert first.choices[0].finish_reason in ("stop", "length")
    assert "weights_version_spans" not in first.choices[0].model_extra  # a single version
    u = first.usage
    assert u.prompt_tokens > 32 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0
    again = _complete(client)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].text == first.choices[0].text
    SEEN["v1"] = first.choices[0].text


def test_completion_variants(client):
    ids = [5, 6, 7, 8, 9]
    r = _complete(client, [ids, ids], max_tokens=4, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) == 1  # greedy: all samples agree
    assert r.usage.prompt_tokens == 10
    r = client.completions.create(model=MODEL, prompt=["Hello", "The capital"], max_tokens=3, logprobs=2)
    for c in r.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
    r = _complete(client, "Hello there", max_tokens=3, echo=True)
    assert r.choices[0].text.startswith("Hello there")
    a, b = (_complete(client, "Hello", max_tokens=6, temperature=0.9, seed=7) for _ in range(2))
    assert a.choices[0].text == b.choices[0].text  # seeded sampling is reproducible


def test_seed_reproducibility(client):
    """temperature 1: the same seed gives the same text, another seed another text."""
    kw = {"max_tokens": 12, "temperature": 1.0}
    a, b, c = (_complete(client, "Hello", seed=s, **kw).choices[0].text for s in (1234, 1234, 4321))
    assert a == b != c
    x, y, z = (_chat(client, "Hi", seed=s, **kw).choices[0].message.content for s in (5, 5, 6))
    assert x == y != z


def test_chat_with_logprobs(client):
    r = _chat(client, "Hello!", max_tokens=5, logprobs=True, top_logprobs=3, user="someone")
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert len(choice.logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert r.model_extra["weights_version"] == 1


def test_streaming(server, client):
    full = _complete(client, "Weather report:", max_tokens=10, n=2)
    opts = {"stream_options": {"include_usage": True}}
    stream = _complete(client, "Weather report:", max_tokens=10, n=2, stream=True, **opts)
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

    pieces = [c.choices[0].delta.content or "" for c in _chat(client, "Hi", stream=True) if c.choices]
    assert "".join(pieces) == _chat(client, "Hi").choices[0].message.content

    # On the wire: SSE `data:` lines, each a JSON chunk with weights_version, then [DONE].
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server["base"] + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(json.loads(line[6:])["weights_version"] == 1 for line in lines[:-1])


def test_request_errors(server, client, http):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", extra_body={"max_token": 3})
    assert "max_token" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x " * 200, max_tokens=4)
    assert "128" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, "x", presence_penalty=1)
    assert "presence_penalty" in str(e.value)
    r = http.post("/v1/completions", json={"prompt": "x", "n": 5}, headers=AUTH)
    # n=5 can never fit --max-waiting 4: a 400 (retrying cannot help), not a 429
    assert r.status_code == 400 and "max_waiting" in r.json()["error"]["message"]


def test_client_disconnect_aborts(server, http):
    before = _metrics(http)["hotswap_generation_tokens_total"]
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server["base"] + "/v1/completions", json=body, headers=AUTH) as r:
        next(r.iter_lines())  # first chunk arrived: the request is running; now hang up
    deadline = time.monotonic() + 10
    while _metrics(http)["hotswap_num_requests_running"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert _metrics(http)["hotswap_generation_tokens_total"] - before < 100  # aborted, not run to the end


# --------------------------------------------------------------------------- weight updates


def test_update_with_safetensors_bytes(client, http, oracle, dirs):
    r = _update_bytes(http, read_hf_tensors(dirs["seed1"]), policy="drain")
    assert r.status_code == 200, r.text
    assert r.json() == {"weights_version": 2, "policy": "drain"}
    out = _complete(client)
    assert out.model_extra["weights_version"] == 2
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # the old KV is never reused
    assert out.choices[0].text == oracle["text"] != SEEN["v1"]
    assert _complete(client).usage.prompt_tokens_details.cached_tokens > 0  # v2 pages are cached now
    SEEN["v2"] = out.choices[0].text


class _Canary:
    """Unpickling this calls os.makedirs(path): a payload that would run code on the server."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.makedirs, (self.path,))


def test_pickle_refused_keeps_serving(client, http, dirs, tmp_path):
    arrays = {k: np.asarray(v) for k, v in list(read_hf_tensors(dirs["model"]).items())[:2]}
    for ctype in ("application/octet-stream", "application/python-pickle", "application/json"):
        headers = {**_admin(), "Content-Type": ctype}
        r = http.post("/update_weights", content=pickle.dumps(arrays), headers=headers)
        assert r.status_code == 400 and "pickle" in r.json()["error"]["message"].lower()

    # A live gadget: loading it here creates its directory, so the server must never load it.
    pickle.loads(pickle.dumps(_Canary(tmp_path / "control")))
    assert (tmp_path / "control").is_dir()
    canary = tmp_path / "canary"
    octet, json_type = {**_admin(), "Content-Type": "application/octet-stream"}, _admin()
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
        r = http.post("/update_weights", content=body, headers=headers)
        assert 400 <= r.status_code < 500, r.text
        errors.append(r.json()["error"])
    # Whole-pickle bodies and the pickle-carrying field say why and what is accepted; the last
    # (pickle bytes as a tensor's raw data) is only ever read as numbers, and is the wrong size.
    assert all(e["code"] == "pickle_refused" and "safetensors" in e["message"] for e in errors[:-1]), errors
    assert errors[-1]["code"] == "bad_payload"
    assert not canary.exists()
    assert http.get("/weights_version", headers=_admin()).json()["weights_version"] == 2
    assert _complete(client).choices[0].text == SEEN["v2"]


def test_update_from_path(client, http, oracle):
    for bad in ("../model", "/etc", "seed1/../../model"):
        r = http.post("/update_weights", json={"path": bad}, headers=_admin())
        assert r.status_code == 403, (bad, r.text)
    r = http.post("/update_weights", json={"path": "seed1", "policy": "abort", "colour": 1}, headers=_admin())
    assert r.status_code == 400 and "colour" in r.json()["error"]["message"]
    r = http.post("/update_weights", json={"path": "seed1", "policy": "abort"}, headers=_admin())
    assert r.json() == {"weights_version": 3, "policy": "abort"}
    out = _complete(client)
    assert out.usage.prompt_tokens_details.cached_tokens == 0 and out.choices[0].text == oracle["text"]


def test_chunked_update(client, http, dirs):
    tensors = read_hf_tensors(dirs["model"])  # back to the seed-0 weights
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    r = _update_bytes(http, {k: tensors[k] for k in first}, finished="false", update_id="u1")
    assert r.status_code == 200 and r.json()["staged"] == len(first)
    assert http.get("/weights_version", headers=_admin()).json()["weights_version"] == 3  # nothing committed
    second = {k: tensors[k] for k in second}
    r = _update_bytes(http, second, finished="true", update_id="u1", policy="recompute")
    assert r.json() == {"weights_version": 4, "policy": "recompute"}
    out = _complete(client)
    assert out.usage.prompt_tokens_details.cached_tokens == 0 and out.choices[0].text == SEEN["v1"]


def test_json_tensors_and_reject_policy(client, http, dirs):
    name = "model.norm.weight"
    entry = {"tensors": encode_json_entries({name: read_hf_tensors(dirs["model"])[name]}), "partial": True}
    r = http.post("/update_weights", json={**entry, "policy": "reject"}, headers=_admin())
    assert r.status_code == 409 and "reject" in r.json()["error"]["message"]  # cached pages exist
    assert http.post("/reset_prefix_cache", headers=_admin()).status_code == 200
    r = http.post("/update_weights", json={**entry, "policy": "reject"}, headers=_admin())
    assert r.json() == {"weights_version": 5, "policy": "reject"}
    assert _complete(client).choices[0].text == SEEN["v1"]  # same values: same output


def test_sleep_wakeup_update_sequence(client, http, oracle, dirs):
    r = http.post("/sleep", params={"level": 2}, headers=_admin())
    assert r.status_code == 200 and r.json()["is_sleeping"]
    # Asleep: 503 at once (the client fixture has max_retries=0; by default the client retries 503s).
    for call in (lambda: _complete(client), lambda: _chat(client, "Hi", stream=True)):
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as e:
            call()
        assert time.monotonic() - t0 < 2
        assert e.value.status_code == 503 and e.value.body["code"] == "engine_asleep"
        assert "wakeup" in e.value.body["message"] and e.value.response.headers["Retry-After"] == "1"
    # after level 2 there are no weights to wake: "weights" stays asleep until the update lands
    assert http.post("/wakeup", params={"tags": "weights"}, headers=_admin()).json()["asleep"] == [
        "kv_cache",
        "weights",
    ]
    tensors = read_hf_tensors(dirs["seed1"])
    names = sorted(tensors)
    r = _update_bytes(http, {k: tensors[k] for k in names[:3]}, finished="false")
    assert r.json()["staged"] == 3
    r = _update_bytes(http, {k: tensors[k] for k in names[3:]}, finished="true")
    assert r.json()["weights_version"] == 6
    assert http.get("/is_sleeping", headers=_admin()).json()["is_sleeping"]  # kv_cache still asleep
    assert http.post("/wakeup", params={"tags": "kv_cache"}, headers=_admin()).json()["is_sleeping"] is False
    out = _complete(client)
    assert out.model_extra["weights_version"] == 6 and out.choices[0].text == oracle["text"]


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


def test_update_while_streaming(server, client, http, oracle, dirs):
    """A plain drain update arrives while streams run: each reports the version that made its tokens.

    Decoding 120 tokens takes ~0.1 s here, so the server is paused (SIGSTOP) while a and b are
    mid-stream and the update (and c) are sent: they reach it with both streams in flight.
    """
    prompts = {"a": "Hello", "b": "The weather today", "c": "Once upon"}
    ref6 = {
        k: _complete(client, p, extra_body=IGNORE_EOS, **LONG_RUN).choices[0].text for k, p in prompts.items()
    }
    assert _complete(client).choices[0].text == oracle["text"]  # v6 (seed1), and now cached
    assert _complete(client).usage.prompt_tokens_details.cached_tokens > 0
    body = encode_safetensors(read_hf_tensors(dirs["model"]))  # back to seed0
    proc, base = server["proc"], server["base"]

    def update():
        headers = {**_admin(), "Content-Type": "application/octet-stream"}
        return httpx.post(base + "/update_weights", content=body, headers=headers, timeout=120)

    for _attempt in range(5):
        ev = {k: (threading.Event(), threading.Event()) for k in prompts}  # first token, finished
        with ThreadPoolExecutor(3) as pool:
            # a and b fill both slots (--max-num-seqs 2)
            a = pool.submit(_via_client, client, prompts["a"], *ev["a"])
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
    assert r.status_code == 200 and r.json() == {"weights_version": 7, "policy": "drain"}, r.text

    for k, s in streams.items():  # drain never mixes: one version per stream, on every chunk
        assert len(s["versions"]) == 1 and s["finish"] == "length", (k, s)
        assert "weights_version_spans" not in s["last"], k
    version = {k: next(iter(s["versions"])) for k, s in streams.items()}
    # a and b were streaming when the update arrived: drained, they finish on v6, with v6's text.
    assert version["a"] == version["b"] == 6
    assert streams["a"]["text"] == ref6["a"] and streams["b"]["text"] == ref6["b"]
    # c either got a slot before the drain began (v6) or was held by it and ran on v7; either way
    # its text is what the version it reports produces.
    ref7 = _complete(client, prompts["c"], extra_body=IGNORE_EOS, **LONG_RUN)
    assert ref7.model_extra["weights_version"] == 7 and ref7.choices[0].text != ref6["c"]
    assert streams["c"]["text"] == {6: ref6["c"], 7: ref7.choices[0].text}[version["c"]], version

    # The prompt cached under v6 is recomputed under v7, and the output is seed0's again.
    out = _complete(client)
    assert out.model_extra["weights_version"] == 7
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    assert out.choices[0].text == SEEN["v1"] != oracle["text"]


def test_binds_loopback_by_default(server, monkeypatch):
    from hotswap import cli
    from hotswap.cli import serve as cli_serve

    parsed = []
    monkeypatch.setattr(cli_serve, "serve", parsed.append)  # parse only; do not start a server
    assert cli.main(["serve"]) == 0 and parsed[0].host == "127.0.0.1"
    # The module's server was started without --host: it listens on 127.0.0.1 and nothing else.
    assert "--host" not in server["proc"].args
    port = int(server["base"].rsplit(":", 1)[1])

    def listening(table: str) -> list[str]:
        path = Path("/proc/net") / table
        rows = [row.split() for row in path.read_text().splitlines()[1:]] if path.exists() else []
        # columns: sl local_address rem_address st ...; st 0A = LISTEN; addresses as hex ip:port
        return [r[1] for r in rows if r[3] == "0A" and int(r[1].rsplit(":", 1)[1], 16) == port]

    assert listening("tcp") == [f"0100007F:{port:04X}"]  # 127.0.0.1, little-endian hex
    assert listening("tcp6") == []


def test_metrics(http):
    values = _metrics(http)
    assert values["hotswap_weights_version"] == 7
    assert values["hotswap_weight_updates_total"] == 6
    assert values["hotswap_prefix_cache_hit_tokens_total"] > 0
    assert values["hotswap_num_requests_running"] == 0


# --------------------------------------------------------------------------- in-process pieces


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


def test_error_after_stream_started_is_reported(oracle):
    """A failing engine step after the first byte: an error event, then [DONE] (no silent cut)."""
    engine = oracle["llm"].engine
    app = create_app(engine, model_name=MODEL)

    def broken(*a, **k):
        raise RuntimeError("device lost")

    engine.runner.run = broken  # the oracle is done with; every step now fails
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


# --------------------------------------------------------------------------- shutdown (last: ends the server)


def test_sigterm_finishes_in_flight_then_exits_0(server, client):
    stream = _complete(client, "Hello", max_tokens=100, stream=True, extra_body={"ignore_eos": True})
    chunks = [next(stream)]  # the request is in flight now
    server["proc"].send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:  # new work is refused: 503 while the listener closes, then no connection at all
        assert httpx.get(server["base"] + "/health", timeout=5).status_code == 503
    except httpx.TransportError:
        pass
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"  # the in-flight stream ran to completion
    assert sum(len(c.choices[0].text) for c in chunks) > 0
    assert server["proc"].wait(60) == 0
    assert "Traceback" not in Path(server["log"]).read_text()

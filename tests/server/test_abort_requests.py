"""Aborting requests by id and all at once (vLLM's /abort_requests, SGLang's /abort_request) on
a live server: uvicorn on loopback in this process, so the test can look inside the engine
afterwards (pages, sequences, structured-output matchers) as well as at /metrics.

50 streams of every kind a client opens (completions, chat, SGLang's /generate, some
constrained by a regex) run mid-way; 25 are aborted by the id each client has (the response's
`id`, its own X-Request-Id or request_id, SGLang's rid), the rest by "all". Every stream ends
with finish_reason "abort" and its partial output, nothing leaks, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import inspect
import json
import time
import weakref

import httpx
import pytest
from api_helpers import ADMIN_KEY, API_KEY, MODEL, admin
from thread_server import serving

from hotswap.api.server import create_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = admin()
N_STREAMS = 50
MAX_TOKENS = 200  # far more than a stream gets before its abort: every one is cut mid-way
MID_WAY = 3  # tokens every stream has received before the aborts
# Never complete within MAX_TOKENS, so a constrained sample cannot stop by itself (no EOS allowed).
REGEX = {"regex": "[a-z]{1000}"}
# 64 sequences a step: all 50 streams run at once; pages for all of them at full length.
KNOBS = {
    "max_model_len": 256,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 64,
    "page_size": 16,
    "num_pages": 1024,
    "max_waiting": 128,
}


@pytest.fixture(scope="module")
def served(tiny_dir):
    """(base URL, engine, server context) of a server on 127.0.0.1, stopped after the module."""
    from hotswap.engine.llm import LLM

    engine = LLM(tiny_dir, **KNOBS, warmup=False).engine
    app = create_app(engine, api_key=API_KEY, admin_key=ADMIN_KEY, model_name=MODEL)
    with serving(app) as base:
        yield base, engine, app.state.ctx


@dataclasses.dataclass
class Stream:
    """One client's stream: what it sent, the id it can abort by, what came back."""

    kind: str  # completion | chat | generate
    body: dict
    headers: dict
    abort_id: str | None = None  # known from the start (chosen) or from the first event
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    usage_tokens: int | None = None
    done: bool = False
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # MID_WAY tokens in

    def absorb(self, event: dict) -> None:
        if self.kind == "generate":  # SGLang: each event is the whole output so far
            self.text, self.token_ids = event["text"], event["output_ids"]
            reason = event["meta_info"]["finish_reason"]
            self.finish_reason = reason and reason["type"]
            self.usage_tokens = event["meta_info"]["completion_tokens"]
        else:
            self.abort_id = self.abort_id or event["id"]
            if event.get("usage"):
                self.usage_tokens = event["usage"]["completion_tokens"]
            for c in event["choices"]:
                self.text += c["text"] if self.kind == "completion" else c["delta"].get("content") or ""
                self.token_ids += c.get("token_ids") or []
                self.finish_reason = c["finish_reason"] or self.finish_reason
        if len(self.token_ids) >= MID_WAY:
            self.ready.set()


def _streams() -> list[Stream]:
    out = []
    for i in range(N_STREAMS):
        prompt = f"story {i}: once upon a time"
        common = {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
        common |= {"return_token_ids": True, "stream_options": {"include_usage": True}}
        constrained = {"structured_outputs": REGEX} if i % 3 == 0 else {}
        match i % 5:
            case 0 | 1:  # the id it learns from the first event
                body = {**common, "prompt": prompt, **constrained}
                out.append(Stream("completion", body, AUTH))
            case 2:  # its own id, in the header
                body = {**common, "messages": [{"role": "user", "content": prompt}], **constrained}
                s = Stream("chat", body, {**AUTH, "X-Request-Id": f"chat-{i}"}, abort_id=f"chat-{i}")
                out.append(s)
            case 3:  # its own id, in vLLM's request_id field
                body = {**common, "prompt": prompt, "request_id": f"req-{i}", **constrained}
                out.append(Stream("completion", body, AUTH, abort_id=f"req-{i}"))
            case 4:  # SGLang's rid
                params = {"max_new_tokens": MAX_TOKENS, "ignore_eos": True, **REGEX} if constrained else {}
                params = params or {"max_new_tokens": MAX_TOKENS, "ignore_eos": True}
                body = {"text": prompt, "stream": True, "rid": f"sg-{i}", "sampling_params": params}
                out.append(Stream("generate", body, ADMIN, abort_id=f"sg-{i}"))
    return out


PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/generate"}


async def _run(client: httpx.AsyncClient, s: Stream) -> None:
    async with client.stream("POST", PATHS[s.kind], json=s.body, headers=s.headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                s.done = True
            elif line:
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                s.absorb(event)


def _sequences(engine) -> list:
    with engine.lock:
        return [seq for req in engine.requests.values() for seq in req.seqs]


def _pause_mid_way(engine, monkeypatch, rows: int) -> None:
    """Pause the engine ("keep") from its loop's own thread, right after the step that gives
    `rows` sequences MID_WAY tokens each: two rows of the tiny model finish MAX_TOKENS in well
    under a second, so a test thread slowed by a loaded machine could otherwise see them end
    before its abort arrives."""
    step = engine.step

    def step_then_pause():
        out = step()
        seqs = _sequences(engine)
        if len(seqs) >= rows and min(len(s.output_ids) for s in seqs) >= MID_WAY:
            engine.pause("keep")
        return out

    monkeypatch.setattr(engine, "step", step_then_pause)


async def _abort_scenario(base: str, engine) -> tuple[list[Stream], list, dict]:
    streams = _streams()
    limits = httpx.Limits(max_connections=N_STREAMS + 8)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        tasks = [asyncio.create_task(_run(client, s)) for s in streams]
        await asyncio.wait_for(asyncio.gather(*(s.ready.wait() for s in streams)), 240)
        assert not any(s.done or s.finish_reason for s in streams), "a stream ended before its abort"
        seqs = _sequences(engine)
        assert len(seqs) == N_STREAMS

        # Half by id, with what each client has: vLLM's route for the OpenAI ones, SGLang's per rid.
        by_id, rest = streams[::2], streams[1::2]
        openai_ids = [s.abort_id for s in by_id if s.kind != "generate"]
        r = await client.post("/vllm/abort_requests", json={"request_ids": openai_ids}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json()["aborted"] == len(openai_ids) and r.json()["finished"] == []
        for s in by_id:
            if s.kind == "generate":
                r = await client.post("/abort_request", json={"rid": s.abort_id}, headers=ADMIN)
                assert r.status_code == 200 and r.json()["aborted"] == [s.abort_id], r.text
        await asyncio.wait_for(asyncio.gather(*(tasks[i] for i in range(0, N_STREAMS, 2))), 60)
        assert all(s.finish_reason is None for s in rest), "abort by id ended a request it did not name"

        r = await client.post("/abort_request", json={"abort_all": True}, headers=ADMIN)
        assert r.status_code == 200 and len(r.json()["aborted"]) == len(rest), r.text
        await asyncio.wait_for(asyncio.gather(*tasks), 60)

        # The ids again: they ended a moment ago, which is not an error; an id never run is.
        again = await client.post("/abort_requests", json={"request_ids": openai_ids[:3]}, headers=ADMIN)
        unknown = await client.post("/abort_requests", json={"request_ids": ["cmpl-nope"]}, headers=ADMIN)
        answers = {"again": again.json(), "unknown": (unknown.status_code, unknown.json())}
    return streams, seqs, answers


def test_fifty_streams_aborted_by_id_and_all(served, monkeypatch):
    base, engine, ctx = served
    tok = engine.tokenizer
    _pause_mid_way(engine, monkeypatch, rows=N_STREAMS)
    try:
        streams, seqs, answers = asyncio.run(_abort_scenario(base, engine))
    finally:
        monkeypatch.undo()
        engine.resume()

    for s in streams:  # each ended with "abort", its partial output whole
        assert s.done and s.finish_reason == "abort", s
        assert MID_WAY <= len(s.token_ids) < MAX_TOKENS and s.usage_tokens == len(s.token_ids), s
        assert s.text == tok.decode(s.token_ids), s
    counts = sorted(len(s.token_ids) for s in streams)
    print(
        f"\nabort: {N_STREAMS} streams cut at {counts[0]}..{counts[-1]} of {MAX_TOKENS} tokens (median {counts[25]})"
    )
    again = answers["again"]
    assert again["aborted"] == 0 and len(again["finished"]) == 3, again
    status, body = answers["unknown"]
    assert status == 404 and "cmpl-nope" in body["error"]["message"], body

    # Nothing leaks: no request, sequence, page owner, callback, id or constraint matcher is left.
    assert engine.num_running() == engine.num_waiting() == len(engine.requests) == 0
    assert len(ctx.loop.ids) == 0 and not ctx.loop._callbacks
    engine.check_invariants()
    usage = engine.state.pool.usage(engine.state.prefix)
    assert usage["owned"] == 0 and usage["cached"] + usage["free"] == KNOBS["num_pages"] - 1, usage
    matchers = [s.matcher for s in seqs if s.matcher is not None]
    assert len(matchers) == sum(1 for i in range(N_STREAMS) if i % 3 == 0)
    refs = [weakref.ref(s) for s in seqs]
    del seqs
    gc.collect()
    assert all(r() is None for r in refs), "an aborted sequence is still referenced"
    here = inspect.currentframe()
    for m in matchers:  # only this test (its list, its frame) holds each matcher now
        assert [x for x in gc.get_referrers(m) if x is not matchers and x is not here] == []

    with httpx.Client(base_url=base, timeout=60) as http:
        assert http.post("/reset_prefix_cache", headers=ADMIN).status_code == 200
        m = dict(ln.rsplit(" ", 1) for ln in http.get("/metrics").text.splitlines() if not ln.startswith("#"))
        assert float(m["hotswap_num_requests_running"]) == float(m["hotswap_num_requests_waiting"]) == 0
        assert float(m['hotswap_kv_pages{state="free"}']) == KNOBS["num_pages"] - 1, m
        # The server keeps serving, constrained output included.
        body = {"model": MODEL, "prompt": "after", "max_tokens": 8, "ignore_eos": True}
        r = http.post("/v1/completions", json={**body, "structured_outputs": REGEX}, headers=AUTH)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert r.json()["choices"][0]["text"].isalpha()


def test_plain_requests_return_their_partial_text(served, monkeypatch):
    """Non-streaming requests aborted mid-way answer with their partial text; vLLM's empty
    `request_ids` aborts everything, paused requests included."""
    base, engine, _ = served
    _pause_mid_way(engine, monkeypatch, rows=2)

    async def scenario():
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            body = {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True}
            posts = [
                client.post(
                    "/v1/completions", json={**body, "prompt": "plain one", "request_id": "p1"}, headers=AUTH
                ),
                client.post(
                    "/v1/chat/completions",
                    json={**body, "messages": [{"role": "user", "content": "plain two"}]},
                    headers={**AUTH, "X-Request-Id": "p2"},
                ),
            ]
            tasks = [asyncio.create_task(p) for p in posts]
            deadline = time.monotonic() + 120
            while not engine.is_paused:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            by_id = await client.post("/abort_requests", json={"request_ids": ["p1"]}, headers=ADMIN)
            everything = await client.post("/vllm/abort_requests", json={}, headers=ADMIN)
            return by_id.json(), everything.json(), await asyncio.gather(*tasks)

    try:
        by_id, everything, (completion, chat) = asyncio.run(scenario())
    finally:
        monkeypatch.undo()
        engine.resume()
    assert by_id["request_ids"] == ["cmpl-p1-0"] and everything["request_ids"] == ["chatcmpl-p2"]
    assert completion.json()["id"] == "cmpl-p1" and chat.json()["id"] == "chatcmpl-p2"
    tok = engine.tokenizer
    c = completion.json()["choices"][0]
    m = chat.json()["choices"][0]
    for choice, text in ((c, c["text"]), (m, m["message"]["content"])):
        assert choice["finish_reason"] == "abort" and MID_WAY <= len(choice["token_ids"]) < MAX_TOKENS
        assert text == tok.decode(choice["token_ids"])
    assert completion.json()["usage"]["completion_tokens"] == len(c["token_ids"])


def test_keys_and_duplicate_ids(served):
    """/tokenize and /detokenize are inference routes (the api key at the root, the admin key under
    /vllm, as the OpenAI routes); an abort is a control route (the admin key). A client's id
    already in flight is refused before anything is queued."""
    base, engine, _ = served
    with httpx.Client(base_url=base, timeout=60) as http:
        body = {"prompt": "hello"}
        assert http.post("/tokenize", json=body, headers=AUTH).status_code == 200
        assert http.post("/tokenize", json=body).status_code == 401
        assert http.post("/vllm/tokenize", json=body, headers=AUTH).status_code == 403
        assert http.post("/vllm/tokenize", json=body, headers=ADMIN).status_code == 200
        assert http.post("/detokenize", json={"tokens": [5]}, headers=AUTH).status_code == 200
        for route, abort in (
            ("/abort_requests", {}),
            ("/vllm/abort_requests", {}),
            ("/abort_request", {"abort_all": True}),
        ):
            assert http.post(route, json=abort, headers=AUTH).status_code == 403, route
        r = http.post("/abort_request", json={"rid": "never-ran"}, headers=ADMIN)
        assert r.status_code == 404 and r.json()["success"] is False and "'never-ran'" in r.json()["message"]
        assert http.post("/abort_request", json={}, headers=ADMIN).status_code == 400

    async def twice():
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            body = {
                "model": MODEL,
                "prompt": "dup",
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "request_id": "dup",
            }
            first = asyncio.create_task(client.post("/v1/completions", json=body, headers=AUTH))
            while not engine.requests:
                await asyncio.sleep(0.01)
            second = await client.post("/v1/completions", json=body, headers=AUTH)
            await client.post("/abort_requests", json={"request_ids": ["dup"]}, headers=ADMIN)
            return second, await first

    second, first = asyncio.run(twice())
    assert second.status_code == 400 and "'cmpl-dup-0' is already in use" in second.json()["error"]["message"]
    assert first.json()["choices"][0]["finish_reason"] == "abort"

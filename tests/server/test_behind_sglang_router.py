"""Two real `hotswap serve` replicas behind the real sglang-router (the registry's 0.3.2, its
`cache_aware` policy), as an RL fleet runs SGLang servers: the router registers them as SGLang
workers (`/server_info`, `/model_info`, `/get_load`), and the official `openai` client's chat
and completions, SGLang's `/generate`, and their streams all answer through it, each the same
answer the replica gives directly (greedy; the replicas hold the same weights). The fields the
router fills in (api/router_fields.py) are honoured or refused by name, through the router.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from api_helpers import LONG_PROMPT
from helpers import KNOBS
from router_process import RouterProcess
from server_process import ServerProcess, cli_flags

MODEL = "tiny"
GREEDY = {"max_tokens": 12, "temperature": 0.0}


@pytest.fixture(scope="module")
def replicas(weights_root, tmp_path_factory):
    """Two servers of the seed-0 checkpoint, no keys (the router's default deployment)."""
    logs = tmp_path_factory.mktemp("router-replicas")
    flags = [str(weights_root / "seed0"), "--served-model-name", MODEL, "--no-warmup"]
    flags += ["--log-level", "warning", *cli_flags(**KNOBS)]
    servers = [ServerProcess(flags, logs / f"replica{i}.log") for i in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once
            list(pool.map(lambda s: s.wait_healthy(180), servers))
        yield servers
        for s in servers:
            assert "Traceback" not in s.log(), s.log()[-3000:]
    finally:
        for s in servers:
            s.kill()


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    log = tmp_path_factory.mktemp("router") / "router.log"
    with RouterProcess([s.base for s in replicas], log) as r:
        r.wait_ready(len(replicas))
        yield r


@pytest.fixture(scope="module")
def via_router(router):
    return openai.OpenAI(base_url=router.base + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def direct(replicas):
    return openai.OpenAI(base_url=replicas[0].base + "/v1", api_key="none", max_retries=0, timeout=60)


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60)


def _sse(base: str, path: str, body: dict) -> list[dict]:
    """The `data:` events of a stream, `[DONE]` left out (and required last)."""
    with httpx.stream("POST", base + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def test_router_registers_replicas_as_sglang_workers(router, replicas):
    workers = httpx.get(router.base + "/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(s.base for s in replicas)
    for w in workers:  # read from /server_info (served_model_name) and /model_info
        assert w["model_id"] == MODEL and w["is_healthy"], w
        assert w["metadata"]["model_type"] == "llama", w
        assert json.loads(w["metadata"]["architectures"]) == ["LlamaForCausalLM"], w
    loads = httpx.get(router.base + "/get_loads", timeout=10).json()["workers"]
    assert sorted(x["worker"] for x in loads) == sorted(s.base for s in replicas)
    assert all(x["load"] >= 0 for x in loads), loads  # -1: the router could not read /get_load
    models = httpx.get(router.base + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [MODEL]


def test_openai_client_completions_and_chat_through_router(via_router, direct):
    got = via_router.completions.create(model=MODEL, prompt=LONG_PROMPT, **GREEDY)
    want = direct.completions.create(model=MODEL, prompt=LONG_PROMPT, **GREEDY)
    assert got.choices[0].text == want.choices[0].text and got.usage.completion_tokens == 12
    messages = [{"role": "user", "content": "Tell me about the harbour."}]
    got = via_router.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    want = direct.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.completion_tokens == 12


def test_openai_client_streams_through_router(via_router, direct):
    want = direct.completions.create(model=MODEL, prompt=LONG_PROMPT, **GREEDY).choices[0].text
    chunks = list(via_router.completions.create(model=MODEL, prompt=LONG_PROMPT, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "Count the boats."}]
    want = direct.chat.completions.create(model=MODEL, messages=messages, **GREEDY).choices[0].message.content
    chunks = list(via_router.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_sglang_generate_and_its_stream_through_router(router, replicas):
    body = {"text": LONG_PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}
    want = _post(replicas[0].base, "/generate", body).json()
    r = _post(router.base, "/generate", body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["text"] == want["text"] and got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["weight_version"] == "1" and got["meta_info"]["completion_tokens"] == 12
    # cache_aware sent the same text to the same replica, which holds its prefix now
    assert got["meta_info"]["cached_tokens"] > 0, got["meta_info"]
    events = _sse(router.base, "/generate", {**body, "stream": True})
    assert len(events) > 1 and events[-1]["text"] == want["text"]  # SGLang streams the text so far
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length"}


def _ascii_stop(text: str) -> tuple[str, int]:
    """Two ASCII letters first found past the start of `text`: a stop string it contains."""
    for i in range(1, len(text) - 1):
        s = text[i : i + 2]
        if s.isascii() and s.isalpha() and text.find(s) == i:
            return s, i
    raise AssertionError(f"no two-letter stop string in {text!r}")


def test_no_stop_trim_keeps_the_stop_string_through_router(router, replicas, via_router, direct):
    full = direct.completions.create(model=MODEL, prompt=LONG_PROMPT, **GREEDY).choices[0].text
    stop, at = _ascii_stop(full)
    for trim, want in ((False, full[:at]), (True, full[: at + len(stop)])):
        c = via_router.completions.create(
            model=MODEL, prompt=LONG_PROMPT, stop=[stop], extra_body={"no_stop_trim": trim}, **GREEDY
        ).choices[0]
        assert (c.text, c.finish_reason, c.stop_reason) == (want, "stop", stop)
        chunks = via_router.completions.create(
            model=MODEL,
            prompt=LONG_PROMPT,
            stop=[stop],
            stream=True,
            extra_body={"no_stop_trim": trim},
            **GREEDY,
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        params = {"max_new_tokens": 12, "temperature": 0.0, "stop": [stop], "no_stop_trim": trim}
        r = _post(router.base, "/generate", {"text": LONG_PROMPT, "sampling_params": params})
        assert r.status_code == 200 and r.json()["text"] == want, r.text
    # vLLM's name of it, on the vLLM routes (where the router does not go)
    body = {
        "model": MODEL,
        "prompt": LONG_PROMPT,
        "stop": [stop],
        "include_stop_str_in_output": True,
        **GREEDY,
    }
    r = _post(replicas[0].base, "/vllm/v1/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == full[: at + len(stop)], r.text


@pytest.mark.parametrize(
    "path,field,value",
    [
        ("/v1/completions", "return_hidden_states", True),
        ("/v1/chat/completions", "return_hidden_states", True),
        ("/generate", "return_hidden_states", True),
        ("/generate", "log_metrics", False),
        ("/generate", "background", True),
        ("/generate", "return_bytes", True),
        ("/generate", "return_entropy", True),
    ],
)
def test_what_hotswap_does_not_do_is_a_400_naming_the_field(router, path, field, value):
    body = {
        "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
        "/v1/chat/completions": {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        },
        "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    }[path]
    r = _post(router.base, path, {**body, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


def test_accepted_fields_and_unknown_ones(router, replicas):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for value in (True, False):  # no reasoning parser here: either value, the same answer
        body = {**chat, "separate_reasoning": value, "stream_reasoning": value}
        r = _post(router.base, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        r = _post(router.base, "/generate", {"text": "hi", "no_logs": value, "model": MODEL})
        assert r.status_code == 200, r.text
    r = _post(router.base, "/generate", {"text": "hi", "model": "other"})
    assert r.status_code == 404 and "other" in r.text, r.text
    # Anything else is still a 400 naming it (sent directly: the router drops chat's unknown fields).
    for path, body in (("/v1/chat/completions", chat), ("/generate", {"text": "hi"})):
        r = _post(replicas[0].base, path, {**body, "return_hiden_states": False})
        assert r.status_code == 400 and "return_hiden_states" in r.text, r.text


def test_sglang_info_routes_and_health_generate(replicas):
    base = replicas[1].base
    info = httpx.get(base + "/get_server_info", timeout=10).json()
    assert info == httpx.get(base + "/server_info", timeout=10).json()
    assert (info["served_model_name"], info["dp_size"], info["context_length"]) == (
        MODEL,
        1,
        KNOBS["max_model_len"],
    )
    model = httpx.get(base + "/get_model_info", timeout=10).json()
    assert (
        model["is_generation"] is True and model["model_type"] == "llama" and model["weight_version"] == "1"
    )
    (load,) = httpx.get(base + "/get_load", timeout=10).json()
    assert set(load) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"} and load["num_reqs"] == 0
    assert httpx.get(base + "/health_generate", timeout=30).status_code == 200
    assert _post(base, "/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        r = httpx.get(base + "/health_generate", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "paused", r.text
    finally:
        assert _post(base, "/continue_generation", {}).status_code == 200

"""vLLM's /tokenize and /detokenize on the served SmolLM2 (the session's server, no keys):
prompts tokenize as the engine's tokenizer does and come back whole; a conversation tokenizes
to exactly the prompt /v1/chat/completions feeds the model; bad input is a 400 naming it."""

from __future__ import annotations

import httpx
import pytest

from hotswap.checkpoint import gguf_io

TEXTS = [
    "The capital of France is",
    "  two leading spaces, a\ttab and\nnewlines\n\n",
    "def f(x):\n    return x ** 2  # code",
    "naïve café, São Paulo, Zürich",
    "数字 12345 and emoji 🚀🎉",
    "",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a primary colour."},
    {"role": "assistant", "content": "Red."},
    {"role": "user", "content": "Another?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def http(smol_server):
    with httpx.Client(base_url=smol_server.base, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(smollm2_gguf):
    """The engine's tokenizer: what `LLM` and `hotswap serve` read from the file."""
    return gguf_io.tokenizer_from_metadata(gguf_io.GGUFFile(smollm2_gguf).metadata)


@pytest.mark.parametrize("text", TEXTS)
def test_prompt_round_trip_is_the_engines_tokenizer(http, tok, text):
    for special in (True, False):
        r = http.post(
            "/tokenize", json={"prompt": text, "add_special_tokens": special, "return_token_strs": True}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == tok.encode(text, add_special_tokens=special)
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
        assert body["token_strs"] == [tok.id_to_token(i) for i in body["tokens"]]
        back = http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
        assert back == tok.decode(body["tokens"], skip_special_tokens=False)
        if not special:
            assert back == text
    assert http.post("/tokenize", json={"prompt": text}).json()["tokens"] == tok.encode(
        text
    )  # vLLM's default


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "tools"])
def test_chat_tokenizes_as_chat_completions_prompts(http, tools):
    """/tokenize of messages is the prompt /v1/chat/completions generates from: its
    `prompt_token_ids` and `usage.prompt_tokens`, whatever the options."""
    extra = {"tools": tools, "tool_choice": "none"} if tools else {}
    for options in (
        {},
        {"add_generation_prompt": False},
        {"add_generation_prompt": False, "continue_final_message": True},
    ):
        body = {"messages": CHAT, **options, **({"tools": tools} if tools else {})}
        t = http.post("/tokenize", json=body)
        assert t.status_code == 200, t.text
        request = {
            "messages": CHAT,
            **options,
            **extra,
            "max_tokens": 1,
            "temperature": 0,
            "return_token_ids": True,
        }
        c = http.post("/v1/chat/completions", json=request)
        assert c.status_code == 200, c.text
        assert t.json()["tokens"] == c.json()["prompt_token_ids"]
        assert t.json()["count"] == c.json()["usage"]["prompt_tokens"]
    # vLLM's add_special_tokens for chat: a BOS on top of what the template placed.
    plain = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    more = http.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True}).json()["tokens"]
    assert more[-len(plain) :] == plain and len(more) >= len(plain)


def test_vllm_prefix_serves_the_same(http):
    body = {"prompt": "The capital of France is"}
    assert http.post("/vllm/tokenize", json=body).json() == http.post("/tokenize", json=body).json()
    assert (
        http.post("/vllm/detokenize", json={"tokens": [504, 3575]}).json()
        == http.post("/detokenize", json={"tokens": [504, 3575]}).json()
    )


@pytest.mark.parametrize(
    ("route", "body", "says"),
    [
        ("/tokenize", {}, "exactly one of `prompt` or `messages` (neither was given)"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, "(both were given)"),
        (
            "/tokenize",
            {"prompt": "a", "add_generation_prompt": True},
            "add_generation_prompt: applies to `messages`",
        ),
        ("/tokenize", {"messages": []}, "a conversation is a non-empty list"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model 'other' is not served here"),
        ("/tokenize", {"prompt": "a", "chat_template": "{{ x }}"}, "unknown field 'chat_template'"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "cannot both be true"),
        (
            "/detokenize",
            {"tokens": [1, 49152]},
            "tokens[1]: token id 49152 is outside the vocabulary [0, 49152)",
        ),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]: token id -1 is outside the vocabulary"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_it(http, route, body, says):
    r = http.post(route, json=body)
    assert r.status_code in (400, 404), r.text
    assert says in r.json()["error"]["message"], r.json()
    assert r.status_code == (404 if "model" in body else 400)

"""Tool calling through `hotswap serve` on the default model (SmolLM2-135M-Instruct) with the `openai` client.

Named and `required` tool choices constrain the output (engine/structured.py), so their
arguments validate against the tool's parameters; `auto` parses the model's own text; a
two-turn agent loop (call -> result -> answer) hits the prefix cache on turn 2; streamed
`tool_calls` deltas add up to the non-streamed calls; bad tools or choices are a 400 naming the
field. SmolLM2's chat template renders no tools, so hotswap writes them in its model card's form
(hotswap/toolcalls/prompt.py).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from api_helpers import SMOL, openai_client

MODEL = SMOL
PAGE = 16  # the shared server's page size
GREEDY = {"temperature": 0.0, "max_tokens": 48}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "hours": {"type": "integer", "minimum": 0, "maximum": 23},
            },
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(smol_server):
    return smol_server  # the session's SmolLM2 server (conftest.py), shared with the structured-output tests


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _chat(client, messages=ASK, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **{**GREEDY, **kw})


def _valid_calls(choice) -> list[tuple[str, dict]]:
    """The choice's calls, each checked against its tool's parameters."""
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = []
    for call in choice.message.tool_calls:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        assert call.type == "function" and call.id.startswith("call_")
        calls.append((call.function.name, args))
    return calls


def _streamed(client, **kw) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) put together from the chunks, as a client does."""
    content, calls, finish = "", {}, None
    for chunk in _chat(client, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for piece in c.delta.tool_calls or []:
                if piece.index not in calls:
                    assert piece.id and piece.function.name  # a call's first piece names it
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_named_tool_choice_gives_arguments_that_validate(client):
    r = _chat(client, tool_choice=NAMED)
    [(name, args)] = _valid_calls(r.choices[0])
    assert name == "get_weather"
    streamed = _streamed(client, tool_choice=NAMED)
    call = r.choices[0].message.tool_calls[0]
    assert streamed == ("", [(call.function.name, call.function.arguments)], "tool_calls")


# As agent frameworks declare tools: no `additionalProperties`, so JSON Schema reads it open.
OPEN_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {
                    "type": "string",
                    "enum": ["celsius", "fahrenheit"],
                    "description": "Temperature unit",
                },
            },
            "required": ["city"],
        },
    },
}


def test_named_tool_with_open_parameters_gives_only_the_named_keys(client):
    """Strict mode by default (vLLM's default backend): the arguments take only the keys the
    parameters name, greedy and sampled. Under the spec's open reading (the engine option off)
    SmolLM2 added keys to every one of these calls ("type", "function", "description", ...)."""
    params = OPEN_WEATHER["function"]["parameters"]

    def ask(temperature: float, seed: int | None):
        return client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[OPEN_WEATHER],
            tool_choice=NAMED,
            temperature=temperature,
            seed=seed,
            max_tokens=64,
        )

    runs = [(0.0, None)] + [(0.7, seed) for seed in range(4)]
    with ThreadPoolExecutor(len(runs)) as pool:
        replies = list(pool.map(lambda a: ask(*a), runs))
    for run, r in zip(runs, replies, strict=True):
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (run, c.message)
        [call] = c.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), {**params, "additionalProperties": False})


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_gives_calls_that_validate(client, parallel):
    asks = [*ASK[:0], {"role": "user", "content": "What is the weather in Paris, and the time in CET?"}]
    r = _chat(client, asks, tool_choice="required", parallel_tool_calls=parallel, max_tokens=96)
    calls = _valid_calls(r.choices[0])
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    streamed = _streamed(
        client, messages=asks, tool_choice="required", parallel_tool_calls=parallel, max_tokens=96
    )
    assert streamed == (
        "",
        [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls],
        "tool_calls",
    )


# SmolLM2-135M asked to copy a call writes it in its card's form between prose (greedy; the text
# is recorded in tests/engine/test_tool_parsers.py). The stop string ends the turn at the block's end.
COPY = [
    {
        "role": "user",
        "content": 'Copy this text: <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>',
    }
]


def test_auto_parses_the_model_s_own_call(client):
    kw = dict(tool_choice="auto", stop=["</tool_call>"])
    r = _chat(client, COPY, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "The example format is as follows:\n\n"
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    content, calls, finish = _streamed(client, messages=COPY, **kw)
    assert (content, calls, finish) == (
        choice.message.content,
        [("get_weather", call.function.arguments)],
        "tool_calls",
    )
    # Chunks the reader held back carry their tokens' logprobs in the next chunk: none is lost.
    chunks = list(
        _chat(client, COPY, stream=True, logprobs=True, stream_options={"include_usage": True}, **kw)
    )
    entries = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
    assert entries == chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # tool_choice "none": nothing parsed.
    plain = _chat(client, COPY, tool_choice="none").choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason in ("stop", "length")


def test_two_turn_agent_loop_hits_the_prefix_cache(client):
    turn_1 = _chat(client, tool_choice=NAMED)
    [call] = turn_1.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    messages = [
        *ASK,
        turn_1.choices[0].message.model_dump(exclude_none=True),  # content None, tool_calls with JSON text
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"city": args["city"], "sky": "sunny", "celsius": 24}),
        },
    ]
    turn_2 = _chat(client, messages, tool_choice="none", max_tokens=24)
    answer = turn_2.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    cached = turn_2.usage.prompt_tokens_details.cached_tokens
    # Every full page of turn 1's prompt is found again: turn 2's prompt begins with it.
    assert cached >= turn_1.usage.prompt_tokens // PAGE * PAGE, (cached, turn_1.usage.prompt_tokens)
    assert turn_2.usage.prompt_tokens > turn_1.usage.prompt_tokens


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "get_sky"}}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"description": "nameless"}}]},
            "tools[0].function.name",
        ),
        (
            {
                "tools": [
                    WEATHER,
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}},
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
        ),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, **{"tools": TOOLS, **GREEDY, **kw})
    assert e.value.body["param"] == param and param in e.value.message


def test_bad_tool_message_is_a_400(client):
    bad = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
        },
    ]
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
        _chat(client, bad)


def test_the_docs_agent_loop_runs_on_the_default_model(server):
    from doc_pages import DOCS, python_blocks  # docs/zh_cn's code is the same (tests/project/test_docs.py)

    [block] = [b for b in python_blocks(DOCS / "en" / "serving.md") if "get_weather" in b.code]
    ns = {"BASE_URL": server.base, "API_KEY": "no-key"}  # the shared server takes any key
    exec(compile("\n" * (block.line - 1) + block.code, "docs/en/serving.md", "exec"), ns)
    roles = [m["role"] for m in ns["messages"]]
    assert roles[:3] == ["user", "assistant", "tool"] and roles[-1] == "assistant"
    assert ns["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert ns["reply"].choices[0].finish_reason != "tool_calls" and ns["message"].content
    assert ns["reply"].usage.prompt_tokens_details.cached_tokens > 0

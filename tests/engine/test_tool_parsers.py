"""Tool-call parsers, tool_choice constraints and tools in the prompt (hotswap/toolcalls/), without a model.

The texts are what each family's models write: Qwen2.5's function-calling docs (Hermes form),
Meta's Llama 3.1/3.2 JSON tool calling, Mistral's two tokenizer generations, and SmolLM2-135M-
Instruct's own greedy answer through hotswap (recorded). Each is read whole and streamed in two
pieces at every split point and one character at a time; the stream must give what the whole
text gives.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from hotswap.checkpoint.tokenizer import Tokenizer
from hotswap.engine.chat import chat_prompt
from hotswap.errors import ConfigError, RequestError
from hotswap.toolcalls import formats, parse_tool_calls
from hotswap.toolcalls.choice import ToolChoice
from hotswap.toolcalls.formats import FORMATS, HERMES, LLAMA3_JSON, MISTRAL, SMOLLM2
from hotswap.toolcalls.parsers import MarkerStream, ToolCallDelta, assemble, collect
from hotswap.toolcalls.prompt import renders_tools, tool_prompt

WEATHER = '{"location": "San Francisco, CA, USA"}'
DATED = '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}'

# (format, text, expected content, expected [(name, arguments JSON)])
RECORDED = {
    "hermes single": (
        HERMES,
        f'<tool_call>\n{{"name": "get_current_temperature", "arguments": {WEATHER}}}\n</tool_call>',
        None,
        [("get_current_temperature", WEATHER)],
    ),
    "hermes parallel": (
        HERMES,
        f'<tool_call>\n{{"name": "get_current_temperature", "arguments": {WEATHER}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "get_temperature_date", "arguments": {DATED}}}\n</tool_call>',
        None,
        [("get_current_temperature", WEATHER), ("get_temperature_date", DATED)],
    ),
    "hermes after thinking (Qwen3)": (
        HERMES,
        "<think>\nThe user wants the temperature.\n</think>\n\n"
        f'<tool_call>\n{{"name": "get_current_temperature", "arguments": {WEATHER}}}\n</tool_call>',
        "<think>\nThe user wants the temperature.\n</think>\n\n",
        [("get_current_temperature", WEATHER)],
    ),
    "hermes unclosed at the end": (
        HERMES,
        f'<tool_call>\n{{"name": "get_current_temperature", "arguments": {WEATHER}}}\n',
        None,
        [("get_current_temperature", WEATHER)],
    ),
    "llama3 single": (
        LLAMA3_JSON,
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": '
        '"Fahrenheit"}}<|eot_id|>',
        None,
        [("get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')],
    ),
    "llama3 python_tag, parallel": (
        LLAMA3_JSON,
        '<|python_tag|>{"name": "get_current_conditions", "parameters": {"location": "Paris"}}; '
        '{"name": "get_time", "parameters": {"timezone": "CET"}}<|eom_id|>',
        None,
        [("get_current_conditions", '{"location": "Paris"}'), ("get_time", '{"timezone": "CET"}')],
    ),
    "mistral v3": (
        MISTRAL,
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": '
        '"celsius"}}]</s>',
        None,
        [("get_current_weather", '{"location": "Paris, France", "format": "celsius"}')],
    ),
    "mistral v3 parallel": (
        MISTRAL,
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France"}}, '
        '{"name": "get_current_weather", "arguments": {"location": "Lyon, France"}}]</s>',
        None,
        [
            ("get_current_weather", '{"location": "Paris, France"}'),
            ("get_current_weather", '{"location": "Lyon, France"}'),
        ],
    ),
    "mistral v11 parallel": (
        MISTRAL,
        'Checking both.[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France"}'
        '[TOOL_CALLS]get_time[ARGS]{"city": "Paris"}</s>',
        "Checking both.",
        [("get_current_weather", '{"location": "Paris, France"}'), ("get_time", '{"city": "Paris"}')],
    ),
    "smollm2 single": (
        SMOLLM2,
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    "smollm2 parallel": (
        SMOLLM2,
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Lyon"}}]</tool_call>',
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Lyon"}')],
    ),
    # SmolLM2-135M-Instruct, greedy, max_tokens=60, asked to copy a call (tests/server/test_tool_calls_server.py):
    # a call between prose, then a second block cut off by max_tokens, which stays text.
    "smollm2 recorded, cut short": (
        SMOLLM2,
        'The example format is as follows:\n\n<tool_call>[\n{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}]</tool_call>\n\nThe example format is as follows:\n\n<tool_call>[\n{"name',
        'The example format is as follows:\n\n\n\nThe example format is as follows:\n\n<tool_call>[\n{"name',
        [("get_weather", '{"city": "Paris"}')],
    ),
}

MALFORMED = {
    "hermes": (
        HERMES,
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": }\n</tool_call>',
    ),
    "hermes no name": (HERMES, '<tool_call>\n{"arguments": {"location": "Paris"}}\n</tool_call>'),
    "llama3": (LLAMA3_JSON, '{"name": "get_current_conditions", "parameters": {"location": "Paris"}'),
    "llama3 plain JSON": (LLAMA3_JSON, '{"answer": 42}'),
    "llama3 bad separator": (
        LLAMA3_JSON,
        '{"name": "a", "parameters": {}} , {"name": "b", "parameters": {}}',
    ),
    "mistral": (MISTRAL, '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris"}]'),
    "mistral v11": (MISTRAL, '[TOOL_CALLS]get_current_weather[ARGS]{"location": '),
    "smollm2": (SMOLLM2, '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>'),
}


def _plain(result):
    content, calls = result
    return content, [(c.name, c.arguments) for c in calls]


def _streamed(fmt, pieces: list[str], **kw):
    stream = MarkerStream(fmt, **kw)
    return assemble([*(stream.feed(p) for p in pieces), stream.flush()])


@pytest.mark.parametrize("case", RECORDED)
def test_recorded_text_reads_whole_and_streamed_at_every_split(case):
    fmt, text, content, calls = RECORDED[case]
    whole = _plain(collect(MarkerStream(fmt), text))
    assert whole == (content, calls)
    assert _plain(parse_tool_calls(text, fmt.name)) == whole
    for cut in range(len(text) + 1):
        assert _plain(_streamed(fmt, [text[:cut], text[cut:]])) == whole, cut
    assert _plain(_streamed(fmt, list(text))) == whole


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_call_stays_plain_content(case):
    fmt, text = MALFORMED[case]
    assert _plain(collect(MarkerStream(fmt), text)) == (text, [])
    for cut in range(len(text) + 1):
        assert _plain(_streamed(fmt, [text[:cut], text[cut:]])) == (text, []), cut


def test_a_possible_marker_is_held_back_until_decided():
    stream = MarkerStream(HERMES)
    assert stream.feed("It is a < b, so <tool").content == "It is a < b, so "
    assert stream.feed("_c").content == ""  # still `<tool_c`: may be `<tool_call>`
    assert stream.feed("ar").content == "<tool_car"
    assert stream.flush().content == ""
    # Llama 3's leading `{`: blank text waits for the first character.
    stream = MarkerStream(LLAMA3_JSON)
    assert not stream.feed("\n ")
    assert stream.feed("Hi").content == "\n Hi"


def test_streamed_call_pieces_are_openai_deltas():
    fmt, text, _, _ = RECORDED["hermes parallel"]
    stream = MarkerStream(fmt)
    cut = text.index("</tool_call>") + len("</tool_call>")
    first, second = stream.feed(text[:cut]), stream.feed(text[cut:]) + stream.flush()
    assert first.content == "" and second.content == ""  # the newline between the blocks is dropped
    (a,), (b,) = first.tool_calls, second.tool_calls
    assert a.to_openai() == {
        "index": 0,
        "id": a.id,
        "type": "function",
        "function": {"name": "get_current_temperature", "arguments": WEATHER},
    }
    assert a.id.startswith("call_") and b.index == 1 and b.id != a.id
    assert ToolCallDelta(1, '"}').to_openai() == {"index": 1, "function": {"arguments": '"}'}}


def test_parallel_tool_calls_false_keeps_the_first_call():
    fmt, text, _, calls = RECORDED["hermes parallel"]
    assert _plain(collect(MarkerStream(fmt, max_calls=1), text)) == (None, calls[:1])
    assert _plain(parse_tool_calls(text, fmt, "auto", parallel_tool_calls=False)) == (None, calls[:1])


def test_mistral_call_ids_are_nine_alphanumerics():
    _, calls = collect(MarkerStream(MISTRAL), RECORDED["mistral v11 parallel"][1])
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_reads_what_it_writes(name):
    fmt = FORMATS[name]
    calls = [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {})]
    text = fmt.write(calls)
    assert _plain(collect(MarkerStream(fmt), text)) == (None, [(n, json.dumps(a)) for n, a in calls])


def test_registry_names_and_template_detection():
    assert formats.get_format("qwen25") is HERMES and formats.get_format("llama3") is LLAMA3_JSON
    assert set(formats.PARSER_NAMES) == {"hermes", "qwen25", "llama3_json", "llama3", "mistral", "smollm2"}
    with pytest.raises(ConfigError, match="tool_call_parser"):
        formats.get_format("pythonic")
    assert formats.from_template("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert formats.from_template("{{ '<|python_tag|>' }}{{ '<tool_call>' }}") is LLAMA3_JSON
    assert formats.from_template("[AVAILABLE_TOOLS] [TOOL_CALLS]") is MISTRAL
    assert formats.from_template("{{ messages }}") is SMOLLM2 and formats.from_template(None) is SMOLLM2
    assert formats.choose("mistral", "<tool_call>") is MISTRAL


# ---- tool_choice ---------------------------------------------------------------------------

GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
GET_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"$ref": "#/$defs/zone"}},
            "$defs": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        },
    },
}
NO_PARAMS = {"type": "function", "function": {"name": "ping"}}


def test_named_choice_constrains_to_the_tool_parameters():
    choice = ToolChoice.of([GET_WEATHER, GET_TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert choice.constraint() == {"json": GET_WEATHER["function"]["parameters"]}
    assert choice.offered == [GET_WEATHER, GET_TIME]
    content, calls = collect(choice.stream(SMOLLM2), '{"city": "Paris"}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    empty = ToolChoice.of([NO_PARAMS], {"type": "function", "function": {"name": "ping"}})
    assert empty.constraint() == {"json": {"type": "object", "properties": {}}}


@pytest.mark.parametrize("parallel", [None, False])
def test_required_choice_is_a_list_of_named_calls(parallel):
    choice = ToolChoice.of([GET_WEATHER, GET_TIME, NO_PARAMS], "required", parallel)
    schema = choice.constraint()["json"]
    ok = [
        {"name": "get_weather", "parameters": {"city": "Paris"}},
        {"name": "get_time", "parameters": {"zone": "CET"}},
    ]
    jsonschema.validate(ok[:1], schema)
    if parallel is False:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(ok, schema)
    else:
        jsonschema.validate(ok, schema)
    for bad in (
        [],
        [{"name": "get_sky", "parameters": {}}],
        [{"name": "get_weather", "parameters": {"unit": "kelvin"}}],  # no city, unknown unit
        [{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}],  # the hoisted $defs apply
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    content, calls = collect(choice.stream(SMOLLM2), json.dumps(ok[:1]))
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    # Cut short by max_tokens: the text is the content, no calls.
    assert collect(choice.stream(SMOLLM2), '[{"name": "get_weather", "param') == (
        '[{"name": "get_weather", "param',
        [],
    )


def test_none_and_auto():
    none = ToolChoice.of([GET_WEATHER], "none")  # the tools stay in the prompt: it stays the turn's prefix
    assert none.offered == [GET_WEATHER] and none.stream(SMOLLM2) is None and none.constraint() is None
    auto = ToolChoice.of([GET_WEATHER])  # OpenAI's default with tools
    assert auto.mode.name == "auto" and auto.constraint() is None
    assert auto.sampling_overrides(SMOLLM2, constrained=False) == {}
    assert auto.sampling_overrides(MISTRAL, constrained=False) == {"skip_special_tokens": False}
    assert ToolChoice.of(None, None).mode.name == "none"
    assert ToolChoice.of([], "auto").offered is None and ToolChoice.of([], "auto").stream(SMOLLM2) is None


@pytest.mark.parametrize(
    ("tools", "tool_choice", "field"),
    [
        ([GET_WEATHER], {"type": "function", "function": {"name": "get_sky"}}, "tool_choice"),
        ([GET_WEATHER], {"type": "function"}, "tool_choice"),
        ([GET_WEATHER], "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
        ([{"type": "function", "function": {"description": "no name"}}], "auto", "tools[0].function.name"),
        ([GET_WEATHER, {"type": "retrieval"}], "auto", "tools[1].type"),
        ([GET_WEATHER, GET_WEATHER], "auto", "tools[1].function.name"),
        (
            [GET_WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
            "required",
            "tools[1].function.parameters",
        ),
        (
            [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"properties": {"x": {"pattern": "(("}}}},
                }
            ],
            {"type": "function", "function": {"name": "f"}},
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
            "auto",
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tools_or_choice_name_the_field(tools, tool_choice, field):
    with pytest.raises(RequestError) as e:
        ToolChoice.of(tools, tool_choice)
    assert e.value.param == field and str(e.value).startswith(field + ":")


def test_a_constraint_conflicts_with_another():
    choice = ToolChoice.of([GET_WEATHER], "required")
    with pytest.raises(RequestError, match="tool_choice"):
        choice.sampling_overrides(SMOLLM2, constrained=True)


# ---- the prompt ----------------------------------------------------------------------------

# A Qwen2.5-style template: it renders `tools`, assistant `tool_calls` (arguments as a dict) and tool results.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TURN_1 = [{"role": "user", "content": "Weather in Paris?"}]
TURN_2 = [
    *TURN_1,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
]


def test_template_that_renders_tools_gets_them_and_dict_arguments(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    assert renders_tools(TOOLS_TEMPLATE) and not renders_tools(tok.chat_template)
    text, _ = chat_prompt(tok, TURN_2, chat_template=TOOLS_TEMPLATE, tools=[GET_WEATHER], tool_format=HERMES)
    assert json.dumps(GET_WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in text


def test_template_without_tools_gets_them_written_by_the_family(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)  # its ChatML template knows system/user/assistant only
    first, ids_1 = chat_prompt(tok, TURN_1, tools=[GET_WEATHER])
    second, ids_2 = chat_prompt(tok, TURN_2, tools=[GET_WEATHER])
    assert first.count("<|im_start|>system") == 1 and SMOLLM2.instructions([GET_WEATHER]) in first
    assert (
        '<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
        in second
    )
    assert "<|im_start|>user\n<tool_response>\nsunny, 24 C\n</tool_response>" in second
    assert ids_2[: len(ids_1)] == ids_1  # turn 2 begins with turn 1's prompt: a prefix-cache hit
    # A system message of the caller's own keeps its text, the tools follow it.
    messages, variables = tool_prompt(
        [{"role": "system", "content": "Be brief."}, *TURN_1], [GET_WEATHER], HERMES, None
    )
    assert variables == {} and messages[0]["content"].startswith("Be brief.\n\n# Tools")
    # No tools offered: the history is still written, no instructions.
    none, _ = chat_prompt(tok, TURN_2)
    assert "<tool_call>" in none and "You are an expert in composing functions" not in none


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (
            {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{bad"}}]},
            "tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]},
            "tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
            "tool_calls[0].function.name",
        ),
        ({"role": "assistant", "tool_calls": "call_1"}, "tool_calls"),
        ({"role": "user", "tool_calls": [CALL]}, "tool_calls"),
        ({"role": "tool", "content": "x", "tool_call_id": 7}, "tool_call_id"),
    ],
)
def test_bad_tool_messages_name_the_field(tiny_dir, message, field):
    with pytest.raises(RequestError, match=re.escape(f"messages[1].{field}:")):
        chat_prompt(Tokenizer.from_dir(tiny_dir), [*TURN_1, message])


# ---- LLM.chat ------------------------------------------------------------------------------


def test_llm_chat_offers_tools_and_constrains_a_named_choice(tiny_dir):
    from hotswap import LLM, SamplingParams

    llm = LLM(tiny_dir, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, warmup=False)
    city = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    template = "{{ tools | length }} tool(s){% for m in messages %}|{{ m.content }}{% endfor %}|"  # short: a tiny context
    greedy = SamplingParams(temperature=0.0, max_tokens=64)  # byte-sized tokens
    [out] = llm.chat(TURN_1, greedy, use_tqdm=False, chat_template=template, tools=tools, tool_choice=named)
    assert out.prompt == "1 tool(s)|Weather in Paris?|"
    content, [call] = parse_tool_calls(out.outputs[0].text, llm.tool_parser, named)
    assert content is None and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), city)  # random weights, constrained output
    with pytest.raises(RequestError, match="tool_choice"):
        llm.chat(TURN_1, greedy, tools=tools, tool_choice={"type": "function", "function": {"name": "nope"}})

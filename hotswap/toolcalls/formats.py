"""Tool-call formats: how each model family writes a call, and the names vLLM and SGLang give them.

A format is a pair of markers and a body. An opening marker (`<tool_call>`, `[TOOL_CALLS]`,
`<|python_tag|>`; for Llama 3 also a `{` that begins the output) starts a block; the closing
marker, or where there is none the next opening marker or the end of the output, ends it. The
body reads as calls (`read`) or not at all: a block that does not read stays text
(`parsers.MarkerStream` drives the scan, the same for a whole text and a stream).

Each format also writes calls and tool results back in its own form, and says what a system
prompt must tell the model: `prompt.py` uses them for a chat template that does not render
tools itself (SmolLM2's).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from hotswap.errors import ConfigError

Calls = list[tuple[str, dict[str, Any]]]  # (function name, arguments)

_NAME = re.compile(r"[A-Za-z0-9_.:\-]+")


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _call(obj: Any) -> tuple[str, dict[str, Any]] | None:
    """{"name": ..., "arguments" | "parameters": {...}} -> (name, arguments), else None. Arguments
    written as a JSON string (some fine-tunes do) are read; missing ones are {}."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(name, str) or not _NAME.fullmatch(name) or not isinstance(args, dict):
        return None
    return name, args


def read_json_calls(text: str) -> Calls | None:
    """One call object or a JSON list of them (an empty list: no calls)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    calls = [_call(v) for v in (value if isinstance(value, list) else [value])]
    return calls if all(c is not None for c in calls) else None  # type: ignore[return-value]


def _read_llama3(text: str) -> Calls | None:
    """Call objects separated by `;` (Llama 3.x's parallel calls)."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        call = _call(obj)
        if call is None:
            return None
        calls.append(call)
        rest = text[i:].lstrip()
        if rest and not rest.startswith(";"):
            return None
        i = len(text) - len(rest) + 1
        while i < len(text) and text[i].isspace():
            i += 1
    return calls or None


def _read_mistral(text: str) -> Calls | None:
    """`[{"name", "arguments"}, ...]` (tokenizers up to v7) or `name[ARGS]{...}` (v11 on)."""
    text = text.strip()
    if text.startswith(("[", "{")):
        return read_json_calls(text)
    name, sep, args = text.partition("[ARGS]")
    if not sep:
        return None
    call = _call({"name": name.strip(), "arguments": args.strip()})
    return [call] if call else None


def _tool_list(tools: Sequence[dict]) -> str:
    return _dumps(list(tools))


# The system prompts below are each family's documented wording (SmolLM2's model card, Qwen2.5's
# chat template, Meta's Llama 3.1 JSON tool-calling prompt), so the model sees what it was tuned on.


def _smollm2_prompt(tools: Sequence[dict]) -> str:
    return (
        "You are an expert in composing functions. You are given a question and a set of possible functions. \n"
        "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. \n"
        "If none of the functions can be used, point it out and refuse to answer. \n"
        "If the given question lacks the parameters required by the function, also point it out.\n\n"
        f"You have access to the following tools:\n<tools>{_tool_list(tools)}</tools>\n\n"
        "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
        "The example format is as follows. Please make sure the parameter type is correct. If no function "
        "call is needed, please make the tool calls an empty list '[]'.\n"
        "<tool_call>[\n"
        '{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},\n'
        "... (more tool calls as required)\n"
        "]</tool_call>"
    )


def _hermes_prompt(tools: Sequence[dict]) -> str:
    listed = "\n".join(_dumps(t) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n"
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _llama3_prompt(tools: Sequence[dict]) -> str:
    listed = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
    return (
        "Given the following functions, please respond with a JSON for a function call with its proper "
        "arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
        f"value}}. Do not use variables.\n\n{listed}"
    )


def _mistral_prompt(tools: Sequence[dict]) -> str:
    return f"[AVAILABLE_TOOLS]{_tool_list(tools)}[/AVAILABLE_TOOLS]"


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _mistral_id() -> str:
    # Mistral's templates refuse tool call ids that are not 9 alphanumeric characters.
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call form.

    starts: opening markers; end: the closing marker (None: a block runs to the next opening
    marker or the end of the output); leading: a block also opens where the output, after
    whitespace, begins with this; special: the markers are special tokens, so the output must be
    decoded with them kept; stop_texts: end-of-turn special tokens that then show in the text
    and end it; template_markers: what in a chat template's text says it is this family's.
    """

    name: str
    aliases: tuple[str, ...]
    starts: tuple[str, ...]
    end: str | None
    read: Callable[[str], Calls | None]
    write: Callable[[Calls], str]
    instructions: Callable[[Sequence[dict]], str]
    template_markers: tuple[str, ...] = ()
    leading: str | None = None
    special: bool = False
    stop_texts: tuple[str, ...] = ()
    new_id: Callable[[], str] = _call_id

    def result(self, content: str) -> str:
        """A tool's result as a user turn's text, for a template with no tool role (ChatML's
        `<tool_response>`, which Qwen's and Hermes' templates use)."""
        return f"<tool_response>\n{content}\n</tool_response>"


HERMES = ToolFormat(
    name="hermes",
    aliases=("qwen25",),
    starts=("<tool_call>",),
    end="</tool_call>",
    read=read_json_calls,
    write=lambda calls: "\n".join(
        f"<tool_call>\n{_dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls
    ),
    instructions=_hermes_prompt,
    template_markers=("<tool_call>",),
)
SMOLLM2 = ToolFormat(
    name="smollm2",
    aliases=(),
    starts=("<tool_call>",),
    end="</tool_call>",
    read=read_json_calls,
    write=lambda calls: f"<tool_call>{_dumps([{'name': n, 'arguments': a} for n, a in calls])}</tool_call>",
    instructions=_smollm2_prompt,
)
LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    aliases=("llama3",),
    starts=("<|python_tag|>",),
    end=None,
    read=_read_llama3,
    write=lambda calls: "; ".join(_dumps({"name": n, "parameters": a}) for n, a in calls),
    instructions=_llama3_prompt,
    template_markers=("<|python_tag|>", "please respond with a JSON for a function call"),
    leading="{",
    special=True,
    stop_texts=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
)
MISTRAL = ToolFormat(
    name="mistral",
    aliases=(),
    starts=("[TOOL_CALLS]",),
    end=None,
    read=_read_mistral,
    write=lambda calls: "[TOOL_CALLS]" + _dumps([{"name": n, "arguments": a} for n, a in calls]),
    instructions=_mistral_prompt,
    template_markers=("[TOOL_CALLS]",),
    special=True,
    stop_texts=("</s>",),
    new_id=_mistral_id,
)

FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, SMOLLM2)}
_BY_NAME = {**FORMATS, **{a: f for f in FORMATS.values() for a in f.aliases}}
PARSER_NAMES = tuple(_BY_NAME)  # `--tool-call-parser`'s choices: hotswap's, vLLM's and SGLang's names
# Checked in this order: Llama 3.1's and Mistral's templates also mention what a later one looks for.
_DETECT = (MISTRAL, LLAMA3_JSON, HERMES)


def get_format(name: str) -> ToolFormat:
    if name not in _BY_NAME:
        raise ConfigError(
            f"tool_call_parser: unknown parser {name!r}; choose one of {', '.join(PARSER_NAMES)}"
        )
    return _BY_NAME[name]


def from_template(template: str | None) -> ToolFormat:
    """The family a chat template's text is written for, by the markers it contains. A template
    with none (SmolLM2's, which renders no tools) gets SmolLM2's form: `prompt.py` then writes
    the tools and calls into the messages itself."""
    for fmt in _DETECT:
        if template and any(m in template for m in fmt.template_markers):
            return fmt
    return SMOLLM2


def choose(name: str | None, template: str | None) -> ToolFormat:
    """`--tool-call-parser` when given, else the template's family."""
    return get_format(name) if name else from_template(template)

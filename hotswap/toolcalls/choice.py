"""`tools` + `tool_choice` + `parallel_tool_calls`: what a request offers, how its output is
constrained, and how that output is read back as calls.

- `none`: nothing is constrained or parsed. The tools stay in the prompt, as vLLM keeps them: a
  conversation's prompt is then the same for every turn whatever each turn chose, so turn k+1
  begins with turn k's prompt and finds it in the prefix cache.
- `auto` (the default with tools): the tools are offered; the family's form is parsed after the
  fact (`parsers.MarkerStream`).
- `required`: the output is constrained to a JSON list of `{"name": <a tool's name>,
  "parameters": <that tool's parameters>}`, at least one (exactly one without parallel calls);
  vLLM's scheme.
- named (`{"type": "function", "function": {"name": ...}}`): the output is constrained to that
  tool's parameters, and the call is built with that name.

The constraint is `structured_outputs`' JSON form (`{"json": schema}`), which `SamplingParams`
reads into the engine's `StructuredOutputs`. Like every JSON schema it compiles in strict mode
unless the engine turns that off (engine/strict_schema.py): a tool whose `parameters` leave
`additionalProperties` out still gets only the keys they name, as from vLLM. Bad input is a `RequestError` naming the field, raised
before anything is queued.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import llguidance

from hotswap.errors import RequestError
from hotswap.toolcalls.formats import ToolFormat, get_format
from hotswap.toolcalls.parsers import ArgumentsStream, ListStream, MarkerStream, ToolCall, ToolStream, collect

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_DEFS = ("$defs", "definitions")  # where a schema keeps the subschemas its `$ref`s name


def _check_tools(tools: Any) -> tuple[dict, ...]:
    """OpenAI's `tools`: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    if tools is None:
        return ()
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise RequestError.of_field("tools", "expected a list of {'type': 'function', 'function': {...}}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestError.of_field(f"tools[{i}].type", "only function tools are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise RequestError.of_field(f"tools[{i}].function", "expected an object with a 'name'")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError.of_field(f"tools[{i}].function.name", "expected a non-empty string")
        if name in seen:
            raise RequestError.of_field(
                f"tools[{i}].function.name", f"{name!r} is named by an earlier tool too"
            )
        seen.add(name)
        if not isinstance(fn.get("parameters", {}), dict):
            raise RequestError.of_field(f"tools[{i}].function.parameters", "expected a JSON schema object")
    return tuple(tools)


def _check_schema(field: str, schema: dict) -> None:
    """What the grammar library makes of the schema, without a tokenizer (microseconds)."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        raise RequestError.of_field(field, messages[0] if messages else "not a usable JSON schema")


@dataclasses.dataclass(frozen=True)
class Mode:
    """One tool_choice mode's row: the ToolChoice methods read these columns and never branch on
    a mode's name."""

    name: str
    needs_tools: bool = False  # refused without `tools`
    # The constraint on the output (structured_outputs' JSON form), or None: unconstrained.
    constraint: Callable[[ToolChoice], dict | None] = lambda _c: None
    # A fresh reader of one output's calls, or None: nothing is parsed.
    reader: Callable[[ToolChoice, ToolFormat], ToolStream | None] = lambda _c, _f: None
    # Whether a tool's schema is compiled now (it will constrain the output).
    compiles: Callable[[ToolChoice, str], bool] = lambda _c, _n: False
    parses_markers: bool = False  # the family's markers (maybe special tokens) are read back


def _required_schema(c: ToolChoice) -> dict:
    """vLLM's `required` scheme: a JSON list of {"name": <a tool>, "parameters": <its schema>}."""
    defs: dict[str, Any] = {}
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": _hoist(schema, defs)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in c.parameters().items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not c.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return {"json": schema}


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("none"),
        Mode(
            "auto",
            reader=lambda c, fmt: MarkerStream(fmt, max_calls=None if c.parallel else 1),
            parses_markers=True,
        ),
        Mode(
            "required",
            needs_tools=True,
            constraint=_required_schema,
            reader=lambda c, fmt: ListStream(fmt.new_id),
            compiles=lambda c, name: True,
        ),
        Mode(
            "named",
            needs_tools=True,
            constraint=lambda c: {"json": c.parameters()[c.name]},
            reader=lambda c, fmt: ArgumentsStream(c.name, fmt.new_id),
            compiles=lambda c, name: name == c.name,
        ),
    )
}
_STRING_MODES = ("none", "auto", "required")  # the named mode is a dict


def _mode(tool_choice: Any) -> tuple[Mode, str | None]:
    """tool_choice -> (its mode's row, the named tool or None)."""
    if isinstance(tool_choice, str):
        if tool_choice not in _STRING_MODES:
            raise RequestError.of_field(
                "tool_choice", f"expected one of {_STRING_MODES} or a named function, got {tool_choice!r}"
            )
        return MODES[tool_choice], None
    choice = tool_choice if isinstance(tool_choice, dict) else {}
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
        raise RequestError.of_field("tool_choice", "expected {'type': 'function', 'function': {'name': ...}}")
    return MODES["named"], name


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    """A request's checked tools and what it chose. `of` raises on bad input."""

    tools: tuple[dict, ...] = ()
    mode: Mode = MODES["none"]
    name: str | None = None  # the named tool
    parallel: bool = True

    @classmethod
    def of(
        cls, tools: Any = None, tool_choice: Any = None, parallel_tool_calls: bool | None = None
    ) -> ToolChoice:
        checked = _check_tools(tools)
        mode, name = (MODES["auto"], None) if tool_choice is None else _mode(tool_choice)
        if mode.needs_tools and not checked:
            raise RequestError.of_field("tool_choice", f"{mode.name!r} needs `tools`")
        if not checked:
            mode = MODES["none"]  # no tools offered: nothing to parse
        out = cls(checked, mode, name, parallel_tool_calls is not False)
        if name is not None and name not in out.parameters():
            raise RequestError.of_field(
                "tool_choice", f"names {name!r}, which is not in `tools` ({', '.join(out.parameters())})"
            )
        for i, (tool_name, schema) in enumerate(out.parameters().items()):
            if mode.compiles(out, tool_name):
                _check_schema(f"tools[{i}].function.parameters", schema)
        return out

    def parameters(self) -> dict[str, dict]:
        """name -> parameters schema, in `tools` order."""
        return {
            t["function"]["name"]: t["function"].get("parameters") or EMPTY_PARAMETERS for t in self.tools
        }

    @property
    def offered(self) -> list[dict] | None:
        """The tools the chat template shows the model (under `none` too: see above)."""
        return list(self.tools) or None

    def constraint(self) -> dict | None:
        """`structured_outputs`' JSON form for `required` and named choices, else None."""
        return self.mode.constraint(self)

    def sampling_overrides(self, fmt: ToolFormat, constrained: bool) -> dict[str, Any]:
        """`SamplingParams` fields this choice sets (`dataclasses.replace` them in). `constrained`:
        the request already constrains its output (response_format, structured_outputs)."""
        out: dict[str, Any] = {}
        constraint = self.constraint()
        if constraint is not None:
            if constrained:
                raise RequestError.of_field(
                    "tool_choice",
                    f"a {self.mode.name} tool choice constrains the output, so it cannot be combined with "
                    "response_format or structured_outputs",
                )
            out["structured_outputs"] = constraint
        if self.mode.parses_markers and fmt.special:
            out["skip_special_tokens"] = False  # the family's markers are special tokens
        return out

    def stream(self, fmt: ToolFormat) -> ToolStream | None:
        """A fresh reader of one output, or None when nothing is parsed (`none`)."""
        return self.mode.reader(self, fmt)


def _hoist(schema: dict, defs: dict[str, Any]) -> dict:
    """A tool's schema with its `$defs` (or draft-7 `definitions`) moved into `defs`: the combined
    schema's root, where its `#/$defs/...` references then point. Two tools defining one name
    differently: 400."""
    if not any(isinstance(schema.get(k), dict) for k in _DEFS):
        return schema
    schema = json.loads(json.dumps(schema).replace('"#/definitions/', '"#/$defs/'))
    for key in _DEFS:
        for name, sub in (schema.pop(key, None) or {}).items():
            if defs.setdefault(name, sub) != sub:
                raise RequestError.of_field("tools", f"two tools define {key}.{name} differently; rename one")
    return schema


def parse_tool_calls(
    text: str, parser: ToolFormat | str, tool_choice: Any = "auto", parallel_tool_calls: bool | None = None
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of one output generated under `tool_choice` (e.g. by `LLM.chat(...,
    tools=...)`). `parser`: the family's form (`LLM.tool_parser`) or a parser name."""
    fmt = get_format(parser) if isinstance(parser, str) else parser
    mode, name = (MODES["none"], None) if tool_choice is None else _mode(tool_choice)
    stream = ToolChoice((), mode, name, parallel_tool_calls is not False).stream(fmt)
    return (text, []) if stream is None else collect(stream, text)

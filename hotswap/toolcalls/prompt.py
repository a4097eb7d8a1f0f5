"""Tools, tool calls and tool results in a chat prompt.

A chat template that renders tools (Qwen's, Llama 3.1's, Mistral's: it reads the `tools`
variable) gets them as transformers hands them over, `tools=[{"type": "function", "function":
{...}}]`, and renders assistant `tool_calls` and `role: "tool"` messages itself. One that does not
(SmolLM2's, or the tiny test model's) would drop all three, so they are written into the
messages in the family's form: the tools into the system message with the family's documented
instructions (`ToolFormat.instructions`), an assistant's calls as the text the model writes
(`ToolFormat.write`), and a result as a user turn (`ToolFormat.result`). Both ways render a
conversation's earlier turns the same in every later request, so turn k+1's prompt begins with
turn k's and hits the prefix cache.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hotswap.errors import RequestError
from hotswap.toolcalls.formats import ToolFormat


def check_tool_calls(i: int, value: Any) -> list[dict]:
    """messages[i].tool_calls with each call's arguments read into a dict. OpenAI clients send the
    arguments as JSON text; chat templates iterate them (`arguments.items()`, `| tojson`)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise RequestError(f"{where}: expected a list of {{'id', 'type': 'function', 'function': {{...}}}}")
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}[{j}].function.name: expected a non-empty string")
        args = fn.get("arguments") or {}  # type: ignore[union-attr]
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError as e:
                raise RequestError(f"{where}[{j}].function.arguments: not JSON ({e})") from e
        if not isinstance(args, dict):
            raise RequestError(f"{where}[{j}].function.arguments: expected a JSON object")
        out.append({**call, "type": "function", "function": {**fn, "arguments": args}})  # type: ignore[dict-item]
    return out


@functools.lru_cache(maxsize=32)
def renders_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable."""
    try:
        ast = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False  # the tokenizer reports the template's syntax error when it renders
    return "tools" in meta.find_undeclared_variables(ast)


def tool_prompt(
    messages: list[dict], tools: Sequence[dict] | None, fmt: ToolFormat, template: str | None
) -> tuple[list[dict], dict[str, Any]]:
    """(messages, template variables) for checked messages (`engine/chat.py`) and the offered
    tools (None: none offered)."""
    if template is not None and renders_tools(template):
        return messages, ({"tools": list(tools)} if tools else {})
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": fmt.result(m["content"])})
        elif m.get("tool_calls"):
            written = fmt.write(
                [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            )
            rest = {k: v for k, v in m.items() if k != "tool_calls"}
            out.append({**rest, "content": f"{m['content']}\n{written}" if m["content"] else written})
        else:
            out.append(m)
    if tools:
        instructions = fmt.instructions(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out, {}

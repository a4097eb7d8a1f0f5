"""Tool calling: the tools in the prompt, tool_choice as a constraint, and the calls read back.

- `formats.py`: each family's form (Hermes/Qwen, Llama 3 JSON, Mistral, SmolLM2) and the
  registry of parser names (`--tool-call-parser`).
- `parsers.py`: reading calls out of a text, whole or streamed.
- `choice.py`: `tools` + `tool_choice` + `parallel_tool_calls` checked, the constraint they
  set, and `parse_tool_calls`.
- `prompt.py`: tools, calls and results in the chat prompt.

The names load lazily: `hotswap.args` reads the parser names before anything heavy is imported.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "ToolCall": "hotswap.toolcalls.parsers",
    "ToolChoice": "hotswap.toolcalls.choice",
    "parse_tool_calls": "hotswap.toolcalls.choice",
    "get_format": "hotswap.toolcalls.formats",
    "PARSER_NAMES": "hotswap.toolcalls.formats",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hotswap.toolcalls' has no attribute {name!r}")

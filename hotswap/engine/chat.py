"""Chat prompts: OpenAI-style messages to the chat template's text and token ids.

The server's /v1/chat/completions and `LLM.chat` both build their prompts with
`chat_prompt`, so the same messages and options give the same prompt ids in both.
Messages are checked here, so a malformed conversation is a `RequestError` (HTTP 400)
naming the message, never a KeyError from inside a template. Tools, assistant `tool_calls` and
`role: "tool"` results reach the template as `tools/prompt.py` decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hotswap.checkpoint.tokenizer import Tokenizer
from hotswap.errors import RequestError
from hotswap.toolcalls import formats
from hotswap.toolcalls.formats import ToolFormat
from hotswap.toolcalls.prompt import check_tool_calls, tool_prompt


def _text(i: int, content: Any) -> str:
    """A message's content as the template sees it: a string (text parts joined, None as "")."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, Sequence):
        raise RequestError(f"messages[{i}].content: expected a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if (
            not isinstance(part, Mapping)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise RequestError(
                f"messages[{i}].content[{j}]: only {{'type': 'text', 'text': ...}} parts are supported, got {kind!r}"
            )
        texts.append(part["text"])
    return "".join(texts)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check one conversation; content becomes a string, an assistant's `tool_calls` get their
    arguments as dicts, other fields (e.g. `name`, `tool_call_id`) pass through."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence) or not messages:
        raise RequestError("a conversation is a non-empty list of messages ({'role': ..., 'content': ...})")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise RequestError(
                f"messages[{i}]: expected a dict with 'role' and 'content', got {type(m).__name__}"
            )
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(f"messages[{i}].role: expected a non-empty string, got {role!r}")
        checked = {**m, "content": _text(i, m.get("content"))}
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise RequestError(f"messages[{i}].tool_calls: only an assistant message makes tool calls")
            checked["tool_calls"] = check_tool_calls(i, m["tool_calls"])
        if not isinstance(m.get("tool_call_id", ""), str):
            raise RequestError(f"messages[{i}].tool_call_id: expected a string")
        out.append(checked)
    return out


def conversations(messages: Any) -> list[Sequence[Mapping[str, Any]]]:
    """vLLM's rule: a list of dicts is one conversation, a list of lists is a batch of them."""
    if isinstance(messages, Sequence) and not isinstance(messages, str) and messages:
        if all(isinstance(m, Mapping) for m in messages):
            return [messages]
        if all(isinstance(c, Sequence) and not isinstance(c, str) for c in messages):
            return list(messages)
    raise RequestError(
        "messages: expected a conversation (a list of message dicts) or a list of conversations"
    )


def chat_prompt(
    tokenizer: Tokenizer | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[dict] | None = None,
    tool_format: ToolFormat | None = None,
) -> tuple[str, list[int]]:
    """(rendered text, prompt ids) of one conversation. No BOS is added: the template places it.
    `tools`: the tools offered (checked by `tools.choice.ToolChoice`); `tool_format`: the family
    that writes them where the template does not (default: the template's)."""
    if tokenizer is None:
        raise RequestError("this model has no tokenizer, so no chat template: send prompt token ids instead")
    kwargs = dict(chat_template_kwargs or {})
    if not all(isinstance(k, str) for k in kwargs):
        raise RequestError("chat_template_kwargs: keys must be strings (template variable names)")
    template = chat_template if chat_template is not None else tokenizer.chat_template
    fmt = tool_format or formats.from_template(template)
    checked, tool_vars = tool_prompt(template_messages(messages), tools, fmt, template)
    text = tokenizer.apply_chat_template(
        checked,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        continue_final_message=continue_final_message,
        template_kwargs={**kwargs, **tool_vars},
    )
    return text, tokenizer.encode(text, add_special_tokens=False)

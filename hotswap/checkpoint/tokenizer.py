"""`tokenizers` tokenizer.json + a jinja2 chat template, without transformers.

The server needs encode/decode and chat rendering only, so this reads the two
files an HF model directory carries (`tokenizer.json`, `tokenizer_config.json`,
and transformers 5's separate `chat_template.jinja`) and renders templates in a
sandboxed jinja environment configured the way transformers configures its own,
so a template renders to the same string in both.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hotswap.errors import CheckpointError, RequestError


class TemplateRaised(jinja2.TemplateError):
    """What a template's `raise_exception(...)` throws (e.g. 'roles must alternate')."""


def _raise_exception(message: str):
    raise TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _jinja_env() -> jinja2.Environment:
    # Same settings as transformers' chat template renderer.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=16)
def _request_template(source: str) -> jinja2.Template:
    """A template passed with a request (`chat_template=`): compiled once, and its errors are the request's."""
    try:
        return _jinja_env().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise RequestError(f"chat_template: syntax error at line {e.lineno}: {e.message}") from e


# transformers 5's way to continue the final message: tag its end, render, cut at the tag. Unlike
# searching for the message's text, this finds the right place when the text also occurs earlier.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Set by the chat itself, so a template kwarg may not override them.
_RESERVED = frozenset({"messages", "add_generation_prompt"})


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


class Tokenizer:
    """encode / decode / apply_chat_template over a `tokenizers.Tokenizer`."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
    ):
        self._tok = tok
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        if chat_template is not None:
            try:
                self._template = _jinja_env().from_string(chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise CheckpointError(f"chat_template: syntax error at line {e.lineno}: {e.message}") from e

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{path}: not found (only fast tokenizers, tokenizer.json, are supported)")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise CheckpointError(f"{path}: cannot be loaded ({e})") from e
        conf_path = model_dir / "tokenizer_config.json"
        conf = _read_json(conf_path) if conf_path.exists() else {}
        template = conf.get("chat_template")
        if isinstance(template, list):  # older multi-template form: [{name, template}, ...]
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        jinja_file = model_dir / "chat_template.jinja"  # transformers 5 writes the template here
        if jinja_file.exists():
            template = jinja_file.read_text()
        return cls(
            tok,
            bos_token=_token_text(conf.get("bos_token")),
            eos_token=_token_text(conf.get("eos_token")),
            pad_token=_token_text(conf.get("pad_token")),
            chat_template=template,
        )

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        """Including added (special) tokens; the model's embedding may have more rows."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's string for an id (byte-level BPE: `Ġthe`), None outside it."""
        return self._tok.id_to_token(token_id)

    def to_json_str(self) -> str:
        """The tokenizer.json text (a grammar library builds its own tokenizer from it)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> str | list[int]:
        """Render the chat; with `tokenize=True` return ids (no extra BOS: the template places it).

        As in transformers: `chat_template` replaces the model's template, `continue_final_message`
        ends the text inside the last message (no end-of-turn), so the model continues it,
        and `template_kwargs` / `extra` are further template variables (they may override
        `bos_token` and the like; vLLM's `chat_template_kwargs`).
        """
        extra = {**(template_kwargs or {}), **extra}
        template = _request_template(chat_template) if chat_template is not None else self._template
        if template is None:
            raise RequestError("this model has no chat_template; send a plain prompt instead")
        if continue_final_message and add_generation_prompt:
            raise RequestError(
                "continue_final_message and add_generation_prompt cannot both be true: the first continues "
                "the last message, the second starts a new assistant turn"
            )
        if _RESERVED & extra.keys():
            raise RequestError(
                f"chat_template_kwargs: {sorted(_RESERVED & extra.keys())} are set by the chat"
            )
        messages = list(messages)
        if continue_final_message:
            last = messages[-1] if messages else {}
            if not isinstance(last.get("content"), str):
                raise RequestError("continue_final_message needs a final message with text content")
            messages[-1] = {**last, "content": last["content"] + _CONTINUE_TAG}
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            **extra,
        }
        try:
            text = template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise RequestError(f"chat template rejected the messages: {e}") from e
        except (TypeError, ValueError, LookupError, AttributeError) as e:  # a template fed data it cannot use
            raise RequestError(f"chat template failed on the messages: {type(e).__name__}: {e}") from e
        if continue_final_message:
            tag = text.rfind(_CONTINUE_TAG.strip())
            if tag < 0:
                raise RequestError(
                    "continue_final_message: the chat template does not render the final message's content"
                )
            # A template that strips the content also strips the tag's space: strip what precedes it too.
            text = text[:tag] if text.startswith(_CONTINUE_TAG, tag) else text[:tag].rstrip()
        return self.encode(text, add_special_tokens=False) if tokenize else text


class IncrementalDecoder:
    """Streams text for a growing list of generated ids.

    Byte-level BPE splits a multi-byte character across tokens, and decoding a
    prefix then ends in U+FFFD. So text is held back while it ends in U+FFFD,
    and each step decodes only a short window (`prefix_offset:`) against the
    window's already-emitted part, which keeps a step O(window) and makes the
    pieces concatenate to the full decode. The window starts at the previous
    emission, not at the last one, because a tokenizer may render a token
    differently at the start of a decode (sentencepiece drops a leading space).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # ids before this are already emitted
        self._prefix_text: str | None = ""  # decode of ids[prefix_offset:read_offset], None: not yet
        self._pending = ""  # the held-back text, as a full decode shows it now

    @property
    def pending(self) -> str:
        """The text held back after the last push (it may end in U+FFFD); "" when none is."""
        return self._pending

    def push(self, ids: Sequence[int]) -> str:
        """Append newly generated ids; returns the newly completed text (O(window), not O(all ids))."""
        self._ids.extend(ids)
        if self._prefix_text is None:
            self._prefix_text = self._tok.decode(
                self._ids[self._prefix_offset : self._read_offset], self._skip
            )
        prefix = self._prefix_text
        text = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            self._pending = text[len(prefix) :]
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text, self._pending = None, ""
        return text[len(prefix) :]

    def step(self, ids: Sequence[int]) -> str:
        """`ids` is every generated id so far (it only grows); returns the newly completed text."""
        return self.push(ids[len(self._ids) :])

    def flush(self) -> str:
        """At the end of the stream, whatever was held back (a dangling partial char shows as U+FFFD)."""
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        text = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text, self._pending = "", ""
        return text[len(prefix) :]

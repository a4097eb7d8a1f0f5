"""Reading tool calls out of a model's text, whole or as a stream of text deltas.

Every reader is incremental: `feed(delta)` returns what is decided by the text so far (content
to show and tool calls), `flush()` what is left at the end. A whole text is read by feeding it
at once (`collect`), so a stream and the whole text give the same content and the same calls
wherever the text is split.

`MarkerStream` reads a family's own form (`formats.py`) after the fact (tool_choice `auto`): text
that may be the start of a marker is held back until decided, a block is held until it ends
and then becomes calls or, if its body does not read, stays text. When calls are made,
whitespace-only text around them is dropped (the newlines between `</tool_call>` blocks).
`ArgumentsStream` and `ListStream` read outputs constrained by a named or `required`
tool_choice (`choice.py`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from typing import Protocol

from hotswap.toolcalls.formats import ToolFormat, read_json_calls


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call, as OpenAI's `message.tool_calls[i]`: `arguments` is the JSON text of an object."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index`, as OpenAI's streamed `delta.tool_calls[i]`: the first piece of a call
    carries its id and name, every piece a part of its arguments text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        function: dict = {"arguments": self.arguments}
        if self.id is not None:
            out.update(id=self.id, type="function")
        if self.name is not None:
            function = {"name": self.name, **function}
        out["function"] = function
        return out


@dataclasses.dataclass
class Delta:
    """What one `feed` or `flush` decided: content text and call pieces, in output order
    (content first: a model writes its text before its calls)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def __add__(self, other: Delta) -> Delta:
        return Delta(self.content + other.content, self.tool_calls + other.tool_calls)


class ToolStream(Protocol):
    calls: int  # calls begun so far

    def feed(self, text: str) -> Delta: ...

    def flush(self) -> Delta: ...


def _held(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of `text` that is a proper start of a marker (it may become one)."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


class MarkerStream:
    """A family's tool calls in free text (tool_choice `auto`). `max_calls` (1 under
    `parallel_tool_calls: false`) drops calls past it."""

    def __init__(self, fmt: ToolFormat, max_calls: int | None = None):
        self.fmt = fmt
        self.max_calls = max_calls
        self.calls = 0
        self._text = ""
        self._pos = 0  # text before it is decided
        self._block: tuple[int, int] | None = None  # (start, body start) of the open block
        self._scan = 0  # the open block's end is not before this
        self._leading = fmt.leading is not None  # the output has not yet shown a non-blank char
        self._ended = False  # a stop text was seen: what follows is not the model's turn
        self._ws = ""  # whitespace-only content of the current run of text, held back
        self._live = False  # the current run of text has shown content

    def feed(self, text: str) -> Delta:
        if not self._ended:
            start = max(0, len(self._text) - max((len(s) for s in self.fmt.stop_texts), default=0))
            self._text += text
            cut = [i for s in self.fmt.stop_texts if (i := self._text.find(s, start)) >= 0]
            if cut:
                self._text, self._ended = self._text[: min(cut)], True
        return self._advance()

    def flush(self) -> Delta:
        out = self._advance()
        if self._block is not None:  # unclosed at the end: the body is the rest
            start, body = self._block
            out += self._decide(start, body, len(self._text), len(self._text))
        out += self._content(self._text[self._pos :])
        self._pos = len(self._text)
        if self.calls == 0 and self._ws:  # no calls: whitespace is content like any other
            out += Delta(self._ws)
        self._ws = ""
        return out

    # ---- the scan -------------------------------------------------------------------------

    def _advance(self) -> Delta:
        out = Delta()
        text, fmt = self._text, self.fmt
        while True:
            if self._block is not None:
                start, body = self._block
                if fmt.end is not None:
                    j = text.find(fmt.end, self._scan)
                    if j < 0:
                        self._scan = max(body, len(text) - len(fmt.end) + 1)
                        return out
                    out += self._decide(start, body, j, j + len(fmt.end))
                    continue
                j, _ = self._next_start(self._scan)
                if j < 0:
                    self._scan = max(body, len(text) - max(map(len, fmt.starts)) + 1)
                    return out
                out += self._decide(start, body, j, j)
                continue
            if self._leading:
                rest = text[self._pos :]
                if not rest.strip():
                    return out  # undecided until a non-blank char (or the end)
                self._leading = False
                at = self._pos + len(rest) - len(rest.lstrip())
                if text.startswith(fmt.leading, at):  # type: ignore[arg-type]
                    out += self._content(text[self._pos : at])
                    self._open(at, at)
                    continue
            i, marker = self._next_start(self._pos)
            if i < 0:
                hold = 0 if self._ended else _held(text[self._pos :], fmt.starts + fmt.stop_texts)
                out += self._content(text[self._pos : len(text) - hold])
                self._pos = len(text) - hold
                return out
            out += self._content(text[self._pos : i])
            self._open(i, i + len(marker))

    def _next_start(self, at: int) -> tuple[int, str]:
        found = [(i, m) for m in self.fmt.starts if (i := self._text.find(m, at)) >= 0]
        return min(found) if found else (-1, "")

    def _open(self, start: int, body: int) -> None:
        self._block, self._pos, self._scan = (start, body), start, body

    def _decide(self, start: int, body: int, body_end: int, end: int) -> Delta:
        """The block text[start:end] with body text[body:body_end] ends: calls, or text."""
        self._block, self._pos = None, end
        calls = self.fmt.read(self._text[body:body_end])
        if calls is None:
            return self._content(self._text[start:end])
        out = Delta()
        for name, args in calls:
            if self.max_calls is not None and self.calls >= self.max_calls:
                break
            out.tool_calls.append(ToolCallDelta(self.calls, _dumps(args), self.fmt.new_id(), name))
            self.calls += 1
        if self.calls:
            self._ws, self._live = "", False  # text around calls that is only whitespace is dropped
        return out

    def _content(self, text: str) -> Delta:
        if self._live:
            return Delta(text)
        if not text.strip():
            self._ws += text
            return Delta()
        self._live = True
        out, self._ws = self._ws + text, ""
        return Delta(out)


class ArgumentsStream:
    """Output constrained to one tool's parameters (a named tool_choice): the whole text is the
    arguments of one call to `name`, streamed as it comes."""

    def __init__(self, name: str, new_id: Callable[[], str]):
        self.name, self._new_id = name, new_id
        self.calls = 0

    def feed(self, text: str) -> Delta:
        if not text:
            return Delta()
        if self.calls:
            return Delta(tool_calls=[ToolCallDelta(0, text)])
        self.calls = 1
        return Delta(tool_calls=[ToolCallDelta(0, text, self._new_id(), self.name)])

    def flush(self) -> Delta:
        return Delta()


class ListStream:
    """Output constrained to a JSON list of {"name", "parameters"} (tool_choice `required`):
    read whole at the end; text that does not read (cut by max_tokens) stays content."""

    def __init__(self, new_id: Callable[[], str]):
        self._new_id = new_id
        self._text = ""
        self.calls = 0

    def feed(self, text: str) -> Delta:
        self._text += text
        return Delta()

    def flush(self) -> Delta:
        calls = read_json_calls(self._text)
        if not calls or not self._text.lstrip().startswith("["):
            return Delta(self._text)
        self.calls = len(calls)
        return Delta(
            tool_calls=[ToolCallDelta(k, _dumps(a), self._new_id(), n) for k, (n, a) in enumerate(calls)]
        )


def collect(stream: ToolStream, text: str) -> tuple[str | None, list[ToolCall]]:
    """Read a whole text: (content, calls). Content is None when there are calls and no text
    besides them (OpenAI's `message.content` then)."""
    return assemble([stream.feed(text), stream.flush()])


def assemble(deltas: Iterable[Delta]) -> tuple[str | None, list[ToolCall]]:
    """Join streamed deltas as a client does: content concatenated, each call's pieces by index."""
    content, calls = [], {}
    for d in deltas:
        content.append(d.content)
        for piece in d.tool_calls:
            if piece.index not in calls:
                calls[piece.index] = [piece.id, piece.name, ""]
            calls[piece.index][2] += piece.arguments
    text = "".join(content)
    out = [ToolCall(i, n, a) for i, n, a in (calls[k] for k in sorted(calls))]
    return (text or None) if out else text, out

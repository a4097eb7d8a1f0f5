"""Structured outputs: what a request's output must match, compiled once per distinct constraint.

A request asks with `StructuredOutputs` (vLLM's `StructuredOutputsParams`: exactly one of
`json`, `json_object`, `regex`, `choice`, `grammar`, `structural_tag`). `Grammars` turns it
into an llguidance grammar, checks it against the model's tokenizer before anything is
queued (a bad schema, regex or grammar is a `RequestError` naming the field), and keeps the
compiled matcher per distinct constraint, so a repeated schema costs a `deep_copy`. Each
constrained sequence owns a matcher that advances by the tokens it commits; tokens are never
taken back (every update policy keeps them), so its state survives a pause, a `keep` or a
`recompute`. The runner fills the packed token masks of a step's constrained rows
(`fill_masks`) and the device sampler applies them (`programs/sampler.py`).

llguidance (the library sgl-jax and vLLM use): an Earley parser over a lexer whose token
masks cost tens of microseconds, with a Rust thread pool for a batch's masks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from hotswap.checkpoint.tokenizer import Tokenizer
from hotswap.engine.strict_schema import strict
from hotswap.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
OPTIONS = ("whitespace_pattern", "disable_any_whitespace", "disable_additional_properties")
CACHE_SIZE = 256  # distinct constraints kept compiled (an RL run repeats a handful)
# JSON whitespace between tokens when the request does not say: up to 24 characters, enough
# for indented output, never unbounded (a small model can emit whitespace until max_tokens
# under "any whitespace", the default of vLLM's backends).
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """vLLM's `StructuredOutputsParams`: exactly one constraint.

    json: a JSON schema (a dict or its text); json_object: any JSON object; regex: the whole
    output matches it; choice: the output is one of these strings; grammar: a Lark grammar
    (llguidance's dialect) or GBNF/EBNF (llama.cpp's, converted); structural_tag: vLLM's form
    {"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}:
    free text in which a trigger starts a constrained segment.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    # JSON options (vLLM's): the whitespace allowed between JSON tokens (a regex; default
    # `WHITESPACE`), none at all, or the schema compiled in strict mode (only the keys and items
    # it names: engine/strict_schema.py) even where the engine's `structured_outputs_strict_mode`
    # is off. Strict mode is the default, as with vLLM's default backend (xgrammar).
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise RequestError.of_field(
                "structured_outputs",
                f"set exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}",
            )
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise RequestError.of_field(
                "structured_outputs.choice", "expected a non-empty list of non-empty strings"
            )
        if not isinstance(self.json_object, bool):
            raise RequestError.of_field("structured_outputs.json_object", "expected true or false")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError.of_field(f"structured_outputs.{name}", "expected true or false")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise RequestError.of_field("structured_outputs.whitespace_pattern", "expected a regex string")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError.of_field(f"structured_outputs.{name}", "expected a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, tuple]:
        """(kind, canonical text, options): equal constraints share one compiled matcher."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))
        return self.kind, text, tuple(getattr(self, o) for o in OPTIONS)

    def _json(self, schema: dict | str, strict_mode: bool) -> str:
        # The one place a JSON schema is handed to llguidance (structural tags and tool choices
        # come here too), so the one place that decides whether it is compiled strict.
        if strict_mode or self.disable_additional_properties:
            schema = strict(json.loads(schema) if isinstance(schema, str) else schema)
        if self.disable_any_whitespace:
            options = {"whitespace_flexible": False}
        else:
            options = {"whitespace_pattern": self.whitespace_pattern or WHITESPACE}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)

    def to_grammar(self, strict_mode: bool = True) -> str:
        """The llguidance grammar (not yet checked: `Grammars.matcher` does that). `strict_mode`:
        JSON schemas admit only the keys and items they name (engine/strict_schema.py)."""
        kind, value = self.kind, getattr(self, self.kind)
        try:
            if kind == "json":
                return self._json(value, strict_mode)
            if kind == "json_object":
                return self._json({"type": "object"}, strict_mode)  # bare: any object either way
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(value)
            if kind == "choice":
                return llguidance.grammar_from("choice", json.dumps(value))
            if kind == "grammar":
                return llguidance.grammar_from("grammar", value)
            return _structural_tag(value, strict_mode or self.disable_additional_properties)
        except (ValueError, TypeError, AssertionError) as e:
            raise RequestError.of_field(f"structured_outputs.{kind}", str(e)) from e


def _structural_tag(value: dict | str, strict_mode: bool) -> str:
    """vLLM's structural_tag form -> an llguidance Lark grammar of free text and tagged segments."""
    spec = json.loads(value) if isinstance(value, str) else value
    if not isinstance(spec, dict) or not isinstance(spec.get("structures"), list) or not spec["structures"]:
        raise ValueError('expected {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}')
    triggers = spec.get("triggers") or []
    tags = []
    for s in spec["structures"]:
        if not isinstance(s, dict):
            raise ValueError(f"each structure is an object, got {type(s).__name__}")
        begin = s.get("begin")
        if not isinstance(begin, str) or not begin:
            raise ValueError("each structure needs a non-empty 'begin'")
        trigger = next((t for t in triggers if begin.startswith(t)), begin)
        schema = s.get("schema") or {}
        tags.append(
            llguidance.StructTag(
                trigger=trigger,
                begin=begin,
                grammar=strict(schema) if strict_mode else schema,
                end=s.get("end", ""),
            )
        )
    return llguidance.StructTag.to_grammar(tags)


class Grammars:
    """One model's constraint compiler: its llguidance tokenizer and the compiled matchers (an
    LRU over `StructuredOutputs.key`). `strict_mode`: the engine's `structured_outputs_strict_mode`
    (JSON schemas admit only what they name; off: what the JSON Schema spec admits)."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int], *, strict_mode: bool = True
    ):
        # The model's vocabulary (embedding rows) may exceed the tokenizer's: the mask covers
        # every row, and ids with no token are never allowed.
        eos = list(eos_ids) or None
        self.tokenizer = llguidance.LLTokenizer(tokenizer.to_json_str(), n_vocab=vocab_size, eos_token=eos)
        self._compiled: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        # Requests arrive on several threads; compiling under this lock (not the engine's)
        # never holds up a step.
        self._lock = threading.Lock()
        self.strict_mode = strict_mode

    def __len__(self) -> int:
        """Distinct constraints compiled and kept."""
        return len(self._compiled)

    def matcher(self, so: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence; compiles `so` on first sight. RequestError (naming
        the field) for a constraint the library rejects."""
        with self._lock:
            return self._template(so).deep_copy()

    def _template(self, so: StructuredOutputs) -> llguidance.LLMatcher:
        key = so.key()
        template = self._compiled.get(key)
        if template is None:
            grammar = so.to_grammar(self.strict_mode)
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
            if is_error:
                raise RequestError.of_field(
                    f"structured_outputs.{so.kind}", messages[0] if messages else "invalid"
                )
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise RequestError.of_field(f"structured_outputs.{so.kind}", template.get_error())
            self._compiled[key] = template
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return template


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()  # a thread pool, shared by every engine in the process


def fill_masks(rows: list[tuple[llguidance.LLMatcher, int]], mask: np.ndarray) -> None:
    """Write each (matcher, row)'s allowed tokens into mask[row] ([S, words] int32, bit t % 32
    of word t // 32 is token t), all rows in parallel on llguidance's threads."""
    if rows:
        llguidance.numpy.fill_next_token_bitmask_par(_executor(), rows, mask)


def consume(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Advance a sequence's matcher by its sampled token. True when the constraint is complete
    (nothing more may follow) or broken; the sequence then stops."""
    matcher.consume_token(token)
    return matcher.is_stopped() or matcher.is_error()


def structured_outputs(value: Any) -> StructuredOutputs | None:
    """A `StructuredOutputs`, or the dict form of one (vLLM's JSON body), or None."""
    if value is None or isinstance(value, StructuredOutputs):
        return value
    if not isinstance(value, dict):
        raise RequestError.of_field("structured_outputs", f"expected an object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(KINDS) - set(OPTIONS) - {"disable_fallback"})
    if unknown:
        raise RequestError.of_field("structured_outputs", f"unknown field(s) {unknown}; use one of {KINDS}")
    # disable_fallback (vLLM: no fallback to another grammar backend) holds here: there is one.
    return StructuredOutputs(**{k: v for k, v in value.items() if k in KINDS + OPTIONS})

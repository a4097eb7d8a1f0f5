"""JSON schemas compile in xgrammar's strict mode by default (engine/strict_schema.py), as vLLM's
default backend compiles them: only the keys and items a schema names. The oracle is xgrammar
0.2.8 itself: each row's answer is what `xgrammar.Grammar.from_json_schema(schema)` (strict_mode
left at its default, True) and `xgrammar.testing._is_grammar_accept_string` gave for that text.
The matcher runs on a byte-level BPE tokenizer (no model)."""

from __future__ import annotations

import argparse
import copy
import json

import pytest

from hotswap import EngineArgs, StructuredOutputs
from hotswap.checkpoint.create import SPECIAL_TOKENS, build_tokenizer
from hotswap.checkpoint.tokenizer import Tokenizer
from hotswap.engine.strict_schema import strict
from hotswap.engine.structured import Grammars
from hotswap.errors import RequestError

VOCAB = 512
INT = {"type": "integer"}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": INT}, "required": ["name"]}
NODE = {
    "type": "object",
    "properties": {"v": INT, "next": {"anyOf": [{"$ref": "#/$defs/N"}, {"type": "null"}]}},
}

# (schema, text, xgrammar 0.2.8's answer in strict mode)
XGRAMMAR = [
    (PERSON, '{"name": "Al", "age": 3}', True),
    (PERSON, '{"name": "Al", "age": 3, "city": "Rome"}', False),
    ({"properties": {"a": INT}}, '{"a": 1, "b": 2}', False),  # an object by its keywords
    ({"type": "object", "properties": {}}, "{}", True),
    ({"type": "object", "properties": {}}, '{"q": 1}', False),
    # bare: nothing but the type and annotations (title, description, ...) is any object or array
    ({"type": "object"}, '{"b": 2}', True),
    ({"type": "object", "title": "X", "description": "d"}, '{"b": {"c": [1]}}', True),
    ({"type": "object", "properties": {"m": {"type": "object"}}}, '{"m": {"z": 1}}', True),
    ({"type": "object", "properties": {"m": {}}}, '{"m": {"z": 1}}', True),
    ({"type": "array"}, '[1, "a"]', True),
    # the schema opens them
    ({**PERSON, "additionalProperties": True}, '{"name": "Al", "city": "Rome"}', True),
    ({**PERSON, "additionalProperties": INT}, '{"name": "Al", "n": 2}', True),
    ({**PERSON, "additionalProperties": INT}, '{"name": "Al", "n": "two"}', False),
    ({"type": "object", "patternProperties": {"x.*": INT}}, '{"x1": 1}', True),
    ({"type": "object", "patternProperties": {"x.*": INT}}, '{"y1": 1}', False),
    (
        {"type": "object", "properties": {"a": INT}, "patternProperties": {"x.*": INT}},
        '{"a": 1, "x1": 1}',
        True,
    ),
    # arrays: only the items named
    ({"type": "array", "items": INT}, "[1, 2]", True),
    ({"type": "array", "items": {}}, '[1, "a"]', True),
    ({"type": "array", "prefixItems": [INT]}, "[1]", True),
    ({"type": "array", "prefixItems": [INT]}, "[1, 2]", False),
    ({"type": "array", "maxItems": 3}, "[]", True),
    ({"type": "array", "maxItems": 3}, "[1]", False),
    # through references and alternatives
    ({"$defs": {"P": PERSON}, "$ref": "#/$defs/P"}, '{"name": "Al", "b": 1}', False),
    ({"anyOf": [PERSON, {"type": "null"}]}, '{"name": "Al", "b": 1}', False),
    ({"$defs": {"N": NODE}, "$ref": "#/$defs/N"}, '{"v": 1, "next": {"v": 2, "next": null}}', True),
    ({"$defs": {"N": NODE}, "$ref": "#/$defs/N"}, '{"v": 1, "next": {"v": 2, "x": null}}', False),
]
# allOf of several branches: xgrammar 0.2.8 warns and admits any JSON there; here the branches
# merge (docs: structured outputs), closed to the keys they name together, each typed.
ALL_OF = {"allOf": [{"properties": {"a": INT}}, {"properties": {"b": INT}}]}
BASE_AND_MORE = {"$defs": {"B": {"type": "object", "properties": {"a": INT}}}}
BASE_AND_MORE["allOf"] = [{"$ref": "#/$defs/B"}, {"properties": {"b": INT}}]
MERGED = [
    (ALL_OF, '{"a": 1, "b": 2}', True),
    (ALL_OF, '{"a": 1, "c": 2}', False),
    (ALL_OF, '{"a": "x"}', False),
    (BASE_AND_MORE, '{"a": 1, "b": 2}', True),
    (BASE_AND_MORE, '{"a": 1, "c": 2}', False),
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(build_tokenizer(VOCAB), eos_token=SPECIAL_TOKENS[1])


@pytest.fixture(scope="module")
def accepts(tokenizer):
    """accepts(so, text, strict_mode=True): the whole of `text` is a complete output under `so`."""
    grammars = {mode: Grammars(tokenizer, VOCAB, [1], strict_mode=mode) for mode in (True, False)}

    def check(so: StructuredOutputs, text: str, strict_mode: bool = True) -> bool:
        matcher = grammars[strict_mode].matcher(so)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    return check


@pytest.mark.parametrize("schema, text, admitted", XGRAMMAR + MERGED)
def test_strict_mode_admits_what_xgrammar_admits(accepts, schema, text, admitted):
    assert accepts(StructuredOutputs(json=schema), text) is admitted


def test_additional_properties_true_still_admits_extra_keys(accepts):
    extra = '{"name": "Al", "age": 3, "city": "Rome", "tags": [1]}'
    assert not accepts(StructuredOutputs(json=PERSON), extra)
    opened = {**PERSON, "additionalProperties": True}
    assert accepts(StructuredOutputs(json=opened), extra)
    # per object: an open inner object inside a closed outer one
    outer = {"type": "object", "properties": {"p": opened}}
    assert accepts(StructuredOutputs(json=outer), '{"p": {"name": "Al", "x": 1}}')
    assert not accepts(StructuredOutputs(json=outer), '{"p": {"name": "Al"}, "x": 1}')


def test_the_open_option_restores_the_spec_reading(accepts):
    extra = '{"name": "Al", "city": "Rome"}'
    assert accepts(StructuredOutputs(json=PERSON), extra, strict_mode=False)
    assert accepts(StructuredOutputs(json={"type": "array", "maxItems": 3}), "[1, 2]", strict_mode=False)
    # a request still closes its own schema (vLLM's field; OpenAI's strict: true sets it)
    closed = StructuredOutputs(json=PERSON, disable_additional_properties=True)
    assert not accepts(closed, extra, strict_mode=False)
    # the engine option: a flag of `hotswap serve`, a keyword of LLM(...), on by default
    assert EngineArgs().structured_outputs_strict_mode is True
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, "serve")
    off = EngineArgs.from_cli_args(parser.parse_args(["--no-structured-outputs-strict-mode"]), "serve")
    assert off.structured_outputs_strict_mode is False


def test_structural_tag_schemas_are_strict_too(accepts):
    tag = {"structures": [{"begin": "<f=p>", "schema": PERSON, "end": "</f>"}], "triggers": ["<f="]}
    so = StructuredOutputs(structural_tag=tag)
    assert accepts(so, 'a <f=p>{"name": "Al"}</f> b')
    assert not accepts(so, 'a <f=p>{"name": "Al", "x": 1}</f> b')
    assert accepts(so, 'a <f=p>{"name": "Al", "x": 1}</f> b', strict_mode=False)


def test_only_schema_positions_are_rewritten():
    data = {"properties": {"x": 1}, "type": "object"}  # looks like a schema, is a value
    schema = {
        "type": "object",
        "properties": {
            "k": {"enum": [data]},
            "d": {"type": "object", "properties": {"z": INT}, "default": data},
        },
        "examples": [data],
    }
    given = copy.deepcopy(schema)
    out = strict(schema)
    assert schema == given  # the input is not modified
    assert out["properties"]["k"]["enum"] == [data] and out["examples"] == [data]
    assert out["properties"]["d"]["default"] == data
    assert out["additionalProperties"] is False and out["properties"]["d"]["additionalProperties"] is False
    assert json.loads(json.dumps(out))  # still plain JSON


def test_an_unsatisfiable_strict_schema_is_a_request_error(tokenizer):
    """Required keys it does not name: xgrammar admits nothing; here the request is refused."""
    with pytest.raises(RequestError, match="structured_outputs.json") as e:
        Grammars(tokenizer, VOCAB, [1]).matcher(StructuredOutputs(json={"type": "object", "required": ["b"]}))
    assert "unsatisfiable" in str(e.value)

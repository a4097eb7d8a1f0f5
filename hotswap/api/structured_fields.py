"""The wire forms of structured outputs, read into one `StructuredOutputs` (engine/structured.py).

OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` body
(json, regex, choice, grammar, structural_tag) and SGLang's `sampling_params` (`json_schema`,
`regex`, `ebnf`, `structural_tag`) all become the same constraint. vLLM 0.12 removed the
`guided_*` fields; a client still sending them gets a 400 naming the field that replaced them,
not a silent unconstrained answer.
"""

from __future__ import annotations

import json
from typing import Any

from hotswap.engine.structured import StructuredOutputs, structured_outputs
from hotswap.errors import RequestError

# vLLM < 0.12's field -> the `structured_outputs` key that replaced it.
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_json_object": "json_object",
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
}


def refuse_guided(given: dict[str, Any]) -> None:
    """A 400 for any `guided_*` field set, naming what replaced it."""
    for name, value in given.items():
        if value is not None:
            new = GUIDED[name]
            use = f"structured_outputs={{{new!r}: ...}}" if new else "structured_outputs"
            raise RequestError.of_field(name, f"removed in vLLM 0.12 and not accepted here; use {use}")


def from_response_format(rf: dict[str, Any] | None) -> StructuredOutputs | None:
    """OpenAI's `response_format` (and vLLM's structural_tag form of it)."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError.of_field(
                "response_format.json_schema", "expected {'name': ..., 'schema': {...}}"
            )
        schema = spec.get("schema")
        if not isinstance(schema, dict | bool):
            raise RequestError.of_field("response_format.json_schema.schema", "expected a JSON schema object")
        # OpenAI's `strict: true`: only the keys and items the schema names. That is the engine's
        # default (`structured_outputs_strict_mode`, as vLLM's default backend); `strict: true`
        # keeps it where the engine turned it off. `strict: false` opens nothing (vLLM ignores it
        # too): the schema's own `additionalProperties: true` does.
        return StructuredOutputs(
            json=schema if isinstance(schema, dict) else json.dumps(schema),
            disable_additional_properties=spec.get("strict") is True,
        )
    if kind == "structural_tag":
        return StructuredOutputs(structural_tag={k: v for k, v in rf.items() if k != "type"})
    raise RequestError.of_field(
        "response_format.type",
        f"expected 'text', 'json_object', 'json_schema' or 'structural_tag', got {kind!r}",
    )


def request_constraint(
    response_format: dict[str, Any] | None, body: dict[str, Any] | None
) -> StructuredOutputs | None:
    """The one constraint of an OpenAI-route request: `response_format` or `structured_outputs`
    (vLLM's extra body), not both."""
    rf = from_response_format(response_format)
    so = structured_outputs(body)
    if rf is not None and so is not None:
        raise RequestError.of_field(
            "structured_outputs", "set response_format or structured_outputs, not both"
        )
    return rf or so


def from_sglang(
    json_schema: str | None, regex: str | None, ebnf: str | None, structural_tag: str | None
) -> StructuredOutputs | None:
    """SGLang's `/generate` sampling_params: at most one of json_schema, regex, ebnf, structural_tag."""
    given = {
        k: v
        for k, v in {
            "json": json_schema,
            "regex": regex,
            "grammar": ebnf,
            "structural_tag": structural_tag,
        }.items()
        if v is not None
    }
    if not given:
        return None
    if len(given) > 1:
        raise RequestError.of_field(
            "sampling_params", "set at most one of json_schema, regex, ebnf, structural_tag"
        )
    return StructuredOutputs(**given)

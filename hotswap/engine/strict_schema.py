"""A JSON schema in xgrammar's strict mode (vLLM's default backend): only what the schema names.

xgrammar compiles a schema with `strict_mode=True` unless told otherwise, and vLLM never tells it
otherwise: an object takes only the keys of its `properties` and `patternProperties`, an array only
the items of its `items` and `prefixItems`, unless the schema opens them (`additionalProperties:
true` or a schema, `unevaluatedProperties`, `items`). llguidance follows the JSON Schema spec
(absent means open) and has no switch for this, so `strict` rewrites the schema before it is
compiled: `additionalProperties: false` on each object and `items: false` on each array that does
not say. A small model let loose in an open object writes keys until max_tokens (SmolLM2 fills a
named tool's arguments with "type", "description", "required").

What xgrammar does, measured on xgrammar 0.2.8 and followed here:
- a bare `{"type": "object"}` or `{"type": "array"}` (nothing beside the type but annotations:
  title, description, default, ...) stays open: any object, any array (`json_object` is one);
- `{"type": "object", "properties": {}}` admits only `{}`; an array with `prefixItems` and no
  `items` takes no more items; an array with neither takes none (`items: {}` opens it);
- `patternProperties` keys stay allowed; `anyOf`/`oneOf` branches close one by one;
- `allOf` of several branches: xgrammar 0.2.8 does not intersect them (it warns and admits any
  JSON). Here they merge: each closed branch also admits the keys its sibling branches name, so
  `allOf: [{properties: a}, {properties: b}]` admits a and b, typed, and nothing else (closed one
  by one, they would admit neither). A `$ref` branch to a local definition is inlined for this.
Only schema positions are rewritten; `enum`, `const`, `default` and `examples` are data.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a list of them, or a map of names to them.
ONE = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "additionalItems")
ONE += ("unevaluatedItems", "contains", "not", "if", "then", "else")
MANY = ("allOf", "anyOf", "oneOf", "prefixItems")
NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords that do not change what matches: a schema with only these beside `type` is "bare"
# (xgrammar's list, the keys it drops when it compares a schema with its built-in any-object).
ANNOTATIONS = frozenset(
    {
        "title",
        "default",
        "description",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$comment",
        "$schema",
    }
)
_DEF_PREFIXES = ("#/$defs/", "#/definitions/")


def strict(schema: Any) -> Any:
    """`schema` (a dict; a bool passes through) with what it does not name closed off. The input
    is not modified."""
    return _Walk(schema).node(schema, inlining=frozenset())


def _types(node: dict) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _bare(node: dict) -> bool:
    return set(node) - ANNOTATIONS <= {"type"}


def _opens_object(node: dict) -> bool:
    """An object schema that says nothing of keys beyond the ones it names."""
    is_object = "object" in _types(node) or "properties" in node or "patternProperties" in node
    said = "additionalProperties" in node or "unevaluatedProperties" in node
    return is_object and not said and not _bare(node)


def _opens_array(node: dict) -> bool:
    is_array = "array" in _types(node) or "prefixItems" in node
    said = "items" in node or "unevaluatedItems" in node or "additionalItems" in node
    return is_array and not said and not _bare(node)


def _with_names(properties: dict, names: dict) -> dict:
    """`properties` with every name of `names` (in its order), `true` (anything) where it had none."""
    return {n: properties.get(n, True) for n in {**names, **properties}}


class _Walk:
    def __init__(self, root: Any):
        self.root = root

    def node(self, node: Any, inlining: frozenset[str]) -> Any:
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ONE:
                out[key] = self.node(value, inlining)
            elif key in MANY and isinstance(value, list):
                out[key] = [self.node(v, inlining) for v in value]
            elif key in NAMED and isinstance(value, dict):
                out[key] = {name: self.node(v, inlining) for name, v in value.items()}
            else:
                out[key] = value  # data (enum, const, default, ...) or a scalar keyword
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            out["allOf"] = self.merged(node, out, inlining)
        if _opens_object(node):
            out["additionalProperties"] = False
        if _opens_array(node):
            out["items"] = False
        return out

    def merged(self, node: dict, out: dict, inlining: frozenset[str]) -> list:
        """`out`'s allOf branches, each one this walk closed also admitting the keys the others
        (and the node itself) name, as xgrammar merges them."""
        given = [self.inlined(b, inlining) for b in node["allOf"]]
        branches = [self.node(b, inlining | {r} if r else inlining) for b, r in given]
        # Every name, in the order the schema gives them (llguidance writes keys in that order).
        names = dict.fromkeys(node.get("properties") or {})
        for b, _ in given:
            if isinstance(b, dict):
                names.update(dict.fromkeys(b.get("properties") or {}))
        for (b, _), walked in zip(given, branches, strict=True):
            if isinstance(b, dict) and _opens_object(b):
                walked["properties"] = _with_names(walked.get("properties", {}), names)
        if _opens_object(node):
            out["properties"] = _with_names(out.get("properties", {}), names)
        return branches

    def inlined(self, branch: Any, inlining: frozenset[str]) -> tuple[Any, str | None]:
        """(a `$ref` branch's local definition, its ref), or (the branch, None). A definition that
        is being inlined already (a recursive one) stays a ref."""
        ref = branch.get("$ref") if isinstance(branch, dict) else None
        if not isinstance(ref, str) or ref in inlining or set(branch) - ANNOTATIONS != {"$ref"}:
            return branch, None
        for prefix in _DEF_PREFIXES:
            defs = self.root.get(prefix[2:-1]) if isinstance(self.root, dict) else None
            if (
                ref.startswith(prefix)
                and isinstance(defs, dict)
                and isinstance(defs.get(ref[len(prefix) :]), dict)
            ):
                return defs[ref[len(prefix) :]], ref
        return branch, None

"""What a request constrains its output to: a `GrammarSpec`, a hashable value made from a request.

A spec is only data (kind and source text), so it is the key of the compiled-grammar cache and
crosses threads freely; nothing here needs the grammar engine. The checks here catch what a
client can get wrong without compiling (a schema that is not an object, an empty choice list);
what only the compiler can judge is refused by `GrammarCache.compile`, also as a 400.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.sampling import SamplingParams

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")

# JSON Schema keywords whose values are schemas (or lists/maps of them): where a nested schema
# can hide a wrong type that the compiler would report far less clearly.
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "contains", "if", "then", "else")
_JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# What one request's grammar may be: compile time and memory grow with it (a 20,000-entry choice
# list took 12-14 s and 370 MB), so a larger one is a 400 naming the limit before it is compiled.
MAX_GRAMMAR_BYTES = 64 << 10  # the source: a schema's JSON, a regex, EBNF, the choices' JSON, a tool-call grammar
MAX_CHOICES = 1024
# xgrammar's cost grows about as the cube of one object's optional properties (it writes a rule for each
# way the remaining ones may follow), not with the bytes: within 64 KiB, 2,500 of them held a compile
# thread for ~110 s under load (bundled tokenizer: 400 took 0.34 s, 800 2.2 s, 1,200 9.5 s of CPU; 2,500
# required ones 0.5 s). Two such requests kept every other client's grammar waiting past its 10 s.
MAX_OPTIONAL_PROPERTIES = 256


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One constraint: its kind and its source (a JSON schema's text, a regex, EBNF, a JSON list of choices)."""

    kind: Kind
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict | str | bool) -> GrammarSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
        check_schema(schema)
        # Key order is kept: a schema's property order is the order the output is written in.
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        _need(isinstance(pattern, str) and pattern, "the regex must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        _need(isinstance(options, (list, tuple)) and options and all(isinstance(o, str) and o for o in options),
              "choice must be a non-empty list of non-empty strings")
        _need(len(options) <= MAX_CHOICES, f"choice: {len(options)} options, at most {MAX_CHOICES} (the grammar limit)")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def grammar(cls, ebnf: str) -> GrammarSpec:
        _need(isinstance(ebnf, str) and ebnf.strip(), "the grammar must be a non-empty EBNF string")
        return cls("grammar", ebnf)

    @classmethod
    def structural_tag(cls, tag: dict) -> GrammarSpec:
        return cls("structural_tag", json.dumps(tag, separators=(",", ":")))


def spec_for(params: SamplingParams) -> GrammarSpec | None:
    """The spec of a request's constraint (SamplingParams allows at most one), or None; a 400 for one
    over the grammar limits."""
    spec = _spec_for(params)
    # A tool-call grammar (kaon's, made from the forced tools' schemas) is held to the same limit: the tools
    # count against --max-prompt-bytes too, but that is 32 x the context, far more than a compile can bear.
    if spec is not None and len(spec.source) > MAX_GRAMMAR_BYTES:
        what = "tool-call grammar (the forced tools' schemas)" if spec.kind == "structural_tag" \
            else spec.kind.replace('_', ' ')
        raise InvalidRequestError(f"the {what} is {len(spec.source)} characters, at most {MAX_GRAMMAR_BYTES} (the "
                                  "grammar limit)")
    return spec


def _spec_for(params: SamplingParams) -> GrammarSpec | None:
    if params.json_schema is not None:
        return GrammarSpec.json_schema(params.json_schema)
    if params.regex is not None:
        return GrammarSpec.regex(params.regex)
    if params.choice is not None:
        return GrammarSpec.choice(params.choice)
    if params.grammar is not None:
        return GrammarSpec.grammar(params.grammar)
    if params.json_object:
        return GrammarSpec.json_object()
    if params.structural_tag is not None:
        return GrammarSpec.structural_tag(params.structural_tag)
    return None


def check_schema(schema, path: str = "schema") -> None:
    """Refuse a schema whose shape is wrong, naming where; the compiler judges the rest."""
    if isinstance(schema, bool):
        return
    _need(isinstance(schema, dict), f"{path} must be a JSON object (a schema), got {type(schema).__name__}")
    kind = schema.get("type")
    types = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for t in types:
        _need(t in _JSON_TYPES, f"{path}.type: unknown type {t!r} (expected one of {', '.join(_JSON_TYPES)})")
    for key in _SUBSCHEMA_MAPS:
        if key in schema:
            _need(isinstance(schema[key], dict), f"{path}.{key} must be an object")
    if isinstance(schema.get("properties"), dict):
        required = schema.get("required")
        named = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
        optional = len(schema["properties"].keys() - named)
        _need(optional <= MAX_OPTIONAL_PROPERTIES, f"{path}.properties: {optional} optional properties, at most "
              f"{MAX_OPTIONAL_PROPERTIES} in one object (the grammar limit; required ones are not counted)")
    for key in _SUBSCHEMA_MAPS:
        if key in schema:
            for name, sub in schema[key].items():
                check_schema(sub, f"{path}.{key}.{name}")
    for key in _SUBSCHEMA_LISTS:
        if key in schema:
            _need(isinstance(schema[key], list) and schema[key], f"{path}.{key} must be a non-empty array")
            for i, sub in enumerate(schema[key]):
                check_schema(sub, f"{path}.{key}[{i}]")
    for key in _SUBSCHEMAS:
        if key in schema:
            check_schema(schema[key], f"{path}.{key}")
    if "required" in schema:
        _need(isinstance(schema["required"], list) and all(isinstance(r, str) for r in schema["required"]),
              f"{path}.required must be an array of property names")
    if "enum" in schema:
        _need(isinstance(schema["enum"], list) and schema["enum"], f"{path}.enum must be a non-empty array")
    for low, high in (("minimum", "maximum"), ("minItems", "maxItems"), ("minLength", "maxLength"),
                      ("minProperties", "maxProperties")):
        if isinstance(schema.get(low), (int, float)) and isinstance(schema.get(high), (int, float)):
            _need(schema[low] <= schema[high], f"{path}: {low} {schema[low]} is above {high} {schema[high]}")


def _need(ok, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)

"""Refuse JSON-schema features the grammar engine would not enforce.

xgrammar ignores some assertion keywords silently (`not`, `if`, `uniqueItems`, multi-branch `allOf`, ...), and
treats `oneOf` as `anyOf`: decoding under such a schema could yield JSON that does not validate. Those are refused
here, naming the keyword. Keywords not known at all are annotations to a validator (`x-...`, `nullable`), so ignoring
them cannot break validation; they pass.
"""

from __future__ import annotations

from typing import Any

from kvreuse.structured.errors import UnsupportedFormat
from kvreuse.structured.regex import regex_problem

# Assertions the engine does not enforce, with a hint where there is an alternative.
UNSUPPORTED: dict[str, str] = {
    "not": "", "if": "", "then": "", "else": "",
    "oneOf": " (use 'anyOf')",
    "dependentRequired": "", "dependentSchemas": "", "dependencies": "",
    "uniqueItems": "", "contains": "", "minContains": "", "maxContains": "",
    "unevaluatedProperties": "", "unevaluatedItems": "", "additionalItems": " (use 'prefixItems' and 'items')",
    "patternProperties": "", "propertyNames": "",
    "$dynamicRef": "", "$recursiveRef": "", "contentSchema": "",
}
# Formats checked by the engine (the ones OpenAI's structured outputs document, and a few more).
FORMATS = frozenset({"date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
                     "uri-reference"})
TYPES = frozenset({"string", "integer", "number", "boolean", "null", "object", "array"})
MAX_DEPTH = 64

# Keywords whose value is a subschema, a list of them, or a name -> subschema map.
SUBSCHEMA_ONE = ("additionalProperties", "items")
SUBSCHEMA_LIST = ("anyOf", "allOf", "prefixItems")
SUBSCHEMA_MAP = ("properties", "$defs", "definitions")


def check_schema(schema: Any, field: str) -> None:
    """UnsupportedFormat naming the first feature of `schema` that the engine would not enforce."""
    if not isinstance(schema, dict):
        raise UnsupportedFormat(field, f"json_schema: the schema must be a JSON object, not {type(schema).__name__}")
    _check(schema, field, path="", depth=0)


def _fail(field: str, message: str, path: str) -> UnsupportedFormat:
    return UnsupportedFormat(field, f"json_schema: {message}" + (f" (at {path})" if path else ""))


def _check(schema: Any, field: str, path: str, depth: int) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise _fail(field, f"a schema must be an object or a boolean, not {type(schema).__name__}", path)
    if depth > MAX_DEPTH:
        raise _fail(field, f"schemas nested deeper than {MAX_DEPTH} levels are not supported", path)
    for keyword, hint in UNSUPPORTED.items():
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            raise _fail(field, f"'{keyword}' is not supported{hint}", path)
    _check_values(schema, field, path)
    here = f"{path}." if path else ""
    for keyword in SUBSCHEMA_ONE:
        if keyword in schema:
            if isinstance(schema[keyword], list):  # draft-4 tuple form
                raise _fail(field, f"'{keyword}' as a list is not supported (use 'prefixItems')", path)
            _check(schema[keyword], field, f"{here}{keyword}", depth + 1)
    for keyword in SUBSCHEMA_LIST:
        if keyword in schema:
            subschemas = schema[keyword]
            if not isinstance(subschemas, list) or not subschemas:
                raise _fail(field, f"'{keyword}' must be a non-empty list of schemas", path)
            if keyword == "allOf" and len(subschemas) > 1:
                raise _fail(field, "'allOf' with more than one schema is not supported", path)
            for i, subschema in enumerate(subschemas):
                _check(subschema, field, f"{here}{keyword}[{i}]", depth + 1)
    for keyword in SUBSCHEMA_MAP:
        if keyword in schema:
            if not isinstance(schema[keyword], dict):
                raise _fail(field, f"'{keyword}' must be an object", path)
            for name, subschema in schema[keyword].items():
                _check(subschema, field, f"{here}{keyword}.{name}", depth + 1)


def _check_values(schema: dict, field: str, path: str) -> None:
    kind = schema.get("type")
    names = [] if kind is None else kind if isinstance(kind, list) else [kind]
    for name in names:
        if not isinstance(name, str) or name not in TYPES:
            raise _fail(field, f"unknown type {name!r}", path)
    pattern = schema.get("pattern")
    if pattern is not None:
        problem = regex_problem(pattern)
        if problem:
            raise _fail(field, f"pattern {pattern!r}: {problem}", path)
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise _fail(field, f"'$ref' {ref!r} is not supported: only local references ('#/$defs/...')", path)
    fmt = schema.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise _fail(field, f"format {fmt!r} is not supported (supported: {', '.join(sorted(FORMATS))})", path)
    if "required" in schema and not (isinstance(schema["required"], list)
                                     and all(isinstance(name, str) for name in schema["required"])):
        raise _fail(field, "'required' must be a list of property names", path)
    if "enum" in schema and not (isinstance(schema["enum"], list) and schema["enum"]):
        raise _fail(field, "'enum' must be a non-empty list", path)

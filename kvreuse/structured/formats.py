"""Request fields -> one FormatSpec: OpenAI's `response_format`, vLLM's `guided_json` / `guided_regex` /
`guided_choice`. Everything a request can get wrong in its shape is found here, in Python and in time linear in its
size; what it costs to compile (`[structured]`'s limits) and how the engine reads it are checked by the
GrammarCompiler, before the request reaches the engine."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

from kvreuse.structured.errors import UnsupportedFormat
from kvreuse.structured.regex import regex_problem
from kvreuse.structured.schema_check import check_schema

Kind = Literal["json_object", "json_schema", "regex", "choice", "tool_calls"]
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_FIELD_OF_KIND = {"json_object": "response_format", "json_schema": "response_format", "regex": "guided_regex",
                  "choice": "guided_choice", "tool_calls": "tools"}
_NOUN = {"json_object": "schema", "json_schema": "schema", "regex": "regex", "choice": "list of choices",
         "tool_calls": "tool call grammar"}


@dataclass(frozen=True)
class FormatSpec:
    """What the output must be. `value`: the schema as canonical JSON text (json_schema), the regex (regex), the
    choices as a JSON list (choice), the calls' layout and schemas (tool_calls: tool_grammar.py), None
    (json_object). Hashable and picklable: the compiled-grammar cache key.
    `source` is the request field it came from (errors name it); it is not part of the key."""
    kind: Kind
    value: str | None = None
    source: str | None = dataclasses.field(default=None, compare=False)

    @property
    def field(self) -> str:
        """The request field an error about this format names."""
        return self.source or _FIELD_OF_KIND[self.kind]

    @property
    def noun(self) -> str:
        """What it is, in an error message: schema, regex or list of choices."""
        return _NOUN[self.kind]


@dataclass(frozen=True)
class CheckedFormat:
    """A format the GrammarCompiler has checked (limits, the engine's reading, compile time) without compiling it:
    what a cluster's ingress, which decodes nothing, puts on a sequence and sends to the replica that compiles it.
    Picklable."""
    spec: FormatSpec

    def matcher(self) -> None:
        """None: a format only checked has no grammar here to follow tokens through."""
        return None


def parse_format(response_format: dict | None, guided_regex: str | None = None,
                 guided_choice: list[str] | None = None, guided_json: dict | str | None = None) -> FormatSpec | None:
    """The request's output format, or None for free text. UnsupportedFormat (naming the field) when a field is
    malformed, when more than one is given, or when a schema or regex uses what the engine cannot enforce."""
    given = [name for name, value in (("response_format", _non_text(response_format)), ("guided_json", guided_json),
                                      ("guided_regex", guided_regex), ("guided_choice", guided_choice))
             if value is not None]
    if len(given) > 1:
        raise UnsupportedFormat(given[1], f"at most one of response_format, guided_json, guided_regex, guided_choice "
                                          f"may be given, not {' and '.join(given)}")
    if _non_text(response_format) is not None:
        return _response_format(response_format)
    if guided_json is not None:
        return _schema_spec(_schema_from_json_field(guided_json), "guided_json")
    if guided_regex is not None:
        problem = regex_problem(guided_regex)
        if problem:
            raise UnsupportedFormat("guided_regex", f"guided_regex: {problem}")
        return FormatSpec("regex", guided_regex, "guided_regex")
    if guided_choice is not None:
        return _choice_spec(guided_choice)
    return None


def _non_text(response_format: Any) -> Any:
    """None for an absent or {"type": "text"} response_format (it constrains nothing), else itself."""
    if isinstance(response_format, dict) and response_format.get("type") == "text":
        return None
    return response_format


def _response_format(response_format: Any) -> FormatSpec:
    field = "response_format"
    if not isinstance(response_format, dict):
        raise UnsupportedFormat(field, f"response_format must be an object, not {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise UnsupportedFormat(field, f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, "
                                       f"not {kind!r}")
    if kind == "json_object":
        return FormatSpec("json_object", source=field)
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise UnsupportedFormat(field, "response_format.json_schema must be an object with a 'schema'")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise UnsupportedFormat(field, "response_format.json_schema.name must be a string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise UnsupportedFormat(field, "response_format.json_schema.strict must be a boolean")
    # OpenAI makes `schema` optional; without one, any JSON value conforms. `strict` changes nothing here: the
    # schema is always enforced, and what cannot be enforced is refused.
    schema = spec.get("schema", {})
    return _schema_spec(schema, field)


def _schema_from_json_field(guided_json: Any) -> Any:
    if isinstance(guided_json, str):
        try:
            return json.loads(guided_json)
        except json.JSONDecodeError as exc:
            raise UnsupportedFormat("guided_json", f"guided_json is not valid JSON: {exc}") from None
    return guided_json


def _schema_spec(schema: Any, source: str) -> FormatSpec:
    check_schema(schema, source)
    # The engine's own reading (references, bounds that contradict) waits for the compiler's limits: for some schemas
    # of a few KB (minProperties over many properties) it alone builds a grammar of gigabytes.
    return FormatSpec("json_schema", json.dumps(schema, sort_keys=False, separators=(",", ":"), ensure_ascii=False),
                      source)


def _choice_spec(choices: Any) -> FormatSpec:
    if not isinstance(choices, list) or not choices:
        raise UnsupportedFormat("guided_choice", "guided_choice must be a non-empty list of strings")
    if not all(isinstance(choice, str) and choice for choice in choices):
        raise UnsupportedFormat("guided_choice", "guided_choice must hold non-empty strings only")
    return FormatSpec("choice", json.dumps(choices, ensure_ascii=False), "guided_choice")

"""The grammar of tool calls: a format's calls, each `begin` + its tool's arguments as JSON + `end`, as one xgrammar
structural tag. Which text surrounds a call is the format's (kvreuse/tools/grammar.py writes it into the spec); here
it is only tags, separators and a trigger.

The value of a `tool_calls` FormatSpec is a JSON object: `calls` ([{begin, schema, end}], one per callable tool),
`separator` between calls, `prefix` and `suffix` around them all, `max_calls` (1 or null: any number), and
`trigger`: null when the answer must be calls (`required`, a named tool), else the text that starts them (`auto`:
free text until the trigger, then only valid calls, which always end).

An integer with no bound of its own gets at most 15 digits (|n| < 10**15, exact as a double, enough for a timestamp
in milliseconds): unbounded, a forced call can be a number that never ends. Gemma 3 270M answered "days": 1000...
until `max_tokens` cut the call (each digit is a token): no call at all, where the grammar had promised a valid one.
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr

INTEGER_BOUND = 10**15 - 1  # the largest magnitude of a forced integer argument whose schema sets no bound


def compile_tool_calls(compiler: xgr.GrammarCompiler, value: str) -> xgr.CompiledGrammar:
    """The compiled grammar of a `tool_calls` spec's value; xgrammar raises for what it refuses."""
    return compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": tool_calls_format(value)}))


def tool_calls_format(value: str) -> dict:
    """The structural tag format of a `tool_calls` spec's value (see the module docstring)."""
    spec = json.loads(value)
    tags = [{"type": "tag", "begin": call["begin"], "content": _arguments(call["schema"]), "end": call["end"]}
            for call in spec["calls"]]
    one = spec["max_calls"] == 1
    calls = {"type": "tags_with_separator", "tags": tags, "separator": spec["separator"], "at_least_one": True,
             "stop_after_first": one}
    prefix, suffix, trigger = spec["prefix"], spec["suffix"], spec["trigger"]
    if trigger is None:
        return {"type": "sequence", "elements": [*_const(prefix), calls, *_const(suffix)]}
    if prefix:  # the calls sit in one container, which the trigger opens
        container = {"type": "tag", "begin": prefix, "content": calls, "end": suffix}
        return {"type": "triggered_tags", "triggers": [trigger], "tags": [container], "stop_after_first": True}
    return {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "stop_after_first": one}


def _arguments(schema: dict) -> dict:
    # Compact and in the schema's order, as response formats are (compile_call.py): ", " and ": ", no free
    # whitespace, no properties beyond the declared ones.
    grammar = xgr.Grammar.from_json_schema(json.dumps(bounded_integers(schema)), any_whitespace=False,
                                           strict_mode=True)
    return {"type": "grammar", "grammar": str(grammar)}


def _const(text: str) -> list[dict]:
    return [{"type": "const_string", "value": text}] if text else []


def bounded_integers(schema: Any) -> Any:
    """`schema` with INTEGER_BOUND on each side of every integer that has no bound on that side (a copy: the
    caller's schema is left as it is). Each subschema is rewritten where it is, whatever keyword holds it."""
    if isinstance(schema, list):
        return [bounded_integers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded_integers(value) if key not in ("enum", "const", "default", "examples") else value
           for key, value in schema.items()}
    if out.get("type") == "integer":
        low, high = out.get("minimum", out.get("exclusiveMinimum")), out.get("maximum", out.get("exclusiveMaximum"))
        if low is None and _number_at_least(high, -INTEGER_BOUND):
            out["minimum"] = -INTEGER_BOUND
        if high is None and _number_at_least(INTEGER_BOUND, low):
            out["maximum"] = INTEGER_BOUND
    return out


def _number_at_least(a: Any, b: Any) -> bool:
    """a >= b, where a bound that is absent or not a number does not count (the range stays non-empty)."""
    return not all(isinstance(x, int | float) and not isinstance(x, bool) for x in (a, b)) or a >= b

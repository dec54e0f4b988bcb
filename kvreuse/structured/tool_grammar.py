"""The grammar of tool calls: a format's calls, each `begin` + its tool's arguments as JSON + `end`, as one xgrammar
structural tag. Which text surrounds a call is the format's (kvreuse/tools/grammar.py writes it into the spec); here
it is only tags, separators and a trigger.

The value of a `tool_calls` FormatSpec is a JSON object: `calls` ([{begin, schema, end}], one per callable tool),
`separator` between calls, `prefix` and `suffix` around them all, `max_calls` (1 or null: any number), and
`trigger`: null when the answer must be calls (`required`, a named tool), else the text that starts them (`auto`:
free text until the trigger, then only valid calls, which always end).
"""

from __future__ import annotations

import json

import xgrammar as xgr


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
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    return {"type": "grammar", "grammar": str(grammar)}


def _const(text: str) -> list[dict]:
    return [{"type": "const_string", "value": text}] if text else []

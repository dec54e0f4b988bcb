"""Tool-call parsers, one per model family's way of writing calls, and the choice of one for a chat template."""

from __future__ import annotations

from collections.abc import Collection

from kvreuse.tools.parsers.base import ToolParser
from kvreuse.tools.parsers.hermes import HermesParser
from kvreuse.tools.parsers.json_calls import JsonParser
from kvreuse.tools.parsers.llama3_json import Llama3JsonParser
from kvreuse.tools.parsers.mistral import MistralParser
from kvreuse.tools.parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, PythonicParser, MistralParser, JsonParser)}


def get_parser(name: str, tool_names: Collection[str]) -> ToolParser:
    """The parser of format `name` for calls to `tool_names`; ValueError for a name not in PARSERS."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call format {name!r}: expected one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name](tool_names)


def detect_format(chat_template: str | None) -> str:
    """The format a chat template teaches its model to call tools in; "json" (kvreuse's own) when it teaches none."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "[func_name1(" in template:
        return "pythonic"
    if "<|python_tag|>" in template or all(s in template for s in ("<|start_header_id|>", "tools", "parameters")):
        return "llama3_json"
    return "json"

"""What a tool request constrains, as a `tool_calls` FormatSpec (structured/tool_grammar.py compiles it): each
format's call layout, the same text its parser's `render` writes, so a forced call reads back as the model wrote it.

`required` and a named tool force calls from the first token; `auto` leaves the answer free until the format's
trigger, then forces a valid call that ends (a lazy grammar). `none` constrains nothing. The pythonic format has no
layout (its arguments are Python, not JSON): its calls are parsed, and a forced call is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvreuse.structured.formats import FormatSpec
from kvreuse.tools.request import ToolError, ToolRequest


@dataclass(frozen=True)
class CallLayout:
    """The text around a format's calls: `call` holds `{name}` (the JSON string of the tool's name) and is followed
    by the arguments object, then `call_end`."""
    call: str
    call_end: str
    separator: str
    trigger: str
    prefix: str = ""
    suffix: str = ""

    def begin(self, name: str) -> str:
        return self.call.format(name=json.dumps(name, ensure_ascii=False))


LAYOUTS = {
    "hermes": CallLayout('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "\n", "<tool_call>"),
    "json": CallLayout('{{"name": {name}, "arguments": ', "}", ", ", '{"tool_calls"', '{"tool_calls": [', "]}"),
    "llama3_json": CallLayout('{{"name": {name}, "parameters": ', "}", "; ", '{"name"'),
    "mistral": CallLayout('{{"name": {name}, "arguments": ', "}", ", ", "[TOOL_CALLS]", "[TOOL_CALLS][", "]"),
}


def tool_format(request: ToolRequest, format_name: str) -> FormatSpec | None:
    """The grammar `request` asks for in `format_name`'s layout, or None when it constrains nothing. ToolError
    (tool_choice) when it forces a call in a format without a layout."""
    if request.mode == "none":
        return None
    layout = LAYOUTS.get(format_name)
    if layout is None:
        if request.mode == "auto":
            return None
        raise ToolError("tool_choice", f"{request.mode!r} forces a call through a grammar, which the "
                                       f"{format_name} tool-call format has none of; use 'auto' or another "
                                       f"format (--tool-call-parser)")
    calls = [{"begin": layout.begin(tool.name), "schema": tool.parameters, "end": layout.call_end}
             for tool in request.callable_tools]
    value = {"calls": calls, "separator": layout.separator, "prefix": layout.prefix, "suffix": layout.suffix,
             "max_calls": request.max_calls, "trigger": layout.trigger if request.mode == "auto" else None}
    return FormatSpec("tool_calls", json.dumps(value, ensure_ascii=False, separators=(",", ":")), "tools")

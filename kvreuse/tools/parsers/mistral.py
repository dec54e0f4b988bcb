"""Mistral calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v0.3) or `[TOOL_CALLS]name[ARGS]{...}`
(repeated, newer tokenizers), after optional content."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from kvreuse.tools.parsers.base import (
    PENDING,
    FoundCall,
    Segment,
    ToolCall,
    ToolParser,
    json_end,
    loads_or_none,
    skip_ws,
)

_ARGS = "[ARGS]"
_NAME = re.compile(r"[\w.-]*")


class MistralParser(ToolParser):
    name = "mistral"
    trigger = "[TOOL_CALLS]"

    def _split(self, text: str, final: bool) -> list[Segment]:
        start = text.find(self.trigger)
        if start == -1:
            return [text]
        pos = skip_ws(text, start + len(self.trigger))
        if pos == len(text):
            return [text] if final else [text[:start]]
        found = self._call_list(text, pos + 1, final) if text[pos] == "[" else self._named_calls(text, pos, final)
        if found is None:
            return [text]
        calls, end = found
        return [text[:start], *calls] if end is None else [text[:start], *calls, text[end:]]

    def _named_calls(self, text: str, pos: int, final: bool) -> tuple[list[FoundCall], int | None] | None:
        calls: list[FoundCall] = []
        while True:
            call = self._named_call(text, pos, final)
            if call is None:
                return None
            if call is PENDING:
                return calls, None
            calls.append(call)
            if call.end is None:
                return calls, None
            pos = skip_ws(text, call.end)
            if text.startswith(self.trigger, pos):
                pos = skip_ws(text, pos + len(self.trigger))
            elif not final and self.trigger.startswith(text[pos:]):
                return calls, None
            else:
                return calls, call.end

    def _named_call(self, text: str, pos: int, final: bool) -> FoundCall | None:
        """`name[ARGS]{...}` at text[pos]."""
        name_end = _NAME.match(text, pos).end()
        name = text[pos:name_end]
        if not text.startswith(_ARGS, name_end):
            partial = name_end == len(text) and any(t.startswith(name) for t in self.tool_names)
            pending = partial or (name in self.tool_names and _ARGS.startswith(text[name_end:]))
            return PENDING if pending and not final else None
        if name not in self.tool_names:
            return None
        start = skip_ws(text, name_end + len(_ARGS))
        if start == len(text):
            return None if final else PENDING
        if text[start] != "{":
            return None
        end = json_end(text, start)
        if end is None:
            return None if final else FoundCall(name, text[start:], None)
        return FoundCall(name, text[start:end], end) if isinstance(loads_or_none(text[start:end]), dict) else None

    def render(self, calls: Sequence[ToolCall], content: str = "") -> str:
        items = ", ".join(f'{{"name": {json.dumps(c.name, ensure_ascii=False)}, "arguments": {c.arguments}}}'
                          for c in calls)
        text = f"{self.trigger}[{items}]" if calls else ""
        return "\n".join(t for t in (content, text) if t)

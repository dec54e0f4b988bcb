"""kvreuse's own format, for chat templates without tool calling: the whole answer is one JSON object
`{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`."""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvreuse.tools.parsers.base import Segment, ToolCall, ToolParser, skip_ws, whole_answer

_HEAD = ("{", '"tool_calls"', ":", "[")


class JsonParser(ToolParser):
    name = "json"
    trigger = '{"tool_calls"'

    def _split(self, text: str, final: bool) -> list[Segment]:
        pos = skip_ws(text, 0)
        for token in _HEAD:
            if not text.startswith(token, pos):
                return [] if not final and token.startswith(text[pos:]) else [text]
            pos = skip_ws(text, pos + len(token))
        found = self._call_list(text, pos, final)
        if found is None:
            return [text]
        calls, end = found
        rest = "" if end is None else text[skip_ws(text, end):]
        if (rest[:1] == "}" and not rest[1:].strip()) or (not final and not rest):
            return list(calls)
        return [text]

    def render(self, calls: Sequence[ToolCall], content: str = "") -> str:
        items = ", ".join(f'{{"name": {json.dumps(c.name, ensure_ascii=False)}, "arguments": {c.arguments}}}'
                          for c in calls)
        return whole_answer(content, f'{{"tool_calls": [{items}]}}' if calls else "")

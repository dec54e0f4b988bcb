"""Hermes-style calls (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
after optional content."""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvreuse.tools.parsers.base import PENDING, Segment, ToolCall, ToolParser, skip_ws

_CLOSE = "</tool_call>"


class HermesParser(ToolParser):
    """A block whose JSON is not a call is content; a block left unclosed still counts once its object is whole."""

    name = "hermes"
    trigger = "<tool_call>"

    def _split(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos = search = 0
        while (start := text.find(self.trigger, search)) != -1:
            call = self._call_object(text, skip_ws(text, start + len(self.trigger)), final)
            if call is None:
                search = start + 1
                continue
            segments.append(text[pos:start])
            if call is PENDING:
                return segments
            segments.append(call)
            if call.end is None:
                return segments
            after = skip_ws(text, call.end)
            if text.startswith(_CLOSE, after):
                pos = search = after + len(_CLOSE)
            elif not final and _CLOSE.startswith(text[after:]):
                return segments
            else:
                pos = search = call.end
        segments.append(text[pos:])
        return segments

    def render(self, calls: Sequence[ToolCall], content: str = "") -> str:
        blocks = [f'<tool_call>\n{{"name": {json.dumps(c.name, ensure_ascii=False)}, "arguments": {c.arguments}}}\n'
                  f"{_CLOSE}" for c in calls]
        return "\n".join([content, *blocks] if content else blocks)

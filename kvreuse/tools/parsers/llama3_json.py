"""Llama 3.1/3.2 JSON calls: the whole answer is `{"name": ..., "parameters": {...}}`, or several joined by "; ",
after an optional `<|python_tag|>`."""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvreuse.tools.parsers.base import PENDING, Segment, ToolCall, ToolParser, skip_ws, whole_answer

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    trigger = '{"name"'

    def _split(self, text: str, final: bool) -> list[Segment]:
        pos = skip_ws(text, 0)
        if text.startswith(_PYTHON_TAG, pos):
            pos = skip_ws(text, pos + len(_PYTHON_TAG))
        elif not final and _PYTHON_TAG.startswith(text[pos:]):
            return []
        calls: list[Segment] = []
        while True:
            call = self._call_object(text, pos, final)
            if call is None:
                return [text]
            if call is PENDING:
                return calls
            calls.append(call)
            pos = len(text) if call.end is None else skip_ws(text, call.end)
            if pos == len(text):
                return calls
            if text[pos] != ";":
                return [text]
            pos = skip_ws(text, pos + 1)

    def render(self, calls: Sequence[ToolCall], content: str = "") -> str:
        return whole_answer(content, "; ".join(
            f'{{"name": {json.dumps(c.name, ensure_ascii=False)}, "parameters": {c.arguments}}}' for c in calls))

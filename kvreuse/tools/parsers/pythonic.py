"""Pythonic calls (Llama 3.2/4, vLLM's pythonic parser): the whole answer is a Python list of calls with keyword
arguments of literal values, `[get_weather(city="Paris", days=3), get_time()]`."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence

from kvreuse.tools.parsers.base import FoundCall, Segment, ToolCall, ToolParser, skip_ws, whole_answer

_NAME = re.compile(r"[A-Za-z_][\w.]*")
_TOKEN = re.compile(r"""'(?:[^'\\]|\\.)*(')?|"(?:[^"\\]|\\.)*(")?|[()\[\]{}]""", re.S)


def _paren_end(text: str, start: int) -> int | None:
    """The index just past the ')' that closes the '(' at text[start] (quotes followed), None when the text ends."""
    depth = 0
    for m in _TOKEN.finditer(text, start):
        token = m.group()
        if token[0] in "'\"":
            if m.group(1) is None and m.group(2) is None:
                return None
        else:
            depth += 1 if token in "([{" else -1
            if depth == 0:
                return m.end()
    return None


def _arguments(source: str, tool_names: frozenset[str]) -> tuple[str, str] | None:
    """The name and JSON arguments of the call `source`, None when it is not a call of a tool with literal keywords."""
    try:
        call = ast.parse(source, mode="eval").body
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in tool_names
                and not call.args and all(k.arg for k in call.keywords)):
            return None
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        return call.func.id, json.dumps(kwargs, ensure_ascii=False, allow_nan=False)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


def _literal(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, bool) or value is None:
        return repr(value)
    return json.dumps(value, ensure_ascii=False)


class PythonicParser(ToolParser):
    """Each call's arguments come in one piece once its closing parenthesis is written."""

    name = "pythonic"
    trigger = "["

    def _split(self, text: str, final: bool) -> list[Segment]:
        pos = skip_ws(text, 0)
        if pos == len(text) or text[pos] != "[":
            return [] if pos == len(text) and not final else [text]
        calls: list[Segment] = []
        while True:
            pos = skip_ws(text, pos + 1)
            name = _NAME.match(text, pos)
            name_end = name.end() if name else pos
            opening = skip_ws(text, name_end)
            if opening == len(text):
                started = any(t.startswith(text[pos:name_end]) for t in self.tool_names)
                return calls if started and not final else [text]
            if text[opening] != "(" or text[pos:name_end] not in self.tool_names:
                return [text]
            end = _paren_end(text, opening)
            if end is None:
                return [text] if final else calls
            found = _arguments(text[pos:end], self.tool_names)
            if found is None:
                return [text]
            calls.append(FoundCall(*found, end))
            pos = skip_ws(text, end)
            if pos == len(text):
                return [text] if final else calls
            if text[pos] == "]":
                return calls if not text[pos + 1:].strip() else [text]
            if text[pos] != ",":
                return [text]

    def render(self, calls: Sequence[ToolCall], content: str = "") -> str:
        items = ", ".join(f"{c.name}(" + ", ".join(f"{k}={_literal(v)}" for k, v in json.loads(c.arguments).items())
                          + ")" for c in calls)
        return whole_answer(content, f"[{items}]" if calls else "")

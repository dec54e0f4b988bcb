"""What every tool-call format shares: the parsed answer, the stream events, the JSON scanning, and the streaming
parser that re-reads the text on each piece and emits what changed."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object: the model's own text for JSON formats


@dataclass(frozen=True)
class ParsedAnswer:
    content: str  # the text outside the calls, without the whitespace around call markup
    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


StreamEvent = ContentDelta | CallStart | ArgumentsDelta


@dataclass(frozen=True)
class FoundCall:
    """A call in the text being parsed."""

    name: str
    arguments: str
    end: int | None  # where the call's text ends; None while it is unfinished (then `arguments` may be cut short)


PENDING = FoundCall("", "", None)  # a call may start here, but the text ends before it is known whether one does
Segment = str | FoundCall

_WS = re.compile(r"\s*")
_SCALAR = re.compile(r"[^\s,:\]}]*")
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*(")?|[{}\[\]]', re.S)
_FIELDS = ('"name"', '"arguments"', '"parameters"')


def skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def json_end(text: str, start: int) -> int | None:
    """The index just past the JSON value that starts at text[start], or None when the text ends before the value
    does (a number or literal at the very end counts as unfinished). Only strings and brackets are followed: what
    it finds is checked by json.loads."""
    if text[start] not in '{["':
        end = _SCALAR.match(text, start).end()
        return end if end < len(text) else None
    depth = 0
    for m in _TOKEN.finditer(text, start):
        token = m.group()
        if token[0] == '"':
            if m.group(1) is None:
                return None
        elif token in "{[":
            depth += 1
        else:
            depth -= 1
        if depth == 0:
            return m.end()
    return None


class Member(NamedTuple):
    key: str  # the key's JSON text, quotes included (unfinished when the text ends inside it)
    start: int | None  # where its value starts
    end: int | None  # just past its value


def object_members(text: str, start: int) -> tuple[list[Member], int | None] | None:
    """The members of the JSON object whose '{' is at text[start], and the index just past its '}' (None when the
    text ends first); None when the text there cannot be an object."""
    members: list[Member] = []
    pos = skip_ws(text, start + 1)
    if text.startswith("}", pos):
        return members, pos + 1
    while pos < len(text):
        if text[pos] != '"':
            return None
        key_end = json_end(text, pos)
        colon = len(text) if key_end is None else skip_ws(text, key_end)
        if colon < len(text) and text[colon] != ":":
            return None
        value = len(text) if colon == len(text) else skip_ws(text, colon + 1)
        if value == len(text):
            members.append(Member(text[pos:key_end], None, None))
            return members, None
        value_end = json_end(text, value)
        members.append(Member(text[pos:key_end], value, value_end))
        if value_end is None:
            return members, None
        pos = skip_ws(text, value_end)
        if text.startswith("}", pos):
            return members, pos + 1
        if pos < len(text) and text[pos] != ",":
            return None
        pos = skip_ws(text, pos + 1)
    return members, None


def loads_or_none(raw: str) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def whole_answer(content: str, calls_text: str) -> str:
    """The answer of a format whose calls are the whole answer: the calls' text, or the content when there are none.
    A turn with both (a client's own history) shows the content, then the calls on a line of their own."""
    return "\n".join(part for part in (content, calls_text) if part)


class ToolParser:
    """One model family's way of writing tool calls. Only calls to `tool_names` are calls: anything else is content."""

    name: ClassVar[str]
    trigger: ClassVar[str]  # the text whose appearance starts a call

    def __init__(self, tool_names: Collection[str]):
        self.tool_names = frozenset(tool_names)
        self._quoted = {json.dumps(n, ensure_ascii=a) for n in self.tool_names for a in (True, False)}

    def parse(self, text: str) -> ParsedAnswer:
        """The content and the calls of a whole answer."""
        content, calls = self._view(text, final=True)
        return ParsedAnswer(content, tuple(ToolCall(c.name, c.arguments) for c in calls))

    def stream(self) -> ToolStream:
        """A fresh streaming parser for one answer."""
        return ToolStream(self)

    def render(self, calls: Sequence[ToolCall], content: str = "") -> str:
        """The text of an answer made of `content` and then `calls` in this format, each call's arguments verbatim."""
        raise NotImplementedError

    def _split(self, text: str, final: bool) -> list[Segment]:
        """The text cut into content and calls. Unless `final`, the text may go on: the segments stop where the text
        stops being certain, and the last call may be unfinished."""
        raise NotImplementedError

    def _view(self, text: str, final: bool) -> tuple[str, list[FoundCall]]:
        """The content and the calls of the text: the content pieces between calls, stripped next to a call, joined
        by newlines."""
        segments = self._split(text, final)
        pieces, calls = [], []
        for i, segment in enumerate(segments):
            if isinstance(segment, FoundCall):
                calls.append(segment)
                continue
            if i > 0:
                segment = segment.lstrip()
            if i + 1 < len(segments):
                segment = segment.rstrip()
            elif not final:
                segment = self._hold_back(segment)
            if segment:
                pieces.append(segment)
        return "\n".join(pieces), calls

    def _hold_back(self, text: str) -> str:
        """Content that more text may still turn into a call's markup, or into whitespace around one, cut off."""
        text = text.rstrip()
        for size in range(min(len(self.trigger), len(text)), 0, -1):
            if text.endswith(self.trigger[:size]):
                return text[:-size].rstrip()
        return text

    def _call_object(self, text: str, start: int, final: bool) -> FoundCall | None:
        """The call written as a JSON object {"name": ..., "arguments": {...}} ("parameters" also names the arguments)
        at text[start]: None when there is none, PENDING while that is not known yet."""
        if start == len(text):
            return None if final else PENDING
        found = object_members(text, start) if text[start] == "{" else None
        if found is None or (final and found[1] is None):
            return None
        members, end = found
        fields = {}
        for member in members:
            if member.key not in _FIELDS:
                return PENDING if end is None and any(f.startswith(member.key) for f in _FIELDS) else None
            if member.key in fields:
                return None
            fields[member.key] = member
        if '"arguments"' in fields and '"parameters"' in fields:
            return None
        arguments = fields.get('"arguments"') or fields.get('"parameters"')
        name = fields.get('"name"')
        if name is None or name.end is None:
            unsettled = name is None or name.start is None or any(q.startswith(text[name.start:]) for q in self._quoted)
            return PENDING if end is None and unsettled else None
        tool = loads_or_none(text[name.start:name.end])
        if not isinstance(tool, str) or tool not in self.tool_names:
            return None
        if end is not None and loads_or_none(text[start:end]) is None:
            return None
        if arguments is None or arguments.start is None:
            return PENDING if end is None else FoundCall(tool, "{}", end)
        if text[arguments.start] != "{":
            return None
        return FoundCall(tool, text[arguments.start:arguments.end], end)

    def _call_list(self, text: str, pos: int, final: bool) -> tuple[list[FoundCall], int | None] | None:
        """The calls of a JSON list whose '[' is just before `pos`, and the index just past its ']' (None while the
        text may go on); None when it is not a non-empty list of calls."""
        calls: list[FoundCall] = []
        while True:
            call = self._call_object(text, skip_ws(text, pos), final)
            if call is None:
                return None
            if call is PENDING:
                return calls, None
            calls.append(call)
            if call.end is None:
                return calls, None
            pos = skip_ws(text, call.end)
            if pos == len(text):
                return None if final else (calls, None)
            if text[pos] == "]":
                return calls, pos + 1
            if text[pos] != ",":
                return None
            pos += 1


class ToolStream:
    """Parses one answer as it is generated: each piece of text gives the events that the text so far settles."""

    def __init__(self, parser: ToolParser):
        self._parser = parser
        self._text = ""
        self._content = ""
        self._calls: list[FoundCall] = []

    def feed(self, text: str) -> list[StreamEvent]:
        """The events settled by the next piece of generated text."""
        self._text += text
        return self._events(final=False)

    def finish(self) -> list[StreamEvent]:
        """The answer ended: the events for what was held back."""
        return self._events(final=True)

    def _events(self, final: bool) -> list[StreamEvent]:
        content, calls = self._parser._view(self._text, final)
        sent = self._calls
        if not content.startswith(self._content) or len(calls) < len(sent) or any(
                c.name != s.name or not c.arguments.startswith(s.arguments)
                for c, s in zip(calls[:len(sent)], sent, strict=True)):
            return []  # the text broke a call already begun (cut short or invalid): what was sent stands
        events: list[StreamEvent] = []
        if len(content) > len(self._content):
            events.append(ContentDelta(content[len(self._content):]))
        for i, call in enumerate(calls):
            if i >= len(sent):
                events.append(CallStart(i, call.name))
            done = sent[i].arguments if i < len(sent) else ""
            if len(call.arguments) > len(done):
                events.append(ArgumentsDelta(i, call.arguments[len(done):]))
        self._content, self._calls = content, calls
        return events

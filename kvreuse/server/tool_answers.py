"""A chat answer with tools: its calls parsed out of the generated text, given ids, shaped as OpenAI's
`message.tool_calls` (whole) or `delta.tool_calls` (streamed), and each turn of calls recorded so that its echo in
the next request is spliced back as the generated tokens (kvreuse/tools/turns.py).

A streamed answer is parsed as it comes (the parser's streaming entry); the ids it gave its calls are the ones
recorded, and the calls it streamed reassemble to the whole-text parse.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from kvreuse.engine.output import RequestOutput
from kvreuse.tools.parsers.base import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ParsedAnswer,
    StreamEvent,
    ToolParser,
    ToolStream,
)
from kvreuse.tools.request import ToolRequest
from kvreuse.tools.turns import GeneratedTurn, TurnStore


@dataclass
class ToolAnswers:
    """How one chat request with tools is answered. `end_ids`: the end-of-turn tokens, left out of a recorded turn
    (the chat template writes its own)."""
    request: ToolRequest
    parser: ToolParser
    turns: TurnStore
    scope: str | None
    end_ids: frozenset[int]
    _streams: dict[int, ChoiceStream] = field(default_factory=dict)

    @property
    def parses(self) -> bool:
        return self.request.mode != "none"

    def message(self, out: RequestOutput) -> tuple[dict, str | None]:
        """A whole choice's message (content, tool_calls) and finish reason."""
        answer = self.parser.parse(out.text) if self.parses else ParsedAnswer(out.text, ())
        if not answer.calls:
            return {"role": "assistant", "content": answer.content}, out.finish_reason
        call_ids = [new_call_id() for _ in answer.calls]
        self._record(call_ids, answer, out)
        tool_calls = [{"id": call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                      for call_id, c in zip(call_ids, answer.calls, strict=True)]
        return ({"role": "assistant", "content": answer.content or None, "tool_calls": tool_calls},
                self._finish_reason(out))

    def stream(self, index: int) -> ChoiceStream:
        """Choice `index`'s streaming state (made at its first delta)."""
        if index not in self._streams:
            self._streams[index] = ChoiceStream(self.parser.stream() if self.parses else None)
        return self._streams[index]

    def finish_stream(self, index: int, out: RequestOutput) -> tuple[list[dict], str | None]:
        """The last deltas of a streamed choice (what its parser held back) and its finish reason."""
        stream = self.stream(index)
        deltas = stream.finish()
        if not stream.call_ids:
            return deltas, out.finish_reason
        self._record(stream.call_ids, self.parser.parse(out.text), out)
        return deltas, self._finish_reason(out)

    def _finish_reason(self, out: RequestOutput) -> str | None:
        return self.request.finish_reason if out.finish_reason == "stop" else out.finish_reason

    def _record(self, call_ids: list[str], answer: ParsedAnswer, out: RequestOutput) -> None:
        if out.finish_reason != "stop" or len(call_ids) != len(answer.calls):  # cut short: not a turn to splice
            return
        token_ids = list(out.token_ids)
        while token_ids and token_ids[-1] in self.end_ids:
            token_ids.pop()
        self.turns.record(GeneratedTurn(self.scope, tuple(call_ids), answer.calls, answer.content,
                                        tuple(token_ids), out.text))


def new_call_id() -> str:
    """A call's id, in OpenAI's shape (`call_` and 24 characters)."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceStream:
    """One streamed choice: generated text in, OpenAI deltas out."""

    def __init__(self, parser_stream: ToolStream | None):
        self._parser = parser_stream
        self.call_ids: list[str] = []

    def deltas(self, text: str) -> list[dict]:
        if self._parser is None:
            return [{"content": text}] if text else []
        return [self._delta(event) for event in self._parser.feed(text)]

    def finish(self) -> list[dict]:
        return [self._delta(event) for event in self._parser.finish()] if self._parser is not None else []

    def _delta(self, event: StreamEvent) -> dict:
        if isinstance(event, ContentDelta):
            return {"content": event.text}
        if isinstance(event, CallStart):
            self.call_ids.append(new_call_id())
            function = {"name": event.name, "arguments": ""}
            return {"tool_calls": [{"index": event.index, "id": self.call_ids[-1], "type": "function",
                                    "function": function}]}
        assert isinstance(event, ArgumentsDelta)
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}

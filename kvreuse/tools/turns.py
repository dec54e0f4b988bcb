"""The tool-call turns this server generated, kept so that a conversation echoing one back is tokenized with the
tokens the model generated (a TokenSplice), which the prefix cache holds, instead of re-rendered text.

A turn is found by its first call's id and spliced only if the echo matches it exactly: the same call ids, names
and arguments (as JSON values: key order and spacing may differ) and the same content. A turn the client edited is
text again, rendered by the chat template: nothing it did not send is ever served. Bounded: the oldest turns go.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from kvreuse.tools.parsers.base import ToolCall

MAX_TURNS = 16384  # a turn is its ids and a few hundred tokens: ~10 MB at most


@dataclass(frozen=True)
class GeneratedTurn:
    """An assistant turn with tool calls, as generated: `token_ids` without the end-of-turn token."""
    scope: str | None               # the cache salt it was generated under: echoes under another salt never match
    call_ids: tuple[str, ...]
    calls: tuple[ToolCall, ...]
    content: str
    token_ids: tuple[int, ...]
    text: str

    def matches(self, scope: str | None, call_ids: list[str], calls: list[ToolCall], content: str) -> bool:
        return (scope == self.scope and tuple(call_ids) == self.call_ids and content == self.content
                and [c.name for c in calls] == [c.name for c in self.calls]
                and all(_same_json(a.arguments, b.arguments) for a, b in zip(calls, self.calls, strict=True)))


class TurnStore:
    """Thread-safe: turns are recorded on the event loop and looked up on the preparation threads."""

    def __init__(self, max_turns: int = MAX_TURNS):
        self.max_turns = max_turns
        self._turns: OrderedDict[str, GeneratedTurn] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._turns)

    def record(self, turn: GeneratedTurn) -> None:
        with self._lock:
            self._turns[turn.call_ids[0]] = turn
            self._turns.move_to_end(turn.call_ids[0])
            while len(self._turns) > self.max_turns:
                self._turns.popitem(last=False)

    def find(self, scope: str | None, call_ids: list[str], calls: list[ToolCall],
             content: str) -> GeneratedTurn | None:
        """The generated turn an echo matches exactly, or None."""
        with self._lock:
            turn = self._turns.get(call_ids[0]) if call_ids else None
        return turn if turn is not None and turn.matches(scope, call_ids, calls, content) else None


def _same_json(a: str, b: str) -> bool:
    if a == b:
        return True
    try:  # canonical text, not ==: in Python 1 == 1.0 == True, which are three different arguments
        return _canonical(a) == _canonical(b)
    except ValueError:
        return False


def _canonical(text: str) -> str:
    return json.dumps(json.loads(text), sort_keys=True, ensure_ascii=False)

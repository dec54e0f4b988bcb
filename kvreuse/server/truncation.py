"""`server.truncate = oldest`: fit a conversation that outgrew the context by dropping its oldest turns."""

from __future__ import annotations

from kvreuse.engine.errors import RequestError
from kvreuse.engine.front_end import FrontEnd

LEADING_ROLES = ("system", "developer")


def fit_conversation(front: FrontEnd, messages: list[dict], max_tokens: int | None,
                     tools: list[dict] | None = None) -> tuple[list[dict], int]:
    """Drop whole turns (a user message and the replies after it) right after the system message, oldest
    first, until the prompt plus `max_tokens` fits the context limit. The last message always stays; if it
    still does not fit, the engine's own check refuses the request. Returns (messages, turns dropped)."""
    needed = max_tokens or 1
    first = next((i for i, m in enumerate(messages) if m["role"] not in LEADING_ROLES), len(messages))
    starts = _tail_starts(messages, first)
    # Dropping more turns never lengthens the prompt, so the fewest drops that fit are found by bisection: a
    # logarithmic number of renders, where one per turn would take hours for a conversation of thousands of turns.
    # The last start (only the last message left) is taken without a check.
    low, high = 0, len(starts) - 1
    while low < high:
        mid = (low + high) // 2
        if _fits(front, messages[:first] + messages[starts[mid]:], needed, tools):
            high = mid
        else:
            low = mid + 1
    return messages[:first] + messages[starts[low]:], low


def _tail_starts(messages: list[dict], first: int) -> list[int]:
    """Where the kept messages after the leading system ones may start: at `first` (nothing dropped), after each
    whole turn, and at the last message."""
    starts = [first]
    while len(messages) - starts[-1] > 1:
        start = starts[-1] + 1
        while len(messages) - start > 1 and messages[start]["role"] not in ("user", *LEADING_ROLES):
            start += 1
        starts.append(start)
    return starts


def _fits(front: FrontEnd, messages: list[dict], needed: int, tools: list[dict] | None) -> bool:
    try:
        return len(front.tokenize_chat(messages, tools)) + needed <= front.max_model_len
    except RequestError as exc:
        if exc.code != "context_length_exceeded":  # not a matter of length: dropping turns cannot help
            raise
        return False

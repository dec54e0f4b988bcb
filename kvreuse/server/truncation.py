"""`server.truncate = oldest`: fit a conversation that outgrew the context by dropping its oldest turns."""

from __future__ import annotations

from kvreuse.engine.engine import LLMEngine

LEADING_ROLES = ("system", "developer")


def fit_conversation(engine: LLMEngine, messages: list[dict], max_tokens: int | None) -> tuple[list[dict], int]:
    """Drop whole turns (a user message and the replies after it) right after the system message, oldest
    first, until the prompt plus `max_tokens` fits the context limit. The last message always stays; if it
    still does not fit, the engine's own check refuses the request. Returns (messages, turns dropped)."""
    kept = list(messages)
    needed = max_tokens or 1
    dropped = 0
    first = next((i for i, m in enumerate(kept) if m["role"] not in LEADING_ROLES), len(kept))
    while len(kept) - first > 1:
        if len(engine.tokenize_prompt(engine.render_chat(kept))) + needed <= engine.max_model_len:
            break
        del kept[first]
        while len(kept) - first > 1 and kept[first]["role"] not in ("user", *LEADING_ROLES):
            del kept[first]
        dropped += 1
    return kept, dropped

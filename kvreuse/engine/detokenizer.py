"""Incremental detokenization and stop-string search: each step decodes only the new completion tokens (with the
last confirmed ones as left context) and searches stop strings only where the new text could complete one.

As vLLM's incremental detokenizer does: `prefix_offset` .. `read_offset` are the completion tokens whose
text was confirmed last (the context), and text is confirmed only when it does not end in U+FFFD: a multi-byte
character split across tokens decodes to U+FFFD until its last byte arrives. Decoding the context and the new
tokens together and dropping the context's own text keeps what whole decoding would give (spaces a tokenizer
drops at the start of a decode, characters completed across the boundary), so the confirmed `text` plus the pending
text always equals decoding the whole completion (tested on random token sequences of the real tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence as Strings
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvreuse.weights.tokenizer import Tokenizer

PARTIAL = "\ufffd"  # what a character cut between tokens decodes to


@dataclass
class DetokenizedText:
    """A sequence's completion as text, confirmed so far (the stop check writes it; see the module docstring)."""
    text: str = ""            # confirmed text: never ends in half a character
    prefix_offset: int = 0    # completion tokens [prefix_offset, read_offset): context of the next decode
    read_offset: int = 0      # completion tokens whose text is in `text`


def detokenize(tokenizer: Tokenizer, out: DetokenizedText, token_ids: Strings[int], num_prompt_tokens: int) -> str:
    """Decode the completion tokens (those of `token_ids` after its first `num_prompt_tokens`) after
    `out.read_offset`; append their text to `out.text` and advance the offsets unless it ends in a partial character.
    Returns the text still pending (empty once confirmed)."""
    base = num_prompt_tokens
    context = tokenizer.decode(token_ids[base + out.prefix_offset:base + out.read_offset])
    new = tokenizer.decode(token_ids[base + out.prefix_offset:])[len(context):]
    if not new or new.endswith(PARTIAL):
        return new
    out.text += new
    out.prefix_offset, out.read_offset = out.read_offset, len(token_ids) - base
    return ""


def find_stop(text: str, stops: Strings[str], start: int) -> int:
    """Where the earliest stop string occurs in `text` at or after `start`, or -1."""
    return min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)


def stop_search_start(checked_chars: int, stops: Strings[str]) -> int:
    """Where a stop string that was not in the first `checked_chars` characters can start now: it must end in
    the new text, so it starts at most (longest stop - 1) characters before it."""
    return max(0, checked_chars - max(map(len, stops), default=1) + 1)

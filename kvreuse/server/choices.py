"""The `choices` of OpenAI's answers, whole or streamed: text, finish reason and logprobs, in each endpoint's shape.

Completions use the legacy logprobs shape (`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob},
`text_offset`); with `echo` the prompt's tokens come first, the first of them without a logprob (nothing precedes it).
Chat uses `content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]`. A token's string is its own
decoding (a piece of a multi-byte character decodes to U+FFFD, as in vLLM). As in vLLM, a completion's
`top_logprobs` also holds the chosen token, so it may have one entry more than asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvreuse.layers.sampler import TokenLogprob
from kvreuse.weights.tokenizer import Tokenizer


@dataclass
class TextOffsets:
    """Where the next token's text starts in a choice's text (completions' `text_offset`), carried across chunks."""
    offset: int = 0


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer, records: Sequence[TokenLogprob | None], offsets: TextOffsets,
                        first_token_id: int | None = None) -> dict:
    """The legacy shape for `records`; a None record is the prompt's first token (`first_token_id`), which nothing
    precedes: its string is in `tokens`, without a logprob."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for record in records:
        text = token_text(tokenizer, first_token_id if record is None else record.token_id)
        tokens.append(text)
        text_offset.append(offsets.offset)
        offsets.offset += len(text)
        token_logprobs.append(None if record is None else record.logprob)
        top = None
        if record is not None:
            top = {token_text(tokenizer, t): lp for t, lp in record.top}
            top.setdefault(text, record.logprob)
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def merge_logprobs(parts: Sequence[dict]) -> dict:
    """Legacy logprobs objects one after the other (the echoed prompt's, then the completion's)."""
    return {key: [v for part in parts for v in part[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                      "text_offset")}


def chat_logprobs(tokenizer: Tokenizer, records: Sequence[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(r.token_id, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                        for r in records]}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return chat_message_choice(index, {"role": "assistant", "content": text}, finish_reason, logprobs)


def chat_message_choice(index: int, message: dict, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk_choice(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

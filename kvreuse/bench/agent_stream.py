"""One streamed chat completion, reassembled: its text, its tool calls (deltas joined by `index`), its finish reason,
the usage and the server's timings of the last chunks, and the time to its first chunk with a choice.

TTFT is taken at the first chunk with a choice: kvreuse, vLLM and llama-server send the role's chunk with the first
generated token (llama-server at `n_decoded == 1`), while a call's first delta waits for its parser.

Where each token count comes from (`usage_counts`): prompt, cached and completion tokens from the OpenAI usage
(`prompt_tokens`, `prompt_tokens_details.cached_tokens`, `completion_tokens`); the prompt tokens the server computed
from, in order, kvreuse's `usage.computed_prompt_tokens`, llama-server's `timings.prompt_n` (the prompt tokens its
slot processed; sent on the stream's last chunk), else prompt minus cached.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

COMPUTED_FROM_USAGE = "usage.computed_prompt_tokens"
COMPUTED_FROM_TIMINGS = "timings.prompt_n"
COMPUTED_FROM_CACHED = "prompt_tokens - cached_tokens"


@dataclass
class Answer:
    """A streamed answer, reassembled; `timings` is llama-server's own (absent elsewhere)."""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    ttft_s: float | None = None


def add_call_delta(calls: dict[int, dict], delta) -> None:
    """Fold one `delta.tool_calls[]` item into `calls` (index -> call): id, type and name from the first delta that
    has them, argument fragments appended."""
    call = calls.setdefault(delta.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
    call["id"] = call["id"] or delta.id or ""
    call["type"] = delta.type or call["type"]
    if delta.function is not None:
        call["function"]["name"] = call["function"]["name"] or delta.function.name or ""
        call["function"]["arguments"] += delta.function.arguments or ""


async def stream_answer(client, request: dict) -> Answer:
    """One streamed chat completion through the openai client (`request`: create()'s arguments, without stream)."""
    answer, calls = Answer(), {}
    start = time.perf_counter()
    stream = await client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            answer.usage = chunk.usage.model_dump()
        timings = (getattr(chunk, "model_extra", None) or {}).get("timings")
        if isinstance(timings, dict):
            answer.timings = timings
        for choice in chunk.choices:
            if answer.ttft_s is None:
                answer.ttft_s = time.perf_counter() - start
            delta = choice.delta
            answer.content += delta.content or ""
            for call in delta.tool_calls or ():
                add_call_delta(calls, call)
            answer.finish_reason = choice.finish_reason or answer.finish_reason
    answer.tool_calls = [calls[i] for i in sorted(calls)]
    return answer


def usage_counts(usage: dict, timings: dict | None = None) -> tuple[int | None, int | None, int | None, int | None,
                                                                    str | None]:
    """(prompt, cached, computed, completion, computed_from) tokens from a usage object and the server's timings;
    `computed_from` names the field the computed count came from (None when there is no count)."""
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    computed, source = usage.get("computed_prompt_tokens"), COMPUTED_FROM_USAGE
    if computed is None and (timings or {}).get("prompt_n") is not None:
        computed, source = timings["prompt_n"], COMPUTED_FROM_TIMINGS
    if computed is None and prompt is not None:
        computed, source = prompt - (cached or 0), COMPUTED_FROM_CACHED
    return prompt, cached, computed, completion, source if computed is not None else None

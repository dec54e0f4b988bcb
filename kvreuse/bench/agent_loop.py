"""The agent loop against one server: a session's K steps in order, and N sessions side by side.

Steps 1..K-1 ask for one call (`tool_choice: "required"`, `parallel_tool_calls: false`); the loop waits the simulated
tool latency, appends the assistant turn as it came (its `tool_calls` echoed verbatim) and one tool result per call,
and sends the next step. Step K asks for the final answer (`tool_choice: "none"`, `ignore_eos`: every system writes
an answer of the same length). The context grows every step, so a server that reuses the KV of the echoed turns
computes only the tool results and the template's glue. A step's new tokens are its prompt minus the previous step's
prompt and completion.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvreuse.bench.agent_stream import Answer, stream_answer, usage_counts
from kvreuse.bench.agent_workload import Session, make_sessions, tool_result

if TYPE_CHECKING:
    from kvreuse.bench.agent_replay import Transcript


@dataclass
class Options:
    """How the loop runs: sessions x steps, the answers' lengths, the tools' latency and result size, the seed."""
    sessions: int = 4
    steps: int = 6
    call_tokens: int = 96     # max_tokens of a step that must call a tool
    answer_tokens: int = 64   # max_tokens of the final answer (ignore_eos: always this long)
    tool_latency_s: float = 0.5
    tool_result_tokens: int = 150
    seed: int = 0
    session_hints: bool = False  # each session's requests carry its prompt_cache_key


@dataclass
class StepRecord:
    """One step of one session: times in seconds from the request; token counts as the server gave them (None where
    it gave none); `error` set when the step failed (it ends the session)."""
    session: int
    step: int                      # 1..K
    ttft_s: float = 0.0
    latency_s: float = 0.0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    computed_tokens: int | None = None
    completion_tokens: int | None = None
    new_tokens: int | None = None  # filled by `account_new_tokens`
    tool_calls: int = 0
    finish_reason: str | None = None
    computed_from: str | None = None  # the field the computed count came from (agent_stream)
    error: str = ""


def step_request(model: str, session: Session, messages: list[dict], final: bool, options: Options) -> dict:
    """The create() arguments of one step: a forced single call, or the final answer of a fixed length."""
    request = {"model": model, "messages": messages, "tools": session.tools, "temperature": 0,
               "tool_choice": "none" if final else "required",
               "max_tokens": options.answer_tokens if final else options.call_tokens}
    if options.session_hints:
        request["prompt_cache_key"] = f"agent-session-{session.index}"
    if final:
        request["extra_body"] = {"ignore_eos": True}  # every system writes an answer of the same length
    else:
        request["parallel_tool_calls"] = False  # one call a step: the same shape on every system
    return request


async def timed_step(client, request: dict, record: StepRecord) -> Answer | None:
    """Stream one step's answer, filling `record` (times, usage, calls); None if it failed (`record.error` says
    why): any client or server failure ends its session, not the bench."""
    start = time.perf_counter()
    try:
        answer = await stream_answer(client, request)
    except Exception as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        return None
    record.latency_s = time.perf_counter() - start
    record.ttft_s = answer.ttft_s if answer.ttft_s is not None else record.latency_s
    (record.prompt_tokens, record.cached_tokens, record.computed_tokens, record.completion_tokens,
     record.computed_from) = usage_counts(answer.usage, answer.timings)
    record.tool_calls, record.finish_reason = len(answer.tool_calls), answer.finish_reason
    return answer


async def run_session(client, model: str, session: Session, options: Options,
                      transcript: Transcript | None = None) -> list[StepRecord]:
    """The session's K steps in order; it stops at the first step that fails or, before the last, calls no tool.
    Each answered step is added to `transcript` when one is given (agent_replay)."""
    messages, records = session.messages(), []
    for step in range(1, options.steps + 1):
        final = step == options.steps
        record = StepRecord(session.index, step)
        records.append(record)
        request = step_request(model, session, messages, final, options)
        answer = await timed_step(client, request, record)
        if answer is None:
            break
        if transcript is not None:
            transcript.record(session.index, session.tools, request, record.completion_tokens)
        if final:
            break
        if not answer.tool_calls:
            record.error = f"no tool call in the answer (finish_reason {answer.finish_reason}): {answer.content[:200]}"
            break
        messages = await _after_calls(messages, answer, options)
    account_new_tokens(records)
    return records


async def _after_calls(messages: list[dict], answer: Answer, options: Options) -> list[dict]:
    """The conversation with the assistant's call turn, as it came, and each call's result after the tool's latency."""
    await asyncio.sleep(options.tool_latency_s)
    results = [{"role": "tool", "tool_call_id": call["id"],
                "content": tool_result(call["function"]["name"], call["function"]["arguments"], options.seed,
                                       options.tool_result_tokens)} for call in answer.tool_calls]
    turn = {"role": "assistant", "content": answer.content or None, "tool_calls": answer.tool_calls}
    return [*messages, turn, *results]


def account_new_tokens(records: list[StepRecord], completion_reused: bool = True) -> None:
    """Each step's new tokens: its prompt minus the previous step's prompt and completion (all of the first step's
    prompt is new); with `completion_reused` False (a replay, whose completions are not the echoed turns) its prompt
    minus the previous prompt. None where the server gave no counts."""
    previous = None
    for record in records:
        if record.prompt_tokens is not None:
            if previous is None:
                record.new_tokens = record.prompt_tokens
            elif previous.prompt_tokens is not None and not completion_reused:
                record.new_tokens = record.prompt_tokens - previous.prompt_tokens
            elif previous.prompt_tokens is not None and previous.completion_tokens is not None:
                record.new_tokens = record.prompt_tokens - previous.prompt_tokens - previous.completion_tokens
        previous = record


async def with_client(url: str, model: str | None, api_key: str,
                      body: Callable[[object, str], Awaitable[list[list[StepRecord]]]]
                      ) -> tuple[str, list[StepRecord], float]:
    """`body(client, model name)` against the server at `url`, timed: (the model name sent, every step's record,
    the job's wall time in seconds, from the first request to the last answer)."""
    import openai

    from kvreuse.bench import replay

    root = url.strip().rstrip("/").removesuffix("/v1")
    async with replay.http_client(None, api_key) as http:
        model = await replay.resolve_model(http, root, model)
        client = openai.AsyncOpenAI(base_url=f"{root}/v1", api_key=api_key, http_client=http, max_retries=0)
        start = time.perf_counter()
        per_session = await body(client, model)
        wall = time.perf_counter() - start
    return model, [r for records in per_session for r in records], wall


async def run_loop(url: str, options: Options, model: str | None, api_key: str,
                   transcript: Transcript | None = None) -> tuple[str, list[StepRecord], float]:
    """All sessions side by side against the server at `url`: (the model name sent, every step's record, the job's
    wall time in seconds, from the first request to the last answer); each answered step is added to `transcript`
    when one is given."""
    async def sessions(client, name: str) -> list[list[StepRecord]]:
        return await asyncio.gather(*(run_session(client, name, s, options, transcript)
                                      for s in make_sessions(options.sessions, options.seed)))

    return await with_client(url, model, api_key, sessions)

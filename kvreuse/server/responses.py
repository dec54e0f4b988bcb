"""Running a Sequence and answering with its completion: whole (JSON) or streamed (server-sent events).

A client that goes away aborts its request, streaming or not, so its blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvreuse.engine.output import RequestOutput
from kvreuse.engine.sequence import Sequence
from kvreuse.server.async_engine import Delta, EngineDeadError
from kvreuse.server.errors import APIError
from kvreuse.server.protocol import SamplingFields, error_body, make_id, now
from kvreuse.server.state import ServerState
from kvreuse.server.usage import usage

DISCONNECT_POLL_S = 0.25


async def respond(state: ServerState, seq: Sequence, body: SamplingFields, request: Request, chat: bool,
                  truncated_turns: int = 0):
    """Admit `seq` and answer with its completion: a StreamingResponse if `body.stream`, else the JSON dict.
    `chat` picks the chat.completion shape over text_completion."""
    deltas = admit(state, seq)
    response_id = make_id("chatcmpl" if chat else "cmpl")
    extra = {"truncated_turns": truncated_turns} if truncated_turns else {}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream(state, seq, deltas, response_id, chat, include_usage, extra),
                                 media_type="text/event-stream")
    text, output = await collect(state, seq, deltas, request)
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": output.finish_reason}
              if chat else {"index": 0, "text": text, "finish_reason": output.finish_reason, "logprobs": None})
    return {"id": response_id, "object": "chat.completion" if chat else "text_completion", "created": now(),
            "model": state.model_name, "choices": [choice], "usage": usage(output), **extra}


def admit(state: ServerState, seq: Sequence) -> asyncio.Queue:
    """Hand `seq` to the engine thread; 429 beyond `server.max_queue` in flight, 503 if the engine died."""
    async_engine = state.async_engine
    limit = state.engine.config.server.max_queue
    if async_engine.num_in_flight >= limit:
        raise APIError(429, f"server busy: {async_engine.num_in_flight} requests in flight "
                            f"(server.max_queue = {limit}); retry later", "rate_limit_error",
                       headers={"Retry-After": "1"})
    try:
        return async_engine.submit(seq)
    except EngineDeadError as exc:
        raise APIError(503, str(exc), "service_unavailable") from exc


async def collect(state: ServerState, seq: Sequence, deltas: asyncio.Queue,
                  request: Request) -> tuple[str, RequestOutput]:
    """The whole text and the final output of a request; aborts it (499) if the client disconnects."""
    parts = []
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_S
    while True:
        try:
            delta: Delta | None = await asyncio.wait_for(deltas.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            delta = Delta("")
        if loop.time() >= next_check:  # on a timer: deltas arrive every step while it generates
            next_check = loop.time() + DISCONNECT_POLL_S
            if await request.is_disconnected():
                state.async_engine.abort(seq.request_id)
                raise APIError(499, "client disconnected")
        if delta is None:
            raise APIError(500, "the engine stopped while serving this request", "server_error")
        parts.append(delta.text)
        if delta.finished:
            return "".join(parts), delta.output


async def stream(state: ServerState, seq: Sequence, deltas: asyncio.Queue, response_id: str, chat: bool,
                 include_usage: bool, extra: dict) -> AsyncIterator[str]:
    """The SSE events of a request, ending with `data: [DONE]`; aborts it if the client goes away."""
    finished = False
    try:
        base = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": now(), "model": state.model_name, **extra}
        first = True
        while True:
            delta = await deltas.get()
            if delta is None:
                yield f"data: {json.dumps(error_body('the engine stopped', 'server_error'))}\n\n"
                return
            if chat and first:
                # With the first token, as vLLM does: clients time TTFT from the first chunk.
                yield _chunk(base, chat, None, None, role=True)
            first = False
            if delta.text:
                yield _chunk(base, chat, delta.text, None)
            if delta.finished:
                finished = True
                yield _chunk(base, chat, None, delta.output.finish_reason)
                if include_usage:
                    yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage(delta.output)})}\n\n"
                yield "data: [DONE]\n\n"
                return
    finally:
        if not finished:  # the client went away mid-stream: free its blocks now
            state.async_engine.abort(seq.request_id)


def _chunk(base: dict, chat: bool, text: str | None, finish_reason: str | None, role: bool = False) -> str:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
    return f"data: {json.dumps({**base, 'choices': [choice]}, ensure_ascii=False)}\n\n"

"""Running a Sequence and answering with its completion: whole (JSON) or streamed (server-sent events).

A client that goes away aborts its request, streaming or not, so its blocks are freed at once. Every admitted
request holds a place in `state.admissions` (its tenant's share of the queue) until its answer is over: finished,
aborted by its client, failed by the engine, or cut at the drain deadline (503, or an error event and [DONE]).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvreuse.engine.output import RequestOutput
from kvreuse.engine.sequence import Sequence
from kvreuse.server.admission import Admission
from kvreuse.server.async_engine import Delta, EngineDeadError
from kvreuse.server.errors import APIError
from kvreuse.server.protocol import SamplingFields, error_body, make_id, now
from kvreuse.server.state import ServerState
from kvreuse.server.usage import usage

DISCONNECT_POLL_S = 0.25
DONE = "data: [DONE]\n\n"


async def respond(state: ServerState, seq: Sequence, body: SamplingFields, request: Request, tenant: str | None,
                  chat: bool, truncated_turns: int = 0):
    """Admit `seq` and answer with its completion: a StreamingResponse if `body.stream`, else the JSON dict.
    `chat` picks the chat.completion shape over text_completion. The request holds a place in the queue (its
    `tenant`'s and the server's) until its answer is over, however that ends."""
    admission = admit(state, seq, tenant)
    response_id = make_id("chatcmpl" if chat else "cmpl")
    extra = {"truncated_turns": truncated_turns} if truncated_turns else {}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return AdmittedStream(state, admission,
                              stream(state, seq, admission.deltas, response_id, chat, include_usage, extra))
    text, output = await collect_admitted(state, admission, seq, request)
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": output.finish_reason}
              if chat else {"index": 0, "text": text, "finish_reason": output.finish_reason, "logprobs": None})
    return {"id": response_id, "object": "chat.completion" if chat else "text_completion", "created": now(),
            "model": state.model_name, "choices": [choice], "usage": usage(output), **extra}


def admit(state: ServerState, seq: Sequence, tenant: str | None = None) -> Admission:
    """Hand `seq` to the engine thread as `tenant`'s (None without API keys). 429 beyond
    `server.max_queue_per_tenant` requests of the tenant or `server.max_queue` in all; 503 if the engine died
    or the drain deadline passed."""
    check_queue(state, tenant)
    try:
        deltas = state.async_engine.submit(seq)
    except EngineDeadError as exc:
        raise APIError(503, str(exc), "service_unavailable") from exc
    return state.admissions.add(seq.request_id, tenant, deltas)


def check_queue(state: ServerState, tenant: str | None) -> None:
    """Raise the APIError that refuses one more request of `tenant` now, if any."""
    if state.admissions.closed:
        raise shutting_down(state)
    config = state.engine.config.server
    held = state.admissions.in_flight(tenant)
    # Without API keys every request belongs to no tenant, and only server.max_queue applies.
    if tenant is not None and held >= config.max_queue_per_tenant:
        raise busy(f"tenant {tenant!r} has {held} requests in flight "
                   f"(server.max_queue_per_tenant = {config.max_queue_per_tenant})")
    in_flight = state.async_engine.num_in_flight
    if in_flight >= config.max_queue:
        raise busy(f"server busy: {in_flight} requests in flight (server.max_queue = {config.max_queue})")


def busy(reason: str) -> APIError:
    return APIError(429, f"{reason}; retry later", "rate_limit_error", headers={"Retry-After": "1"})


def shutting_down(state: ServerState) -> APIError:
    timeout = state.engine.config.server.drain_timeout_s
    return APIError(503, f"the server is shutting down: server.drain_timeout_s ({timeout} s) passed before this "
                         f"request finished", "service_unavailable")


async def collect_admitted(state: ServerState, admission: Admission, seq: Sequence,
                           request: Request) -> tuple[str, RequestOutput]:
    """`collect`, giving the admission back however it ends; a request cut at the drain deadline gets 503."""
    try:
        return await collect(state, seq, admission.deltas, request)
    except Exception:
        if not admission.cut:
            raise
        raise shutting_down(state) from None
    finally:
        state.admissions.release(admission)


class AdmittedStream(StreamingResponse):
    """The SSE answer of an admitted request. It gives the admission back however the response ends, even when
    the client left before the first event (an ASGI 2.4 server's `send` then raises at the response start, the
    body never starts, and neither does `stream`, which would abort the request: this does); a request cut at
    the drain deadline ends with an error event and [DONE]."""

    def __init__(self, state: ServerState, admission: Admission, events: AsyncIterator[str]):
        super().__init__(self._relay(events), media_type="text/event-stream")
        self.state, self.admission = state, admission
        self.relayed_all = False

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.state.admissions.release(self.admission)
            if not self.relayed_all:  # for a request that already ended, an abort would do nothing
                self.state.async_engine.abort(self.admission.request_id)

    async def _relay(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        last = None
        async for event in events:
            if self.admission.cut:
                break
            yield event
            last = event
        else:
            if not self.admission.cut or last == DONE:
                self.relayed_all = True
                return
        await events.aclose()  # what it would still say is about the cut: "the engine stopped"
        yield f"data: {json.dumps(error_body(str(shutting_down(self.state)), 'service_unavailable'))}\n\n"
        yield DONE


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
        if delta.error is not None:  # a step computing it failed; the engine serves on
            raise APIError(500, delta.error, "server_error")
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
            if delta is None or delta.error is not None:  # the engine died, or a step computing it failed
                message = "the engine stopped" if delta is None else delta.error
                yield f"data: {json.dumps(error_body(message, 'server_error'))}\n\n"
                yield "data: [DONE]\n\n"
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

"""Answering with a request's completions, rendered in its endpoint's shape: whole (JSON) or streamed (server-sent
events).

A client that goes away aborts its request, streaming or not, so its blocks are freed at once. Every admitted
request holds a place in `state.admissions` (admission.py: its tenant's share of the queue) until its answer is
over: finished, aborted by its client, failed by the engine, or cut at the drain deadline (503, or an error event
and [DONE]).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvreuse.engine.output import RequestOutput
from kvreuse.engine.sequence import Sequence
from kvreuse.server.admission import Admission, Reservation, admit_all, shutting_down
from kvreuse.server.choices import (
    TextOffsets,
    chat_choice,
    chat_chunk_choice,
    chat_logprobs,
    chat_message_choice,
    completion_choice,
    completion_logprobs,
    merge_logprobs,
)
from kvreuse.server.deltas import Cut, Delta, EngineDied, is_last
from kvreuse.server.errors import APIError
from kvreuse.server.protocol import SamplingFields, error_body, make_id, now
from kvreuse.server.state import ServerState
from kvreuse.server.tool_answers import ToolAnswers
from kvreuse.server.usage import usage
from kvreuse.weights.tokenizer import Tokenizer

DISCONNECT_POLL_S = 0.25
DONE = "data: [DONE]\n\n"


@dataclass
class Prompt:
    """One prompt of a request, prepared: its sequence, the prompt text an `echo` returns, and for a chat with tools
    how its answers' calls are parsed."""
    seq: Sequence
    echo_text: str | None = None
    tools: ToolAnswers | None = None


async def respond(state: ServerState, prompts: list[Prompt], body: SamplingFields, request: Request,
                  tenant: str | None, chat: bool, truncated_turns: int = 0, reservation: Reservation | None = None):
    """Admit every prompt's sequence and answer with their completions: a StreamingResponse if `body.stream`, else the
    JSON dict. `chat` picks the chat.completion shape over text_completion. Prompt j's choice i is choice j * n + i.
    Each sequence holds its places in the queue (its `tenant`'s and the server's: those of the request's
    `reservation`, if it was reserved before it was prepared) until its answer is over, however that ends."""
    admissions = admit_all(state, [p.seq for p in prompts], tenant, reservation)
    response_id = make_id("chatcmpl" if chat else "cmpl")
    extra = {"truncated_turns": truncated_turns} if truncated_turns else {}
    render = Render(state.engine.front_end.tokenizer, body, chat, prompts[0].tools)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return AdmittedStream(state, admissions,
                              stream(state, prompts, admissions, response_id, render, include_usage, extra))
    try:
        outputs = await asyncio.gather(*(collect_admitted(state, a, request) for a in admissions))
    except BaseException:
        state.admissions.release_all(admissions, state.engine.abort)  # one failed: the others stop too
        raise
    # Off the loop: with echo and logprobs an answer can be megabytes of JSON, seconds to build and encode.
    head = {"id": response_id, "object": "chat.completion" if chat else "text_completion", "created": now(),
            "model": state.model_name}
    return await asyncio.to_thread(whole_response, render, prompts, [output for _, output in outputs], body.n, head,
                                   extra)


def whole_response(render: Render, prompts: list[Prompt], outputs: list[RequestOutput], n: int, head: dict,
                   extra: dict) -> Response:
    """The non-streamed answer, encoded: `head` (id, object, created, model), its choices, usage, then `extra`.
    Each choice is encoded on its own: json.dumps holds the GIL for as long as one call runs, so one call for an
    answer of megabytes would stall the event loop as surely as running on it."""
    choices = [encode_json(render.whole_choice(j * n + out.index, prompt, out))
               for j, (prompt, output) in enumerate(zip(prompts, outputs, strict=True))
               for out in output.all_choices]
    tail = {"usage": usage(RequestOutput.of_requests(outputs)), **extra}
    body = b"".join((encode_json(head)[:-1], b',"choices":[', b",".join(choices), b"],", encode_json(tail)[1:]))
    return Response(body, media_type="application/json")


def encode_json(value: dict) -> bytes:
    """`value` as FastAPI's JSONResponse renders it: compact UTF-8 JSON, NaN refused."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


class Render:
    """A request's choices in its endpoint's shape, with logprobs when asked for and the echoed prompt."""

    def __init__(self, tokenizer: Tokenizer, body: SamplingFields, chat: bool, tools: ToolAnswers | None = None):
        self.tokenizer, self.chat, self.tools = tokenizer, chat, tools
        self.logprobs = body.num_logprobs is not None
        self.offsets: dict[int, TextOffsets] = {}  # completions' text_offset, per choice

    def whole_choice(self, index: int, prompt: Prompt, out: RequestOutput) -> dict:
        if self.chat:
            logprobs = chat_logprobs(self.tokenizer, out.logprobs) if self.logprobs else None
            if self.tools is not None:
                message, finish_reason = self.tools.message(out)
                return chat_message_choice(index, message, finish_reason, logprobs)
            return chat_choice(index, out.text, out.finish_reason, logprobs)
        echo = self.echo(index, prompt, out.prompt_logprobs)
        text = (echo[0] if echo else "") + out.text
        logprobs = None
        if self.logprobs:
            completion = completion_logprobs(self.tokenizer, out.logprobs, self.offsets[index])
            logprobs = merge_logprobs([echo[1], completion]) if echo else completion
        return completion_choice(index, text, out.finish_reason, logprobs)

    def echo(self, index: int, prompt: Prompt, prompt_logprobs: list | None) -> tuple[str, dict | None] | None:
        """Choice `index`'s echoed prompt: its text and (with logprobs) its tokens' logprobs; None without echo."""
        offsets = self.offsets.setdefault(index, TextOffsets())
        if prompt.echo_text is None:
            return None
        if not self.logprobs:
            return prompt.echo_text, None
        return prompt.echo_text, completion_logprobs(self.tokenizer, prompt_logprobs, offsets,
                                                     prompt.seq.prompt_token_ids[0])

    def first_chunk(self, index: int, prompt: Prompt, prompt_logprobs: list | None) -> dict | None:
        """What a choice's stream starts with: the assistant's role (chat), or the echoed prompt."""
        if self.chat:
            return chat_chunk_choice(index, {"role": "assistant", "content": ""}, None, None)
        echo = self.echo(index, prompt, prompt_logprobs)
        return completion_choice(index, echo[0], None, echo[1]) if echo else None

    def chunks(self, index: int, delta: Delta, out: RequestOutput | None) -> list[dict]:
        """The chunks of choice `index` for `delta`; `out` is the choice's output once its request has ended."""
        text, logprobs = delta.text, delta.logprobs
        if self.chat:
            rendered = chat_logprobs(self.tokenizer, logprobs) if self.logprobs and logprobs is not None else None
            if self.tools is not None:
                return self._tool_chunks(index, delta, out, rendered)
            return [chat_chunk_choice(index, {"content": text} if text else {}, delta.finish_reason, rendered)]
        offsets = self.offsets.setdefault(index, TextOffsets())
        rendered = completion_logprobs(self.tokenizer, logprobs or [], offsets) if self.logprobs else None
        return [completion_choice(index, text, delta.finish_reason, rendered)]

    def ends(self, delta: Delta, out: RequestOutput | None) -> bool:
        """Whether `delta`'s chunks end its choice. A choice with tools ends once its output is known (its calls
        are recorded with their tokens)."""
        return delta.finish_reason is not None and (self.tools is None or out is not None)

    def _tool_chunks(self, index: int, delta: Delta, out: RequestOutput | None, logprobs: dict | None) -> list[dict]:
        stream = self.tools.stream(index)
        deltas = stream.deltas(delta.text)
        finish_reason = None
        if self.ends(delta, out):
            held, finish_reason = self.tools.finish_stream(index, out)
            deltas += held
        if logprobs is not None and not deltas:
            deltas.append({})
        chunks = [chat_chunk_choice(index, d, None, logprobs if i == 0 else None) for i, d in enumerate(deltas)]
        if finish_reason is not None:
            chunks.append(chat_chunk_choice(index, {}, finish_reason, None))
        return chunks


async def collect_admitted(state: ServerState, admission: Admission, request: Request) -> tuple[str, RequestOutput]:
    """`collect`, giving the admission back however it ends; a request cut at the drain deadline gets 503."""
    try:
        return await collect(state, admission.request_id, admission.deltas, request)
    except Exception:
        if not admission.cut:
            raise
        raise shutting_down(state) from None
    finally:
        state.admissions.release(admission)


class AdmittedStream(StreamingResponse):
    """The SSE answer of admitted requests (the prompts of one request). It gives the admissions back however the
    response ends, even when the client left before the first event (an ASGI 2.4 server's `send` then raises at the
    response start, the body never starts, and neither does `stream`, which would abort the requests: this does); a
    request cut at the drain deadline ends with an error event and [DONE]."""

    def __init__(self, state: ServerState, admissions: list[Admission], events: AsyncIterator[str]):
        super().__init__(self._relay(events), media_type="text/event-stream")
        self.state, self.admissions = state, admissions
        self.relayed_all = False

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:  # for requests that already ended, an abort would do nothing
            self.state.admissions.release_all(self.admissions, None if self.relayed_all else self.state.engine.abort)

    @property
    def cut(self) -> bool:
        return any(a.cut for a in self.admissions)

    async def _relay(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        last = None
        async for event in events:
            if self.cut:
                break
            yield event
            last = event
        else:
            if not self.cut or last == DONE:
                self.relayed_all = True
                return
        await events.aclose()  # what it would still say is about the cut: "the engine stopped"
        yield f"data: {json.dumps(error_body(str(shutting_down(self.state)), 'service_unavailable'))}\n\n"
        yield DONE


async def collect(state: ServerState, request_id: str, deltas: asyncio.Queue,
                  request: Request) -> tuple[str, RequestOutput]:
    """The whole text (of choice 0) and the final output of a request; aborts it (499) if the client disconnects."""
    parts = []
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_S
    while True:
        try:
            delta: Delta | EngineDied | Cut = await asyncio.wait_for(deltas.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            delta = Delta("")
        if loop.time() >= next_check:  # on a timer: deltas arrive every step while it generates
            next_check = loop.time() + DISCONNECT_POLL_S
            if await request.is_disconnected():
                state.engine.abort(request_id)
                raise APIError(499, "client disconnected")
        if isinstance(delta, Cut):
            raise shutting_down(state)
        if isinstance(delta, EngineDied):
            raise APIError(500, "the engine stopped while serving this request", "server_error")
        if delta.error is not None:  # a step computing it failed; the engine serves on
            raise APIError(500, delta.error, "server_error")
        if delta.index == 0:
            parts.append(delta.text)
        if delta.finished:
            return "".join(parts), delta.output


async def stream(state: ServerState, prompts: list[Prompt], admissions: list[Admission], response_id: str,
                 render: Render, include_usage: bool, extra: dict) -> AsyncIterator[str]:
    """The SSE events of a request's prompts (their deltas interleaved as they come), ending with `data: [DONE]`;
    aborts them if the client goes away."""
    n = max(1, prompts[0].seq.params.n)
    base = {"id": response_id, "object": "chat.completion.chunk" if render.chat else "text_completion",
            "created": now(), "model": state.model_name, **extra}
    started: set[int] = set()   # choices whose first chunk went out
    finished: set[int] = set()  # choices whose finish reason went out
    prompt_logprobs: dict[int, list] = {}
    outputs: dict[int, RequestOutput] = {}
    try:
        async for j, delta in _merged([a.deltas for a in admissions]):
            if not isinstance(delta, Delta) or delta.error is not None:  # the engine died, or a step computing it did
                message = delta.error if isinstance(delta, Delta) else "the engine stopped"
                yield f"data: {json.dumps(error_body(message, 'server_error'))}\n\n"
                yield DONE
                return
            if delta.finished:
                outputs[j] = delta.output
            if delta.prompt_logprobs is not None or (delta.finished and delta.output.prompt_logprobs is not None):
                prompt_logprobs.setdefault(j, delta.prompt_logprobs or delta.output.prompt_logprobs)
            # Each choice starts with its first token (as vLLM does: clients time TTFT from the first chunk).
            indexes = [o.index for o in delta.output.all_choices] if delta.finished else [delta.index]
            for i in (j * n + i for i in indexes if j * n + i not in started):
                started.add(i)
                first = render.first_chunk(i, prompts[j], prompt_logprobs.get(j))
                if first is not None:
                    yield _event(base, first)
            if delta.text or delta.logprobs or delta.finish_reason:
                out = _choice_output(delta, delta.index)
                for choice in render.chunks(j * n + delta.index, delta, out):
                    yield _event(base, choice)
                if render.ends(delta, out):
                    finished.add(j * n + delta.index)
            for out in delta.output.all_choices if delta.finished else ():  # choices ended without a token of their
                if j * n + out.index not in finished:                      # own (a scored prompt, an abort)
                    for choice in render.chunks(j * n + out.index, Delta("", finish_reason=out.finish_reason), out):
                        yield _event(base, choice)
        if include_usage:
            total = usage(RequestOutput.of_requests([outputs[j] for j in range(len(prompts))]))
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': total})}\n\n"
        yield DONE
    finally:  # the client went away mid-stream, or one request failed: free the others' blocks now
        state.admissions.release_all([a for j, a in enumerate(admissions) if j not in outputs], state.engine.abort)


async def _merged(queues: list[asyncio.Queue]) -> AsyncIterator[tuple[int, Delta | EngineDied | Cut]]:
    """The deltas of several requests as they come, each with its request's position, until every one has ended.
    One request's (every chat's) are read from its own queue: a relay would cost each token a task wake-up more."""
    if len(queues) == 1:
        while not is_last(delta := await queues[0].get()):
            yield 0, delta
        yield 0, delta
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(j: int, deltas: asyncio.Queue) -> None:
        while True:
            delta = await deltas.get()
            merged.put_nowait((j, delta))
            if is_last(delta):
                return

    relays = [asyncio.create_task(forward(j, q)) for j, q in enumerate(queues)]
    try:
        for _ in range(len(queues)):
            while True:
                j, delta = await merged.get()
                yield j, delta
                if is_last(delta):
                    break
    finally:
        for relay in relays:
            relay.cancel()


def _choice_output(delta: Delta, index: int) -> RequestOutput | None:
    """Choice `index`'s output, once its request has ended."""
    if not delta.finished:
        return None
    return next((out for out in delta.output.all_choices if out.index == index), None)


def _event(base: dict, choice: dict) -> str:
    return f"data: {json.dumps({**base, 'choices': [choice]}, ensure_ascii=False)}\n\n"

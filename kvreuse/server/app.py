"""The OpenAI-compatible HTTP API over the AsyncEngine.

Every error is OpenAI's JSON (`{"error": {"message", "type", "param", "code"}}`) and leaves the engine
serving. Requests pass, in order: draining check (503), API key (401), body validation (400), model
name (404), queue bound (429), then the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvreuse.engine.engine import LLMEngine, RequestError
from kvreuse.engine.output import RequestOutput
from kvreuse.engine.sequence import Sequence
from kvreuse.engine.stats import peak_rss_bytes
from kvreuse.sampling_params import SamplingParams
from kvreuse.server.async_engine import AsyncEngine, Delta, EngineDeadError
from kvreuse.server.metrics import Metrics
from kvreuse.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    error_body,
    make_id,
    now,
)
from kvreuse.server.truncation import fit_conversation

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25
AUTHENTICATED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type_, param, code, headers


@dataclass
class ServerState:
    engine: LLMEngine
    async_engine: AsyncEngine
    metrics: Metrics
    model_name: str
    api_keys: dict[str, str] | None  # key -> tenant; None: no authentication
    draining: bool = False
    ready: bool = False
    created: int = field(default_factory=now)


def tenant_for(api_keys: dict[str, str], header: str | None) -> str | None:
    """The tenant of a `Bearer KEY` header, compared in constant time against every key."""
    token = header[7:].strip() if header and header.lower().startswith("bearer ") else ""
    found = None
    for key, tenant in api_keys.items():
        if hmac.compare_digest(token.encode(), key.encode()):
            found = tenant
    return found


class Gate:
    """Draining (503) and API keys (401) in front of every route. Plain ASGI rather than
    `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hides client disconnects from the
    endpoint, and a disconnected client must abort its request."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        scope.setdefault("state", {})["tenant"] = None
        if self.state.draining and path != "/metrics":
            response = JSONResponse(error_body("the server is shutting down", "service_unavailable"), 503,
                                    headers={"Connection": "close"})
            return await response(scope, receive, send)
        if self.state.api_keys is not None and path.startswith(AUTHENTICATED_PREFIXES):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            tenant = tenant_for(self.state.api_keys, header)
            if tenant is None:
                response = JSONResponse(error_body("invalid or missing API key (Authorization: Bearer KEY)",
                                                   "authentication_error", code="invalid_api_key"), 401)
                return await response(scope, receive, send)
            scope["state"]["tenant"] = tenant
        return await self.app(scope, receive, send)


def create_app(engine: LLMEngine, model_name: str, api_keys: dict[str, str] | None = None) -> FastAPI:
    metrics = Metrics(model_name)
    async_engine = AsyncEngine(engine, on_step=metrics.observe_step, on_finish=metrics.observe_finished)
    state = ServerState(engine, async_engine, metrics, model_name, api_keys)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        state.ready = True
        yield
        state.ready = False
        await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="kvreuse", lifespan=lifespan)
    app.state.kvreuse = state

    # --- errors --------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return JSONResponse(error_body(str(exc), exc.type, exc.param, exc.code), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            message, param = f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}", None
        else:
            param = ".".join(loc) or None
            message = f"{param}: {first['msg']}" if param else first["msg"].removeprefix("Value error, ")
        return JSONResponse(error_body(message.replace("Value error, ", ""), param=param), 400)

    app.add_middleware(Gate, state=state)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error" if exc.status_code < 500
                                       else "server_error"), exc.status_code, headers=exc.headers)

    # --- plain endpoints -----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not state.ready or not async_engine.is_alive:
            reason = "engine loop died" if state.ready else "not ready"
            return JSONResponse({"status": reason}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        metrics.peak_rss.labels(model_name).set(peak_rss_bytes())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": state.created, "owned_by": "kvreuse",
            "max_model_len": engine.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        text = body.prompt if body.prompt is not None else render_chat(message_dicts(body.messages))
        tokens = engine.tokenize_prompt(text)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = engine.model_args.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise APIError(400, f"tokens must be integers in [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    # --- generation ----------------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {model_name!r}",
                           "NotFoundError", "model", "model_not_found")

    def message_dicts(messages) -> list[dict]:
        try:
            return [{"role": m.role, "content": m.text()} for m in messages]
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc

    def render_chat(messages: list[dict]) -> str:
        try:
            return engine.render_chat(messages)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc

    def make_sequence(prompt: str | list[int], body: SamplingFields, tenant: str | None) -> Sequence:
        # A tenant's salt can only be narrowed by the request's own field, never replaced.
        salt = body.cache_salt if tenant is None else f"{tenant}\x00{body.cache_salt or ''}"
        try:
            token_ids = engine.tokenize_prompt(prompt)
            max_tokens = body.max_tokens
            if max_tokens is None:
                room = engine.max_model_len - len(token_ids)
                max_tokens = max(1, min(engine.config.server.default_max_tokens, room))
            params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature,
                                    top_k=max(0, body.top_k), top_p=body.top_p, seed=body.seed,
                                    stop=body.stop_list, ignore_eos=body.ignore_eos)
            return engine.make_sequence(token_ids, params, make_id("req"), cache_salt=salt, use_cache=body.use_cache)
        except RequestError as exc:
            raise APIError(400, str(exc), param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                           code="context_length_exceeded" if "exceeds" in str(exc) else None) from exc
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    def admit(seq: Sequence) -> asyncio.Queue:
        limit = engine.config.server.max_queue
        if async_engine.num_in_flight >= limit:
            raise APIError(429, f"server busy: {async_engine.num_in_flight} requests in flight "
                                f"(server.max_queue = {limit}); retry later", "rate_limit_error",
                           headers={"Retry-After": "1"})
        try:
            return async_engine.submit(seq)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "service_unavailable") from exc

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        seq = make_sequence(body.prompt, body, request.state.tenant)
        return await respond(seq, body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        messages = message_dicts(body.messages)
        dropped = 0
        if engine.config.server.truncate == "oldest":
            messages, dropped = fit_conversation(engine, messages, body.max_tokens)
        seq = make_sequence(render_chat(messages), body, request.state.tenant)
        return await respond(seq, body, request, chat=True, truncated_turns=dropped)

    async def respond(seq: Sequence, body: SamplingFields, request: Request, chat: bool, truncated_turns: int = 0):
        deltas = admit(seq)
        response_id = make_id("chatcmpl" if chat else "cmpl")
        extra = {"truncated_turns": truncated_turns} if truncated_turns else {}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(seq, deltas, response_id, chat, include_usage, extra),
                                     media_type="text/event-stream")
        text, output = await collect(seq, deltas, request)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": output.finish_reason}
                  if chat else {"index": 0, "text": text, "finish_reason": output.finish_reason, "logprobs": None})
        return {"id": response_id, "object": "chat.completion" if chat else "text_completion", "created": now(),
                "model": model_name, "choices": [choice], "usage": usage(output), **extra}

    async def collect(seq: Sequence, deltas: asyncio.Queue, request: Request) -> tuple[str, RequestOutput]:
        parts = []
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_S
        while True:
            try:
                delta: Delta | None = await asyncio.wait_for(deltas.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                delta = Delta("", 0)
            if loop.time() >= next_check:  # on a timer: deltas arrive every step while it generates
                next_check = loop.time() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    async_engine.abort(seq.request_id)
                    raise APIError(499, "client disconnected")
            if delta is None:
                raise APIError(500, "the engine stopped while serving this request", "server_error")
            parts.append(delta.text)
            if delta.finished:
                return "".join(parts), delta.output

    async def stream(seq: Sequence, deltas: asyncio.Queue, response_id: str, chat: bool, include_usage: bool,
                     extra: dict) -> AsyncIterator[str]:
        finished = False
        try:
            base = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": now(), "model": model_name, **extra}

            def chunk(text: str | None, finish_reason: str | None, role: bool = False) -> str:
                if chat:
                    delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
                else:
                    choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
                return f"data: {json.dumps({**base, 'choices': [choice]}, ensure_ascii=False)}\n\n"

            first = True
            while True:
                delta = await deltas.get()
                if delta is None:
                    yield f"data: {json.dumps(error_body('the engine stopped', 'server_error'))}\n\n"
                    return
                if chat and first:
                    # With the first token, as vLLM does: clients time TTFT from the first chunk.
                    yield chunk(None, None, role=True)
                first = False
                if delta.text:
                    yield chunk(delta.text, None)
                if delta.finished:
                    finished = True
                    yield chunk(None, delta.output.finish_reason)
                    if include_usage:
                        yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage(delta.output)})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not finished:  # the client went away mid-stream: free its blocks now
                async_engine.abort(seq.request_id)

    return app


def usage(out: RequestOutput) -> dict:
    u = out.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "reused_tokens": u.reused_tokens,
                                      "recomputed_tokens": u.recomputed_tokens,
                                      "discarded_tokens": u.discarded_tokens},
            "computed_prompt_tokens": u.computed_prompt_tokens}

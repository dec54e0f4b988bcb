"""The OpenAI-compatible HTTP API over the AsyncEngine, assembled from its routers.

Every error is OpenAI's JSON (errors.py) and leaves the engine serving. A request passes, in order:

1. draining (`DrainingGate`): 503 with `Connection: close` once SIGTERM arrived, on every route but /metrics;
2. API key (`auth.authenticate`, a dependency of the OpenAI and tokenize routers): 401;
3. body validation (the pydantic models of protocol.py): 400 naming the field;
4. model name (`prompts.check_model`): 404;
5. queue bound (`responses.admit`): 429 with Retry-After beyond `server.max_queue` requests in flight;
6. the engine, on its own thread (async_engine.py).

FastAPI parses the JSON body before it runs any dependency, so a malformed body gets its 400 before the
API key is checked.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from kvreuse.engine.engine import LLMEngine
from kvreuse.server import routes_admin, routes_openai, routes_tokenize
from kvreuse.server.async_engine import AsyncEngine
from kvreuse.server.errors import add_error_handlers
from kvreuse.server.metrics import Metrics
from kvreuse.server.protocol import error_body
from kvreuse.server.state import ServerState


def create_app(engine: LLMEngine, model_name: str, api_keys: dict[str, str] | None = None) -> FastAPI:
    """The ASGI app serving `engine` as `model_name`. With `api_keys` (key -> tenant), the OpenAI and
    tokenize routes need `Authorization: Bearer KEY`. The engine thread starts and stops with the app."""
    metrics = Metrics(model_name)
    async_engine = AsyncEngine(engine, on_step=metrics.observe_step, on_finish=metrics.observe_finished)
    app = FastAPI(title="kvreuse", lifespan=_run_engine_thread)
    app.state.kvreuse = ServerState(engine, async_engine, metrics, model_name, api_keys)
    add_error_handlers(app)
    app.add_middleware(DrainingGate)
    for router in (routes_admin.router, routes_openai.router, routes_tokenize.router):
        app.include_router(router)
    return app


@asynccontextmanager
async def _run_engine_thread(app: FastAPI):
    state: ServerState = app.state.kvreuse
    state.async_engine.start()
    state.ready = True
    yield
    state.ready = False
    await asyncio.to_thread(state.async_engine.shutdown)


class DrainingGate:
    """503 for every request but /metrics while the server drains. Plain ASGI rather than
    `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hides client disconnects from the
    endpoint, and a disconnected client must abort its request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/metrics" and scope["app"].state.kvreuse.draining:
            response = JSONResponse(error_body("the server is shutting down", "service_unavailable"), 503,
                                    headers={"Connection": "close"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)

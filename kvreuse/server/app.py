"""The OpenAI-compatible HTTP API over the AsyncEngine, assembled from its routers.

Every error is OpenAI's JSON (errors.py) and leaves the engine serving. A request passes, in order:

1. draining (`gates.DrainingGate`): 503 with `Connection: close` once SIGTERM arrived, on every route but /metrics;
2. API key (`gates.AuthGate`): with API keys, 401 on every route but /health, before the body is read; the
   `auth.authenticate` dependency of the routes checks again and gives them the tenant;
3. body size (`gates.BodyLimitGate`): 413 beyond `server.max_body_mb`, before the body is read whole;
4. body validation (the pydantic models of protocol.py): 400 naming the field;
5. model name (`prompts.check_model`): 404;
6. queue bounds (`responses.admit`): 429 with Retry-After beyond `server.max_queue_per_tenant` requests of the
   caller's tenant (with API keys) or `server.max_queue` in all;
7. the engine, on its own thread (async_engine.py).

Past `server.drain_timeout_s` after SIGTERM, requests still running are cut (lifecycle.py): 503, or in a stream
an error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvreuse.engine.engine import LLMEngine
from kvreuse.server import routes_admin, routes_cache, routes_models, routes_openai, routes_tokenize
from kvreuse.server.async_engine import AsyncEngine
from kvreuse.server.errors import add_error_handlers
from kvreuse.server.gates import AuthGate, BodyLimitGate, DrainingGate
from kvreuse.server.metrics import Metrics
from kvreuse.server.state import ServerState


def create_app(engine: LLMEngine, model_name: str, api_keys: dict[str, str] | None = None,
               runner: Callable[[Metrics], AsyncEngine] | None = None) -> FastAPI:
    """The ASGI app serving `engine` as `model_name`. With `api_keys` (key -> tenant), every route but /health
    needs `Authorization: Bearer KEY`. The engine thread starts and stops with the app.

    `runner(metrics)` replaces the engine thread with what runs the requests elsewhere (the cluster's replicas:
    `engine` is then a FrontEnd, without the model); it must offer AsyncEngine's start, submit, abort, call,
    num_in_flight, is_alive and shutdown."""
    metrics = Metrics(model_name)
    async_engine = (runner(metrics) if runner is not None else
                    AsyncEngine(engine, on_step=metrics.observe_step, on_finish=metrics.observe_finished))
    app = FastAPI(title="kvreuse", lifespan=_run_engine_thread)
    app.state.kvreuse = ServerState(engine, async_engine, metrics, model_name, api_keys)
    add_error_handlers(app)
    # Starlette runs the middleware added last first: draining, then the key, then the body size.
    app.add_middleware(BodyLimitGate, max_body_mb=engine.config.server.max_body_mb)
    app.add_middleware(AuthGate, api_keys=api_keys)
    app.add_middleware(DrainingGate)
    for router in (routes_admin.router, routes_cache.router, routes_models.router, routes_openai.router,
                   routes_tokenize.router):
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
    await asyncio.to_thread(state.engine.close)  # what is queued for the lower tiers is written before we exit


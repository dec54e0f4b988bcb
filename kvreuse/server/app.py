"""The OpenAI-compatible HTTP API over an EngineClient (engine_client.py), assembled from its routers.

Every error is OpenAI's JSON (errors.py) and leaves the engine serving. A request passes, in order:

1. draining (`gates.DrainingGate`): 503 with `Connection: close` once SIGTERM arrived, on every route but /metrics;
2. API key (`gates.AuthGate`): with API keys, 401 on every route but /health, before the body is read; the
   `auth.authenticate` dependency of the routes checks again and gives them the tenant, and `auth.admin_only`
   answers 403 to a tenant's key on /reset_prefix_cache, /cache/stats and /metrics;
3. body size (`gates.BodyLimitGate`): 413 beyond `server.max_body_mb`, before the body is read whole;
4. body validation (the pydantic models of protocol.py): 400 naming the field;
5. model name (`prompts.check_model`): 404;
6. queue bounds (`admission.reserve`, before the prompts are tokenized): 429 with Retry-After beyond
   `server.max_queue_per_tenant` sequences of the caller's tenant (with API keys) or `server.max_queue` in all;
7. preparation (preparation.py): the tenant's turn of the preparation threads, then tokenizing: 400 for what
   cannot run;
8. the engine, on its own thread (async_engine.py), or a cluster's replicas (cluster/remote_engine.py).

Past `server.drain_timeout_s` after SIGTERM, requests still running are cut (lifecycle.py): 503, or in a stream
an error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvreuse.engine.engine import LLMEngine
from kvreuse.server import routes_admin, routes_cache, routes_models, routes_openai, routes_tokenize
from kvreuse.server.async_engine import AsyncEngine
from kvreuse.server.auth import load_admin_keys
from kvreuse.server.engine_client import EngineClient
from kvreuse.server.errors import add_error_handlers
from kvreuse.server.gates import AuthGate, BodyLimitGate, DrainingGate
from kvreuse.server.metrics import Metrics
from kvreuse.server.state import ServerState
from kvreuse.weights.chat_render import RenderLimits


def create_app(engine: LLMEngine, model_name: str, api_keys: dict[str, str] | None = None) -> FastAPI:
    """The ASGI app serving `engine` as `model_name`, on an engine thread of its own that starts and stops with
    the app. With `api_keys` (key -> tenant), every route but /health needs `Authorization: Bearer KEY`, and the
    admin routes a key of `server.admin_api_keys_file`."""
    metrics = Metrics(model_name)
    client = AsyncEngine(engine, on_step=metrics.observe_step, on_finish=metrics.observe_finished)
    return client_app(client, metrics, model_name, api_keys)


def client_app(client: EngineClient, metrics: Metrics, model_name: str,
               api_keys: dict[str, str] | None = None) -> FastAPI:
    """The ASGI app serving what `client` runs (and reports to `metrics`) as `model_name`; the client starts and
    shuts down with the app. ConfigError for a bad `server.admin_api_keys_file`."""
    config = client.front_end.config.server
    admin_keys = load_admin_keys(config, api_keys)
    if admin_keys is not None:
        api_keys = {**api_keys, **admin_keys}  # an admin key is also a key of its own tenant
    app = FastAPI(title="kvreuse", lifespan=_run_engine)
    app.state.kvreuse = ServerState(client, metrics, model_name, api_keys, admin_keys)
    add_error_handlers(app)
    # Starlette runs the middleware added last first: draining, then the key, then the body size.
    app.add_middleware(BodyLimitGate, max_body_mb=config.max_body_mb)
    app.add_middleware(AuthGate, api_keys=api_keys)
    app.add_middleware(DrainingGate)
    for router in (routes_admin.router, routes_cache.router, routes_models.router, routes_openai.router,
                   routes_tokenize.router):
        app.include_router(router)
    return app


@asynccontextmanager
async def _run_engine(app: FastAPI):
    state: ServerState = app.state.kvreuse
    # Requests' conversations render in a worker process with a deadline and a memory cap (weights/chat_render.py).
    tokenizer, limits = state.engine.front_end.tokenizer, state.engine.front_end.config.server
    renderer = tokenizer.render_in_worker(RenderLimits(limits.chat_template_timeout_s, limits.chat_template_max_mb))
    # The grammar compiler (xgrammar's import, the tokenizer's vocabulary) takes ~0.5 s holding the GIL: built now,
    # not while the first request with a format or tools makes every other request wait on it.
    await asyncio.to_thread(lambda: state.engine.front_end.grammars)
    # The worker's start (~1 s of another process's CPU: python, transformers, the tokenizer), which overlapped the
    # grammars, ends before the ready line, not beside the first request (every server's first 64-token answer took
    # ~1.5x its eager time).
    await asyncio.to_thread(renderer.wait_started)
    state.engine.start()
    state.ready = True
    yield
    state.ready = False
    await asyncio.to_thread(state.engine.shutdown)  # what is queued for the lower tiers is written before we exit
    tokenizer.render_in_process()


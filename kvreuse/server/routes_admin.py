"""`/health` and `/metrics`, for load balancers and Prometheus; both say the decode step's compile state.

/health never needs an API key. /metrics needs an admin key when the server has keys (`auth.admin_only`; without
one, 401 from `gates.AuthGate`, 403 for a tenant's key): its counters move by every tenant's prompt lengths, which
one tenant must not watch.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvreuse.engine.stats import compile_summary
from kvreuse.server.auth import admin_only
from kvreuse.server.state import StateDep

router = APIRouter()


@router.get("/health")
async def health(state: StateDep):
    compile_state = compile_summary(state.engine.compile_states)
    if not state.ready or not state.engine.is_alive:
        reason = "engine loop died" if state.ready else "not ready"
        return JSONResponse({"status": reason, "compile": compile_state}, 503)
    return {"status": "ok", "compile": compile_state}


@router.get("/metrics", dependencies=[Depends(admin_only("shows every tenant's requests and tokens"))])
async def prometheus_metrics(state: StateDep):
    state.metrics.observe_compile(state.engine.compile_states)
    return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

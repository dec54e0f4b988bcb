"""`/health` and `/metrics`, for load balancers and Prometheus.

/health never needs an API key. /metrics needs an admin key when the server has keys (`auth.admin_only`; without
one, 401 from `gates.AuthGate`, 403 for a tenant's key): its counters move by every tenant's prompt lengths, which
one tenant must not watch.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvreuse.server.auth import admin_only
from kvreuse.server.state import StateDep

router = APIRouter()


@router.get("/health")
async def health(state: StateDep):
    if not state.ready or not state.engine.is_alive:
        reason = "engine loop died" if state.ready else "not ready"
        return JSONResponse({"status": reason}, 503)
    return {"status": "ok"}


@router.get("/metrics", dependencies=[Depends(admin_only("shows every tenant's requests and tokens"))])
async def prometheus_metrics(state: StateDep):
    return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

"""`/health` and `/metrics`: for load balancers and Prometheus, so no API key."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvreuse.server.state import StateDep

router = APIRouter()


@router.get("/health")
async def health(state: StateDep):
    if not state.ready or not state.async_engine.is_alive:
        reason = "engine loop died" if state.ready else "not ready"
        return JSONResponse({"status": reason}, 503)
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus_metrics(state: StateDep):
    return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

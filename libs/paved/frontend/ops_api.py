"""Operational routes: liveness, readiness, Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter()


@router.get("/health/live")
async def live() -> dict[str, str]:
    """200 while the process serves HTTP, including while models load."""
    return {"status": "live"}


@router.get("/health/ready")
async def ready(request: Request) -> JSONResponse:
    """200 once every engine is warm; 503 while loading, after an engine died, or draining."""
    models = request.app.state.paved.models
    if models.ready():
        return JSONResponse({"status": "ready", "models": [c.id for c in models.cards()]})
    status = "draining" if models.draining else "not ready"
    return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": "5"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.paved.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

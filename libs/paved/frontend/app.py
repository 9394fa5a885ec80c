"""The FastAPI application: routers, error handlers, middleware, engine lifecycle."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Protocol

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from paved.frontend import openai_api, ops_api, responses_api
from paved.frontend.errors import install_error_handlers
from paved.frontend.metrics import FrontendMetrics
from paved.frontend.middleware import MetricsMiddleware
from paved.frontend.registry import ModelRegistry
from paved.frontend.state import AppState
from paved.frontend.tracing import TracingMiddleware
from paved.http.body_limit import DEFAULT_MAX_BUFFERED_BYTES, BodyLimitMiddleware

logger = logging.getLogger(__name__)


class SideServer(Protocol):
    """A server run on the app's event loop over the same engines (paved.kserve.server's
    KServeServer). Typed by shape: the KServe server depends on this package, not the reverse."""

    async def start(self) -> None: ...

    async def stop(self, grace_s: float = 5.0) -> None: ...


class _KServeHTTP:
    """KServe v2 HTTP (`/v2`, `/v2/...`) on the frontend's own port, answered by the KServe
    server's HTTP app (its `http_app`, set when it starts): one HTTP port serves every model over
    both APIs, as Triton's does, so a replica's public address is also its KServe HTTP address.
    Outermost, ahead of the OpenAI stack: KServe keeps its own error bodies, request metrics
    and limits there, exactly as on its own port."""

    def __init__(self, app: ASGIApp, kserve: SideServer):
        self.app = app
        self.kserve = kserve

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"] == "/v2" or scope["path"].startswith("/v2/")):
            kserve_app = getattr(self.kserve, "http_app", None)
            if kserve_app is not None:
                await kserve_app(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Big enough for a paved choice catalogue of ~100k titles (a few MB of JSON), small enough
# that a stray upload cannot exhaust memory.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


def create_app(
    models: ModelRegistry,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_buffered_body_bytes: int | None = None,
    on_start_failure: Callable[[BaseException], None] | None = None,
    on_started: Callable[[], None] | None = None,
    kserve: SideServer | None = None,
    on_kserve_started: Callable[[SideServer], None] | None = None,
    kserve_grace_s: float = 5.0,
) -> FastAPI:
    """The app over `models`. Engines start in the background once the server runs, so
    /health/live answers during the (long) boot and /health/ready turns 200 when all are warm.
    If an engine cannot start, `on_start_failure` is told (the server main exits non-zero);
    once all have started, `on_started` (the server main then listens on a handed-off port).

    `kserve`, a not yet started KServe v2 server over the same engines, runs on the same event
    loop: its listeners bind before the engines boot (a busy port fails startup), and it stops,
    giving in-flight calls `kserve_grace_s`, after the OpenAI side drained and before the
    engines stop. Its HTTP API is also served on this app's port, under /v2.

    `max_buffered_body_bytes` bounds the chunked request bodies buffered at once (see
    paved.frontend.middleware.BodyLimitMiddleware); None: 128 MiB, or max_body_bytes if larger."""
    if max_buffered_body_bytes is None:
        max_buffered_body_bytes = max(DEFAULT_MAX_BUFFERED_BYTES, max_body_bytes)
    if max_buffered_body_bytes < max_body_bytes:
        # Checked here: Starlette builds its middleware only on the first request.
        raise ValueError("max_buffered_body_bytes must be at least max_body_bytes")

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if kserve is not None:
            try:
                await kserve.start()
            except Exception as e:
                # uvicorn then exits with its startup-failure status; the log says why.
                logger.error("the KServe v2 server could not start: %s", e)
                await kserve.stop(grace_s=0)
                raise
            if on_kserve_started is not None:
                on_kserve_started(kserve)
        boot = asyncio.create_task(models.start(), name="paved-engine-start")

        def started(task: asyncio.Task) -> None:
            if task.cancelled():
                return
            error = task.exception()
            if error is not None:
                logger.error("starting the engines failed", exc_info=error)
                if on_start_failure is not None:
                    on_start_failure(error)
            elif on_started is not None:
                on_started()

        boot.add_done_callback(started)
        try:
            yield
        finally:
            # Runs after the server has drained in-flight requests (or given up waiting).
            models.draining = True
            if not boot.done():
                boot.cancel()
                await asyncio.gather(boot, return_exceptions=True)
            if kserve is not None:
                try:
                    await kserve.stop(grace_s=kserve_grace_s)
                except Exception:
                    logger.exception("stopping the KServe server failed")
            await models.stop()

    metrics = FrontendMetrics(models)
    app = FastAPI(
        title="paved",
        summary="OpenAI-compatible API over paved's engines",
        version="1",
        lifespan=lifespan,
        # The interactive docs load assets from a CDN; the OpenAPI document is enough.
        docs_url=None,
        redoc_url=None,
    )
    app.state.paved = AppState(models=models, metrics=metrics)
    install_error_handlers(app)
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(ops_api.router)
    # Added last = outermost: metrics also count the 413s the body limit answers.
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=max_body_bytes, max_buffered_bytes=max_buffered_body_bytes
    )
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    # Outermost of all: every response (413s, metrics, errors) carries x-request-id, and the
    # access line times the whole stack.
    app.add_middleware(TracingMiddleware)
    if kserve is not None:
        app.add_middleware(_KServeHTTP, kserve=kserve)
    return app

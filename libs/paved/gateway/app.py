"""The gateway's ASGI app: the OpenAI surface and KServe v2 HTTP over the router, the admin API,
health and metrics. Components are built by the caller (`paved.gateway.server`, tests) and
started and stopped by the app's lifespan, in dependency order.

The data path uses plain Starlette routes (no FastAPI dependency injection or response models
per request: the gateway forwards bodies it only needs to read a few fields of); the admin API is
a FastAPI router with validated models.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DataError
from starlette.exceptions import HTTPException as StarletteHTTPException

from paved.gateway.access.admin_api import admin_router
from paved.gateway.access.auth import AdminAuth, Authenticator
from paved.gateway.access.limits import Limiter
from paved.gateway.access.state import GatewayStore
from paved.gateway.errors import GatewayError
from paved.gateway.forwarding.proxy import OpenAIProxy
from paved.gateway.metrics import GatewayMetrics
from paved.gateway.orchestration.orchestrate import Orchestrator
from paved.gateway.routing.health import HealthChecker
from paved.gateway.routing.router import Router
from paved.gateway.routing.routes import RoutesSource
from paved.http.body_limit import BodyLimitMiddleware
from paved.http.errors import error_body, validation_message
from paved.http.json_body import JSONBodyError, parse_json

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class Gateway:
    """Everything one gateway replica runs; `create_app` serves it."""

    store: GatewayStore
    authenticator: Authenticator
    admin: AdminAuth
    limiter: Limiter
    router: Router
    proxy: OpenAIProxy
    metrics: GatewayMetrics
    routes_source: RoutesSource | None = None
    health: HealthChecker | None = None
    # Templates, conversations, caches and experiments; also set as `proxy.orchestrator`.
    orchestrator: Orchestrator | None = None
    # The Responses API and resumable streams (its routes are the composer's to add); when
    # set, chat completions go through it (a resumable stream when it is configured so).
    responses: Any = None
    # Extra things to start after the core (e.g. the KServe gRPC server) and stop before it.
    on_start: list[Callable[[], Awaitable[Any]]] = field(default_factory=list)
    on_stop: list[Callable[[], Awaitable[Any]]] = field(default_factory=list)

    async def start(self) -> None:
        await self.store.start()
        if self.routes_source is not None:
            await self.routes_source.start()
        self.proxy.tokens.prefetch(
            sorted({r.tokenizer for r in self.router.table.models.values() if r.tokenizer})
        )
        if self.health is not None:
            await self.health.start()
        if self.orchestrator is not None:
            await self.orchestrator.start()
        for hook in self.on_start:
            await hook()

    async def stop(self) -> None:
        for hook in reversed(self.on_stop):
            with contextlib.suppress(Exception):
                await hook()
        if self.orchestrator is not None:
            with contextlib.suppress(Exception):
                await self.orchestrator.stop()
        if self.health is not None:
            await self.health.stop()
        if self.routes_source is not None:
            await self.routes_source.stop()
        if self.proxy.flow is not None:
            self.proxy.flow.close()  # queued requests are answered 503 now, not cut off
        await self.proxy.close()
        await self.limiter.close()
        await self.store.close()


def _error(e: GatewayError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.param, e.code), e.status, headers=e.headers or None)


def create_app(
    gateway: Gateway,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    extra_routes: list[Any] | None = None,
    manage_lifespan: bool = True,
    max_upload_bytes: int | None = None,
) -> Any:
    """The gateway's ASGI app. `max_upload_bytes`: the body bound of `POST /v1/files` (batch
    input files, larger than any request; the upload spools to disk), else `max_body_bytes`."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_lifespan:
            await gateway.start()
        try:
            yield
        finally:
            if manage_lifespan:
                await gateway.stop()

    app = FastAPI(title="paved gateway", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    proxy = gateway.proxy

    async def chat(request: Request) -> Response:
        if gateway.responses is not None:
            return await gateway.responses.chat(request)
        return await proxy.forward(request, "chat", "/v1/chat/completions")

    async def completions(request: Request) -> Response:
        return await proxy.forward(request, "completions", "/v1/completions")

    async def embeddings(request: Request) -> Response:
        return await proxy.forward(request, "embeddings", "/v1/embeddings")

    async def rank(request: Request) -> Response:
        return await proxy.forward(request, "rank", "/v1/rank")

    async def models(request: Request) -> Response:
        return await proxy.list_models(request)

    async def model(request: Request) -> Response:
        return await proxy.get_model(request)

    async def live(_: Request) -> Response:
        return JSONResponse({"status": "live"})

    async def ready(_: Request) -> Response:
        # Ready once the routes are loaded; per-model backend health is answered per request
        # (503 + Retry-After), so one model's outage never takes the whole gateway out.
        if not gateway.router.table.models:
            return JSONResponse({"status": "no routes loaded"}, status_code=503)
        return JSONResponse({"status": "ready", "routes_revision": gateway.router.table.revision})

    async def metrics(_: Request) -> Response:
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4")

    async def routes_view(request: Request) -> Response:
        gateway.admin.check(request.headers.get("authorization"))
        source = gateway.routes_source
        return JSONResponse(
            {
                "revision": gateway.router.table.revision,
                "last_error": source.last_error if source is not None else None,
                "backends": gateway.router.snapshot(),
                "now": time.time(),
            }
        )

    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/embeddings", embeddings, methods=["POST"])
    app.add_route("/v1/rank", rank, methods=["POST"])
    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/v1/models/{model:path}", model, methods=["GET"])
    app.add_route("/health/live", live, methods=["GET"])
    app.add_route("/health/ready", ready, methods=["GET"])
    app.add_route("/metrics", metrics, methods=["GET"])
    app.add_route("/admin/v1/routes", routes_view, methods=["GET"])
    app.include_router(admin_router(gateway.store, gateway.admin, on_revoke=gateway.authenticator.invalidate))
    orchestrator = gateway.orchestrator
    if orchestrator is not None:
        _orchestration_routes(app, gateway, orchestrator)
    for route in extra_routes or ():
        app.router.routes.append(route)
    install_error_handlers(app)
    buffered = 128 * 1024 * 1024
    limited = BodyLimitMiddleware(app, max_body_bytes, max_buffered_bytes=max(max_body_bytes, buffered))
    if max_upload_bytes is None or max_upload_bytes <= max_body_bytes:
        return limited
    # Uploads stream to a spool file: a chunked one is counted as it passes, never buffered.
    uploads = BodyLimitMiddleware(
        app, max_upload_bytes, max_buffered_bytes=max(max_upload_bytes, buffered), stream_chunked=True
    )

    async def by_path(scope: Any, receive: Any, send: Any) -> None:
        is_upload = scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == "/v1/files"
        await (uploads if is_upload else limited)(scope, receive, send)

    return by_path


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-style bodies for the gateway's own errors, invalid bodies (400) and Starlette's
    HTTP errors (404, 405): what every router of the gateway relies on."""

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return JSONResponse(error_body(400, message, param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)),
            exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(DataError)
    async def _data(_: Request, exc: DataError) -> JSONResponse:
        # PostgreSQL refuses a NUL character in text; only a caller's value can carry one to
        # the state database (SQLite stores it). Any other refusal is a fault of ours: a 500.
        if "NUL" not in str(exc.orig):
            raise exc
        return JSONResponse(error_body(400, "the request holds a NUL character where text is expected"), 400)


def _orchestration_routes(app: FastAPI, gateway: Gateway, orchestrator: Orchestrator) -> None:
    if orchestrator.templates is not None:
        from paved.gateway.orchestration.templates import templates_router

        app.include_router(templates_router(orchestrator.templates, gateway.admin))
    if orchestrator.experiments is not None and orchestrator.recorder is not None:
        from paved.gateway.experiments.experiments import experiments_router, feedback_router

        app.include_router(experiments_router(orchestrator.experiments, orchestrator.recorder, gateway.admin))
        app.include_router(feedback_router(orchestrator.recorder, gateway.authenticator))

    async def false_hit(request: Request) -> Response:
        """A client reports that a cache hit answered a different question: the entry is
        evicted (only the tenant that was served it can name it) and counted."""
        principal = await gateway.authenticator.authenticate(request.headers.get("authorization"))
        try:
            body = parse_json(await request.body())
        except JSONBodyError as e:
            raise GatewayError(400, f"the request body is {e}") from None
        entry = body.get("entry") if isinstance(body, dict) else None
        if not orchestrator.entry_ids.well_formed(entry):
            raise GatewayError(400, "entry must be the x-paved-cache-entry of a cached answer", param="entry")
        tenant = principal.tenant.name
        # A forged id, another tenant's and an expired one get the same 404: the answer must
        # not tell a tenant whether anyone else made a request.
        opened = orchestrator.entry_ids.open(tenant, entry)
        evicted = False
        if opened is not None and opened.exact_key is not None and orchestrator.exact is not None:
            evicted = await orchestrator.exact.delete(opened.exact_key)
        elif opened is not None and opened.semantic_id is not None and orchestrator.semantic is not None:
            evicted = await orchestrator.semantic.evict(tenant, opened.semantic_id)
        if not evicted:
            raise GatewayError(404, "no such cache entry (it may have expired)", code="cache_entry_not_found")
        gateway.metrics.cache_false_hits.labels(tenant).inc()
        return JSONResponse({"entry": entry, "evicted": True})

    app.add_route("/v1/cache/false_hit", false_hit, methods=["POST"])

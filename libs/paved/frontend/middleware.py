"""Pure ASGI middleware (Starlette's BaseHTTPMiddleware would buffer streams and break the
disconnect signal that aborts engine requests)."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from paved.frontend.metrics import FrontendMetrics, route_label


class MetricsMiddleware:
    """Count and time every HTTP request, by route (closed set), method and status."""

    def __init__(self, app: ASGIApp, metrics: FrontendMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_label(scope["path"])
        status = 500
        started = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        in_flight = self.metrics.http_in_flight.labels(route)
        in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            in_flight.dec()
            self.metrics.http_requests.labels(route, scope["method"], str(status)).inc()
            self.metrics.http_latency.labels(route).observe(time.perf_counter() - started)

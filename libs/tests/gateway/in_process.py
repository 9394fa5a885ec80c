"""Gateway routers as an app of their own, for tests that serve them in their process
(`servers.serve_in_thread`) and drive them through a real HTTP client (the `paved` CLI)
without starting the gateway main."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from paved.gateway.app import install_error_handlers


def app_with(*routers: Any) -> FastAPI:
    """A FastAPI app of `routers` with the gateway's own error handlers."""
    app = FastAPI()
    for router in routers:
        app.include_router(router)
    install_error_handlers(app)
    return app

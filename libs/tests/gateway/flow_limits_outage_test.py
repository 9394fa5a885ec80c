"""A Redis outage while a request is at its backend: the answer still reaches the client.

The gateway's KServe HTTP routes with the real Authenticator (SQLite GatewayStore), a real
RedisLimiter on a real redis-server and a loopback KServe backend that stops Redis while it
works. The reservation cannot be settled then; that must not turn the backend's answer into a
503 "rate limiter unavailable" (the client would retry, and the work be done twice): it was.
"""

from __future__ import annotations

import asyncio
import socket
import tempfile

import aiohttp
import uvicorn
from aiohttp import web
from starlette.applications import Starlette

from paved.gateway.access.auth import Authenticator
from paved.gateway.access.limits import RedisLimiter
from paved.gateway.access.state import GatewayStore
from paved.gateway.forwarding.kserve_http import kserve_http_routes
from paved.gateway.routing.router import Router
from paved.gateway.routing.routes import Backend, ModelRoute, RoutesTable
from paved.gateway.types import Limits
from paved.testing.redis import redis_server

ANSWER = {"model_name": "m", "outputs": [{"name": "y", "datatype": "FP32", "shape": [1], "data": [1.0]}]}


async def _serve(app: Starlette) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    for _ in range(1000):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    assert server.started
    return server, task, port


def test_a_kserve_answer_is_delivered_when_redis_fails_while_the_backend_works():
    redis = redis_server()
    url = redis.__enter__()
    stopped = False

    def stop_redis() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            redis.__exit__(None, None, None)

    async def infer(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.to_thread(stop_redis)
        return web.json_response(ANSWER)

    async def go(tmp: str) -> tuple[int, object]:
        upstream = web.Application()
        upstream.router.add_post("/v2/models/m/infer", infer)
        runner = web.AppRunner(upstream)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        up_port = runner.addresses[0][1]
        backend = Backend(
            id="b", url=f"http://127.0.0.1:{up_port}", version="v1", kserve_http=f"http://127.0.0.1:{up_port}"
        )
        router = Router(RoutesTable.of([ModelRoute("m", (backend,), kind="kserve")]))
        store = GatewayStore(f"sqlite:///{tmp}/gateway.db")
        await store.start()
        # A concurrency limit: settling the reservation needs Redis.
        await store.create_tenant("t", limits=Limits(max_concurrent=4, requests_per_min=1000))
        _, key = await store.create_key("t")
        limiter = RedisLimiter(url, timeout_s=0.5)
        session = aiohttp.ClientSession()
        server, task, port = await _serve(
            Starlette(routes=kserve_http_routes(router, Authenticator(store), limiter, lambda: session))
        )
        try:
            async with (
                aiohttp.ClientSession() as client,
                client.post(
                    f"http://127.0.0.1:{port}/v2/models/m/infer",
                    json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [0.5]}]},
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=aiohttp.ClientTimeout(total=60),
                ) as response,
            ):
                status, body = response.status, await response.json(content_type=None)
            assert stopped  # the backend did stop Redis while it worked
            # With Redis gone, a new request is refused (fail closed), not admitted.
            async with (
                aiohttp.ClientSession() as client,
                client.post(
                    f"http://127.0.0.1:{port}/v2/models/m/infer",
                    json={"inputs": []},
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=aiohttp.ClientTimeout(total=60),
                ) as refused,
            ):
                assert refused.status == 503
                assert refused.headers.get("Retry-After") == "1"
            return status, body
        finally:
            server.should_exit = True
            await task
            await session.close()
            await limiter.close()
            await store.close()
            await runner.cleanup()

    try:
        with tempfile.TemporaryDirectory() as tmp:
            status, body = asyncio.run(go(tmp))
    finally:
        stop_redis()
    assert (status, body) == (200, ANSWER)

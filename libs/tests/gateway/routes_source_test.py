"""FileRoutesSource (initial load, hot reload, bad or missing file keeps the last table, TOML)
and HealthChecker against real aiohttp servers on loopback (ready, not ready, not listening)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from paved.gateway.health import FileRoutesSource, HealthChecker
from paved.gateway.router import Router
from paved.gateway.routes import RoutesError, RoutesTable, load_routes_file, parse_routes


def routes_obj(*ports: int, version: str = "v1") -> dict[str, Any]:
    return {
        "models": [
            {
                "alias": "tiny",
                "backends": [{"url": f"http://127.0.0.1:{p}", "version": version} for p in ports],
            }
        ]
    }


def write_json(path: Path, obj: Any) -> None:
    # Write-then-rename, as a deploy tool would, so a poll never sees half a file.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def empty_router() -> Router:
    return Router(parse_routes({"models": []}))


def urls(router: Router) -> set[str]:
    return {b.url for r in router.table.models.values() for b in r.backends}


def test_file_source_load_reload_and_keeping_the_last_table(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "routes.json"
    write_json(path, routes_obj(8001))
    router = empty_router()
    source = FileRoutesSource(path, router, poll_s=3600)

    async def run() -> None:
        await source.start()
        try:
            assert urls(router) == {"http://127.0.0.1:8001"}
            first = source.revision
            assert first == router.table.revision and source.last_error is None and source.loaded_at
            assert await source.reload_now() is False  # unchanged

            write_json(path, routes_obj(8001, 8002))
            assert await source.reload_now() is True
            assert urls(router) == {"http://127.0.0.1:8001", "http://127.0.0.1:8002"}
            good = source.revision
            assert good != first

            path.write_text('{"models": [')
            with caplog.at_level(logging.WARNING, logger="paved.gateway.health"):
                assert await source.reload_now() is False
                assert await source.reload_now() is False
            assert source.last_error and "invalid JSON" in source.last_error
            assert source.revision == good and router.table.revision == good
            warned = [r for r in caplog.records if "invalid JSON" in r.getMessage()]
            assert len(warned) == 1  # once per distinct error

            write_json(path, {"models": [{"alias": "x@y", "backends": []}]})
            await source.reload_now()
            assert source.last_error and "models[0].alias" in source.last_error
            assert router.table.revision == good

            path.unlink()
            await source.reload_now()
            assert source.last_error and "not found" in source.last_error
            assert urls(router) == {"http://127.0.0.1:8001", "http://127.0.0.1:8002"}

            write_json(path, routes_obj(8003))
            assert await source.reload_now() is True
            assert source.last_error is None and urls(router) == {"http://127.0.0.1:8003"}
        finally:
            await source.stop()

    asyncio.run(run())


def test_file_source_polls_for_changes(tmp_path: Path) -> None:
    path = tmp_path / "routes.json"
    write_json(path, routes_obj(8001))
    router = empty_router()
    source = FileRoutesSource(path, router, poll_s=0.01)

    async def run() -> None:
        await source.start()
        try:
            write_json(path, routes_obj(8005))
            for _ in range(2000):  # bounded wait for the poller; the assertion is on state
                if urls(router) == {"http://127.0.0.1:8005"}:
                    break
                await asyncio.sleep(0.005)
            assert urls(router) == {"http://127.0.0.1:8005"}
        finally:
            await source.stop()

    asyncio.run(run())


def test_bad_file_at_start_refuses(tmp_path: Path) -> None:
    path = tmp_path / "routes.json"
    path.write_text('{"models": [{"alias": "tiny", "backends": [{"url": "ftp://x", "version": "v1"}]}]}')
    router = empty_router()

    async def run(p: Path) -> None:
        await FileRoutesSource(p, router).start()

    with pytest.raises(RoutesError, match=r"models\[0\]\.backends\[0\]\.url"):
        asyncio.run(run(path))
    with pytest.raises(RoutesError, match="not found"):
        asyncio.run(run(tmp_path / "missing.json"))
    with pytest.raises(RoutesError, match=r"\.json or \.toml"):
        FileRoutesSource(tmp_path / "routes.yaml", router)
    assert router.table.models == {}


TOML = """
[[models]]
alias = "tiny"
strategy = "prefix_affinity"
tokenizer = "/models/tiny"
affinity_prefix_tokens = 64

[models.split]
v1 = 0.9
v2 = 0.1

[[models.backends]]
url = "http://127.0.0.1:8001"
version = "v1"
weight = 2
kserve_grpc = "127.0.0.1:9001"
kserve_http = "http://127.0.0.1:9002"

[[models.backends]]
id = "second"
url = "http://localhost:8002"
version = "v2"
"""


def test_toml_form(tmp_path: Path) -> None:
    path = tmp_path / "routes.toml"
    path.write_text(TOML)
    t = load_routes_file(path)
    route = t.models["tiny"]
    assert route.strategy == "prefix_affinity" and route.tokenizer == "/models/tiny"
    assert route.affinity_prefix_tokens == 64 and dict(route.split or {}) == {"v1": 0.9, "v2": 0.1}
    a, b = route.backends
    assert (a.weight, a.kserve_grpc, a.kserve_http) == (2.0, "127.0.0.1:9001", "http://127.0.0.1:9002")
    assert b.id == "second" and b.version == "v2"
    # The same table as JSON has the same revision.
    as_json = tmp_path / "routes.json"
    write_json(as_json, t.to_obj())
    assert load_routes_file(as_json).revision == t.revision

    router = empty_router()

    async def run() -> None:
        source = FileRoutesSource(path, router)
        await source.start()
        await source.stop()
        assert source.revision == t.revision

    asyncio.run(run())
    assert router.table == t
    path.write_text("[[models]\n")
    with pytest.raises(RoutesError, match="invalid TOML"):
        load_routes_file(path)


# -- health checks --------------------------------------------------------------------------


async def serve(status: int) -> tuple[web.AppRunner, int]:
    async def ready(_request: web.Request) -> web.Response:
        return web.json_response({"status": "x"}, status=status)

    app = web.Application()
    app.router.add_get("/health/ready", ready)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_checker_marks_readiness() -> None:
    async def run() -> None:
        up, up_port = await serve(200)
        down, down_port = await serve(503)
        dead_port = closed_port()
        try:
            table: RoutesTable = parse_routes(routes_obj(up_port, down_port, dead_port))
            router = Router(table)
            up_url, down_url, dead_url = (f"http://127.0.0.1:{p}" for p in (up_port, down_port, dead_port))
            # Unchecked backends are served (unknown = ready).
            assert all(s["ready"] and not s["checked"] for s in router.snapshot().values())
            checker = HealthChecker(router, interval_s=3600, timeout_s=2.0)
            try:
                result = await checker.check_now()
                assert result == {up_url: True, down_url: False, dead_url: False}
                snap = router.snapshot()
                assert snap[up_url]["ready"] and not snap[down_url]["ready"] and not snap[dead_url]["ready"]
                assert {router.pick("tiny", sticky_key=str(i)).backend.url for i in range(30)} == {up_url}
                # The started loop runs a first round too; stop ends it and the session.
                await checker.start()
                await checker.stop()
            finally:
                await checker.stop()
            # A swapped table is checked as it now stands.
            router.set_table(parse_routes(routes_obj(up_port)))
            again = HealthChecker(router)
            try:
                assert await again.check_now() == {up_url: True}
            finally:
                await again.stop()
        finally:
            await up.cleanup()
            await down.cleanup()

    asyncio.run(run())


def test_a_slow_probe_counts_only_after_several_timeouts() -> None:
    async def run() -> None:
        gate = asyncio.Event()

        async def ready(_request: web.Request) -> web.Response:
            await gate.wait()  # never answers in time while the gate is shut
            return web.json_response({"status": "ok"})

        app = web.Application()
        app.router.add_get("/health/ready", ready)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        router = Router(parse_routes(routes_obj(port)))
        checker = HealthChecker(router, interval_s=3600, timeout_s=0.05, timeouts_to_fail=3)
        try:
            assert [await checker.check_now() for _ in range(2)] == [{url: True}, {url: True}]
            assert await checker.check_now() == {url: False}  # the third timeout in a row
            gate.set()
            assert await checker.check_now() == {url: True}
        finally:
            await checker.stop()
            await runner.cleanup()

    asyncio.run(run())


def test_health_checker_validates_arguments() -> None:
    router = empty_router()
    with pytest.raises(ValueError, match="> 0"):
        HealthChecker(router, interval_s=0)
    with pytest.raises(ValueError, match="start with"):
        HealthChecker(router, path="health")

"""FileRoutesSource (initial load, hot reload, bad or missing file keeps the last table, TOML)
and HealthChecker against real aiohttp servers on loopback (ready, not ready, not listening;
the load gauges of their Prometheus text reaching the router)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from paved.gateway.routing.health import FileRoutesSource, HealthChecker
from paved.gateway.routing.router import Router
from paved.gateway.routing.routes import RoutesError, RoutesTable, load_routes_file, parse_routes


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
            with caplog.at_level(logging.WARNING, logger="paved.gateway.routing.health"):
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


def gauges_text(model: str, *, waiting: float, running: float, kv: float, queued: int, bound: int) -> str:
    """What a paved frontend's /metrics says of one model (and a histogram it also carries)."""
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="{model}"}} {waiting}\n'
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="{model}"}} {running}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} {kv}\n'
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        f'vllm:e2e_request_latency_seconds_bucket{{le="+Inf",model_name="{model}"}} 7.0\n'
        "# TYPE paved_queued_sequences gauge\n"
        f'paved_queued_sequences{{model="{model}"}} {queued}\n'
        "# TYPE paved_max_queued_sequences gauge\n"
        f'paved_max_queued_sequences{{model="{model}"}} {bound}\n'
    )


async def serve_metrics(texts: dict[str, str], *, ready: int = 200) -> tuple[web.AppRunner, int]:
    """/health/ready answering `ready`; each path of `texts` answering its current text (a path
    missing from it answers 404: edit the dict between rounds)."""

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "x"}, status=ready)

    async def metrics(request: web.Request) -> web.Response:
        text = texts.get(request.path)
        if text is None:
            return web.Response(status=404)
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/health/ready", health)
    app.router.add_get("/{tail:.*}", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def test_health_rounds_read_each_backends_gauges_into_the_router() -> None:
    async def run() -> None:
        a_texts = {"/metrics": gauges_text("tiny", waiting=3, running=5, kv=0.25, queued=8, bound=8)}
        # b's gauges are on a metrics port of their own (a launcher's metrics proxy).
        proxy_texts = {"/metrics": gauges_text("tiny", waiting=0, running=1, kv=0.5, queued=1, bound=8)}
        a, a_port = await serve_metrics(a_texts)
        b, b_port = await serve_metrics({})
        proxy, proxy_port = await serve_metrics(proxy_texts)
        a_url, b_url = f"http://127.0.0.1:{a_port}", f"http://127.0.0.1:{b_port}"
        routes = {
            "models": [
                {
                    "alias": "tiny",
                    "backends": [
                        {"url": a_url, "version": "v1"},
                        {
                            "url": b_url,
                            "version": "v1",
                            "metrics_url": f"http://127.0.0.1:{proxy_port}/metrics",
                        },
                    ],
                }
            ]
        }
        router = Router(parse_routes(routes))
        checker = HealthChecker(router, interval_s=3600, timeout_s=2.0)
        try:
            assert await checker.check_now() == {a_url: True, b_url: True}
            snap = router.snapshot()
            assert snap[a_url]["gauges"] is not None and snap[b_url]["gauges"] is not None
            assert {
                k: snap[a_url]["gauges"][k] for k in ("waiting", "kv_usage", "queued", "max_queued", "full")
            } == {
                "waiting": 3.0,
                "kv_usage": 0.25,
                "queued": 8.0,
                "max_queued": 8.0,
                "full": True,
            }
            assert (snap[b_url]["gauges"]["queued"], snap[b_url]["gauges"]["full"]) == (1.0, False)
            assert not router.saturated("tiny", sticky_key="k")
            proxy_texts["/metrics"] = gauges_text("tiny", waiting=9, running=8, kv=1.0, queued=9, bound=8)
            await checker.check_now()
            assert router.saturated("tiny", sticky_key="k")
            # A scrape that fails (404, garbage, another model's series only) leaves readiness
            # to /health/ready and the last gauges to go stale; the error is kept.
            del proxy_texts["/metrics"]
            a_texts["/metrics"] = gauges_text("other", waiting=0, running=0, kv=0, queued=0, bound=8)
            assert await checker.check_now() == {a_url: True, b_url: True}
            assert "HTTP 404" in str(checker.gauges[b_url]) and "model_name='tiny'" in str(
                checker.gauges[a_url]
            )
            assert router.snapshot()[b_url]["gauges"]["queued"] == 9.0  # not overwritten
            a_texts["/metrics"] = "vllm:num_requests_waiting{ nonsense\n"
            assert await checker.check_now() == {a_url: True, b_url: True}
            assert "unparsable" in str(checker.gauges[a_url])
        finally:
            await checker.stop()
            for runner in (a, b, proxy):
                await runner.cleanup()

    asyncio.run(run())


def test_gauge_scrapes_are_bounded_and_can_be_turned_off() -> None:
    async def run() -> None:
        texts = {"/metrics": gauges_text("tiny", waiting=1, running=1, kv=0.1, queued=2, bound=4)}
        runner, port = await serve_metrics(texts)
        url = f"http://127.0.0.1:{port}"
        router = Router(parse_routes(routes_obj(port)))
        off = HealthChecker(router, interval_s=3600, scrape_metrics=False)
        small = HealthChecker(router, interval_s=3600, max_metrics_bytes=64)
        try:
            assert await off.check_now() == {url: True}
            assert router.snapshot()[url]["gauges"] is None and off.gauges == {}
            assert await small.check_now() == {url: True}
            assert "larger than 64 bytes" in str(small.gauges[url])
            assert router.snapshot()[url]["gauges"] is None
        finally:
            await off.stop()
            await small.stop()
            await runner.cleanup()

    asyncio.run(run())
    with pytest.raises(ValueError, match="max_metrics_bytes"):
        HealthChecker(empty_router(), max_metrics_bytes=0)


def test_a_frontend_serving_several_models_of_the_table_is_read_over_all_of_them() -> None:
    async def run() -> None:
        # One family per name, a series per model, as a frontend's /metrics has them.
        text = "".join(
            f'# TYPE {name} gauge\n{name}{{{label}="a"}} {va}\n{name}{{{label}="b"}} {vb}\n'
            for name, label, va, vb in (
                ("vllm:num_requests_waiting", "model_name", 1, 2),
                ("vllm:num_requests_running", "model_name", 0, 0),
                ("vllm:kv_cache_usage_perc", "model_name", 0.2, 0.4),
                ("paved_queued_sequences", "model", 4, 0),
                ("paved_max_queued_sequences", "model", 4, 4),
            )
        )
        runner, port = await serve_metrics({"/metrics": text})
        url = f"http://127.0.0.1:{port}"
        routes = {
            "models": [
                {"alias": alias, "backends": [{"url": url, "version": "v1", "upstream_model": alias}]}
                for alias in ("a", "b")
            ]
        }
        router = Router(parse_routes(routes))
        checker = HealthChecker(router, interval_s=3600)
        try:
            await checker.check_now()
            gauges = router.snapshot()[url]["gauges"]
            # Summed over both models: `a` alone is full, the frontend as a whole is not.
            assert gauges is not None and (gauges["waiting"], gauges["queued"], gauges["full"]) == (
                3.0,
                4.0,
                False,
            )
        finally:
            await checker.stop()
            await runner.cleanup()

    asyncio.run(run())

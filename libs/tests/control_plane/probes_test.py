"""probe_ready / probe_live against a fake OpenAI server on loopback (answers chosen per test:
invalid JSON, a schema violation, 503s) and against a real simulated frontend with KServe."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from paved.control_plane.errors import BadRequest
from paved.control_plane.probes import probe_live, probe_ready
from paved.control_plane.types import Replica
from paved.runfiles import runfile


def replica(url: str, admin_url: str | None = None, kserve_grpc: str | None = None) -> Replica:
    return Replica(
        id="r1",
        deployment_id="dep_1",
        region="local",
        state="starting",
        url=url,
        admin_url=admin_url or url,
        kserve_grpc=kserve_grpc,
    )


class FakeServer:
    """Launcher admin + OpenAI endpoints in one aiohttp app; `content` is what the chat
    completion's message content will be, `ready`/`live` the health statuses."""

    def __init__(self) -> None:
        self.content: Any = '{"ok": true}'
        self.embedding: Any = [0.1, 0.2]
        self.ready = 200
        self.live = 200
        self.chat_bodies: list[dict] = []

    async def __aenter__(self) -> FakeServer:
        app = web.Application()
        app.router.add_get("/health/ready", self._ready)
        app.router.add_get("/health/live", self._live)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/embeddings", self._embed)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()

    async def _ready(self, _: web.Request) -> web.Response:
        return web.Response(status=self.ready, text="x")

    async def _live(self, _: web.Request) -> web.Response:
        return web.Response(status=self.live, text="x")

    async def _chat(self, request: web.Request) -> web.Response:
        self.chat_bodies.append(await request.json())
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": self.content},
            "finish_reason": "stop",
        }
        return web.json_response({"id": "c", "object": "chat.completion", "choices": [choice]})

    async def _embed(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"index": 0, "embedding": self.embedding}]})


class FakeDriver:
    region = "local"

    def __init__(self, alive: bool):
        self._alive = alive

    async def alive(self, replica: Replica) -> bool:
        return self._alive


def test_smoke_answer_must_parse_and_validate() -> None:
    async def go() -> None:
        async with FakeServer() as s:
            r = replica(s.url)
            assert await probe_ready(r, model_id="m") == (True, "ready")
            sent = s.chat_bodies[-1]
            assert sent["model"] == "m" and sent["response_format"]["type"] == "json_schema"
            assert sent["max_tokens"] <= 32

            s.content = 'not json {"ok'
            ok, reason = await probe_ready(r, model_id="m")
            assert not ok and "not valid JSON" in reason, reason

            s.content = '{"ok": "yes"}'
            ok, reason = await probe_ready(r, model_id="m")
            assert not ok and "does not match the schema" in reason, reason

            s.content = None
            ok, reason = await probe_ready(r, model_id="m")
            assert not ok and "not a string" in reason, reason

            # Without the smoke request, only the admin check counts.
            assert await probe_ready(r, model_id="m", smoke=False) == (True, "ready")

            s.ready = 503
            ok, reason = await probe_ready(r, model_id="m")
            assert not ok and "/health/ready: HTTP 503" in reason, reason

    asyncio.run(go())


def test_embed_smoke() -> None:
    async def go() -> None:
        async with FakeServer() as s:
            r = replica(s.url)
            assert await probe_ready(r, model_id="m", kind="embed") == (True, "ready")
            assert s.chat_bodies == []
            for bad in ([], ["x"], {"a": 1}):
                s.embedding = bad
                ok, reason = await probe_ready(r, model_id="m", kind="embed")
                assert not ok and "embedding" in reason, reason

    asyncio.run(go())


def test_unreachable_and_live() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused

    async def go() -> None:
        ok, reason = await probe_ready(replica(dead), model_id="m", timeout_s=2)
        assert not ok and reason.startswith("launcher /health/ready:"), reason
        async with FakeServer() as srv:
            r = replica(srv.url)
            assert await probe_live(r, FakeDriver(True)) == (True, "live")  # type: ignore[arg-type]
            ok, reason = await probe_live(r, FakeDriver(False))  # type: ignore[arg-type]
            assert not ok and "gone" in reason
            srv.live = 500
            ok, reason = await probe_live(r, FakeDriver(True))  # type: ignore[arg-type]
            assert not ok and "/health/live: HTTP 500" in reason, reason

    asyncio.run(go())


def test_invalid_arguments() -> None:
    async def go() -> None:
        r = replica("http://127.0.0.1:1")
        for kw in ({"kind": "rerank"}, {"timeout_s": 0}, {"timeout_s": float("inf")}, {"model_id": ""}):
            args: dict[str, Any] = {"model_id": "m", **kw}
            with pytest.raises(BadRequest):
                await probe_ready(r, **args)
        with pytest.raises(BadRequest):
            await probe_live(r, FakeDriver(True), timeout_s=-1)  # type: ignore[arg-type]

    asyncio.run(go())


def _serve(argv: list[str]) -> Iterator[tuple[str, str]]:
    """`python ARGV...` (ARGV starts with -m MODULE) with {http} and {grpc} replaced by two free
    ports, in its own process group; yields (http URL, gRPC target) once /health/ready answers,
    then kills the group."""
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    argv = [a.format(http=ports[0], grpc=ports[1]) for a in argv]
    proc = subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )  # fmt: skip
    url = f"http://127.0.0.1:{ports[0]}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
            try:
                with urllib.request.urlopen(url + "/health/ready", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"{argv[1]} did not become ready"
                time.sleep(0.1)
        yield url, f"127.0.0.1:{ports[1]}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def sim_frontend() -> Iterator[tuple[str, str]]:
    """The paved frontend over the sim engine with a KServe gRPC port."""
    yield from _serve(
        ["-m", "paved.frontend.server", "--engine", "sim://tiny?tokens_per_s=0", "--port", "{http}",
         "--kserve-grpc-port", "{grpc}"]
    )  # fmt: skip


def test_real_sim_frontend_with_kserve(sim_frontend: tuple[str, str]) -> None:
    url, grpc_target = sim_frontend

    async def go() -> None:
        r = replica(url, kserve_grpc=grpc_target)
        assert await probe_ready(r, model_id="tiny") == (True, "ready")
        ok, reason = await probe_ready(r, model_id="other", smoke=False)
        assert not ok and "ModelReady" in reason, reason
        ok, reason = await probe_ready(replica(url), model_id="other")
        assert not ok and "smoke chat completion: HTTP 404" in reason, reason
        closed = replica(url, kserve_grpc="127.0.0.1:1")
        ok, reason = await probe_ready(closed, model_id="tiny", timeout_s=3)
        assert not ok and "KServe" in reason, reason

    asyncio.run(go())


@pytest.fixture
def kserve_xgb() -> Iterator[tuple[str, str]]:
    """paved.kserve serving the XGBoost fixture alone (what a kserve-mode package runs)."""
    model_dir = os.path.dirname(runfile("models/xgb/config.json"))
    yield from _serve(
        [
            "-m",
            "paved.kserve.main",
            "--model-dir",
            model_dir,
            "--http-port",
            "{http}",
            "--grpc-port",
            "{grpc}",
        ]
    )


def test_a_classic_kserve_model_is_ready_after_a_smoke_inference(kserve_xgb: tuple[str, str]) -> None:
    url, grpc_target = kserve_xgb

    async def go() -> None:
        r = replica(url, kserve_grpc=grpc_target)
        # Launcher stand-in: the admin URL is the server itself (it answers /health/ready).
        assert await probe_ready(r, model_id="xgb_scorer", kind="kserve") == (True, "ready")
        ok, reason = await probe_ready(r, model_id="nope", kind="kserve")
        assert not ok and "ModelReady" in reason, reason
        # A kserve replica without its gRPC address cannot be probed: a caller's bug.
        with pytest.raises(BadRequest):
            await probe_ready(replica(url), model_id="xgb_scorer", kind="kserve")

    asyncio.run(go())

"""Run the KServe v2 gRPC and HTTP endpoints inside an existing asyncio process.

The OpenAI frontend starts them beside its own port, over the same engines:

    kserve = await serve_kserve(engines, grpc_port=8001, http_port=8002, model_dirs=["models/iris"],
                                model_repository="models/repo")
    ...
    await kserve.stop()

(paved.frontend.app does this in its lifespan with a `KServeServer` it is given.)

Request metrics (paved.kserve.metrics) go to `metrics_registry` when one is set before
`start()` (the frontend sets its own, so its /metrics carries them); otherwise the server keeps a
registry of its own, with the process collectors, and serves it at GET /metrics on its HTTP
port (the standalone server's, what the launcher merges).

Both listeners bind before `serve_kserve` returns (a busy port fails the caller at once); classic
models load in the background, so ServerReady answers false until they and the engines are
ready. The HTTP listener is a second uvicorn server on the caller's loop that leaves signal
handling to the process's main server: whoever owns shutdown calls `stop()`.

`http_app`, set by `start()` whether or not an HTTP port is configured, is the KServe v2 HTTP
application itself: the frontend also serves it on its own port (its /v2 paths), as Triton
serves every model over HTTP on one port, so a replica's public HTTP address is its KServe HTTP
address too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Sequence

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from paved.engine.protocol import Engine
from paved.frontend.metrics import process_registry
from paved.kserve.grpc_server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_STREAM_MAX_IN_FLIGHT,
    DEFAULT_STREAM_QUEUE_SIZE,
    create_grpc_server,
)
from paved.kserve.http_server import create_http_app
from paved.kserve.metrics import KServeMetrics
from paved.kserve.repository import Admission, ModelRepository, ServedModel
from paved.kserve.xgboost_model import XGBoostModel

logger = logging.getLogger(__name__)


class _EmbeddedUvicorn(uvicorn.Server):
    """A uvicorn server that does not take over SIGINT/SIGTERM from the process's main server."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class KServeServer:
    def __init__(
        self,
        engines: Sequence[Engine] = (),
        classic_models: Sequence[ServedModel] = (),
        *,
        host: str = "127.0.0.1",
        grpc_port: int | None = 8001,
        http_port: int | None = 8000,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        admission: Admission | None = None,
        draining: Callable[[], bool] | None = None,
        stream_max_in_flight: int = DEFAULT_STREAM_MAX_IN_FLIGHT,
        stream_queue_size: int = DEFAULT_STREAM_QUEUE_SIZE,
        metrics_registry: CollectorRegistry | None = None,
        model_repository: str | None = None,
        strict_readiness: bool = True,
    ):
        """`model_repository`: a Triton model repository directory whose models are served
        beside `classic_models` (a model it cannot build is listed UNAVAILABLE with the reason).
        `strict_readiness`: Triton's flag (ModelRepository.ready)."""
        if grpc_port is None and http_port is None:
            raise ValueError("KServe needs a gRPC port, an HTTP port, or both")
        self.repository = ModelRepository(engines, classic_models, admission, draining)
        self.repository.strict_readiness = strict_readiness
        if model_repository is not None:
            self.repository.load_repository_dir(model_repository)
        self.host = host
        self._grpc_port_wanted = grpc_port
        self._http_port_wanted = http_port
        self.max_message_bytes = max_message_bytes
        self.stream_max_in_flight = stream_max_in_flight
        self.stream_queue_size = stream_queue_size
        # Where the request metrics go (settable until start()); None: a registry of our own,
        # served at /metrics on the HTTP port.
        self.metrics_registry = metrics_registry
        self.metrics: KServeMetrics | None = None
        # The bound ports (port 0 asks for any free one).
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self._grpc = None
        self._http: _EmbeddedUvicorn | None = None
        self._http_task: asyncio.Task | None = None
        self._http_socket: socket.socket | None = None
        self.http_app: FastAPI | None = None

    async def start(self) -> None:
        self.repository.models()  # fail now on a name served twice
        served_registry = None
        registry = self.metrics_registry
        if registry is None:
            registry = served_registry = process_registry()
        self.metrics = metrics = KServeMetrics(registry, self.repository.serves)
        if self._grpc_port_wanted is not None:
            self._grpc, self.grpc_port = create_grpc_server(
                self.repository,
                host=self.host,
                port=self._grpc_port_wanted,
                max_message_bytes=self.max_message_bytes,
                stream_max_in_flight=self.stream_max_in_flight,
                stream_queue_size=self.stream_queue_size,
                metrics=metrics,
            )
        if self._http_port_wanted is not None:
            self._http_socket = _bind(self.host, self._http_port_wanted)
            self.http_port = self._http_socket.getsockname()[1]
        self.repository.start_loading()
        if self._grpc is not None:
            await self._grpc.start()
        self.http_app = app = create_http_app(
            self.repository,
            max_body_bytes=self.max_message_bytes,
            metrics=metrics,
            metrics_registry=served_registry,
        )
        if self._http_socket is not None:
            config = uvicorn.Config(
                app, lifespan="off", log_level="warning", access_log=False, timeout_keep_alive=30
            )
            self._http = _EmbeddedUvicorn(config)
            self._http_task = asyncio.create_task(
                self._http.serve(sockets=[self._http_socket]), name="kserve-http"
            )
            while not self._http.started:
                if self._http_task.done():
                    await self._http_task  # re-raise why it stopped
                    raise RuntimeError("the KServe HTTP server stopped during startup")
                await asyncio.sleep(0.01)
        logger.info("KServe v2 serving on %s (gRPC %s, HTTP %s)", self.host, self.grpc_port, self.http_port)

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until classic models are loaded (engines are their owner's to start)."""
        async with asyncio.timeout(timeout_s):
            await self.repository.wait_loaded()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting, give in-flight calls `grace_s`, then cancel the rest and unload."""
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(self._http_task), grace_s + 1)
            except TimeoutError:
                self._http.force_exit = True
                await self._http_task
        if self._http_socket is not None:
            self._http_socket.close()
        await self.repository.close()


async def serve_kserve(
    engines: Sequence[Engine],
    *,
    grpc_port: int | None,
    http_port: int | None,
    host: str = "127.0.0.1",
    model_dirs: Sequence[str] = (),
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    admission: Admission | None = None,
    draining: Callable[[], bool] | None = None,
    stream_max_in_flight: int = DEFAULT_STREAM_MAX_IN_FLIGHT,
    stream_queue_size: int = DEFAULT_STREAM_QUEUE_SIZE,
    model_repository: str | None = None,
    strict_readiness: bool = True,
) -> KServeServer:
    """Start KServe v2 over `engines` (their models, by ModelCard id) plus XGBoost model
    directories and the models of a Triton model repository directory; returns the running
    server (call `stop()` on shutdown).

    `admission`, if given, admits each LLM request first (`registry_admission(registry)` of
    a paved.frontend.registry.ModelRegistry: the OpenAI frontend passes its own, so both APIs
    share one bound; the standalone server builds one over its engines).
    """
    classic = [XGBoostModel.from_directory(d) for d in model_dirs]
    server = KServeServer(
        engines,
        classic,
        host=host,
        grpc_port=grpc_port,
        http_port=http_port,
        max_message_bytes=max_message_bytes,
        admission=admission,
        draining=draining,
        stream_max_in_flight=stream_max_in_flight,
        stream_queue_size=stream_queue_size,
        model_repository=model_repository,
        strict_readiness=strict_readiness,
    )
    await server.start()
    return server


def registry_admission(registry) -> Admission:
    """Admission through a paved.frontend.registry.ModelRegistry: its per-model
    `max_queued_sequences`, its 503 / UNAVAILABLE when full (the registry must be started)."""
    return lambda model, sequences: registry.admit(registry.get(model), sequences)

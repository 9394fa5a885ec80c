"""The frontend server main: parse flags/config, build engines, serve with uvicorn + uvloop.

With no arguments it serves the tiny model fixture (//models/tiny) on 127.0.0.1:8000.
`--engine kserve://HOST:PORT --model NAME` fronts a remote KServe v2 server (Triton with the
vLLM backend, or another paved) instead of running vLLM here; `--engine sim://MODEL?...` serves
the simulated engine (paved.engine.sim: no model runs). `--kserve-grpc-port` /
`--kserve-http-port` add KServe v2 listeners over the same engines (plus XGBoost models from
`--kserve-model-dir`). `--listen-fd` serves an inherited socket too (the launcher's public
port), listening on it only once every engine is ready.
"""

from paved.engine import vllm_env

# At import time: vLLM's engine core is started with `spawn`, which re-imports the main module.
vllm_env.apply_defaults()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import uvicorn  # noqa: E402

from paved.engine.vllm_config import VllmModelConfig  # noqa: E402
from paved.frontend import config as config_file  # noqa: E402
from paved.frontend.app import create_app  # noqa: E402
from paved.frontend.config import RemoteModelConfig, ServerConfig, make_engine  # noqa: E402
from paved.frontend.registry import ModelRegistry  # noqa: E402
from paved.http.sockets import LISTEN_BACKLOG, SERVER_KEEPALIVE_S, adopt, bind  # noqa: E402
from paved.runfiles import tiny_model_dir  # noqa: E402

logger = logging.getLogger("paved.frontend")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve",
        description="paved's OpenAI-compatible server. Without --model/--config: the tiny model fixture.",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--model",
        metavar="DIR|NAME",
        help="serve this Hugging Face model directory (with --engine: the remote model's name)",
    )
    source.add_argument(
        "--config", metavar="FILE", help="TOML/JSON file listing models (see paved.frontend.config)"
    )
    m = p.add_argument_group("--model options")
    m.add_argument(
        "--engine",
        metavar="URI",
        help="kserve://HOST:PORT[?tokenizer=DIR&max_model_len=N...]: a remote model over KServe v2 "
        "gRPC instead of in-process vLLM; sim://MODEL[?tokens_per_s=F&max_num_seqs=N&kv_tokens=N"
        "&max_waiting=N&tokenizer=DIR]: the simulated engine",
    )
    m.add_argument("--served-model-name", help="model id clients send (default: the directory's name)")
    m.add_argument("--kind", choices=("generate", "embed"))
    m.add_argument("--max-model-len", type=int)
    m.add_argument("--max-num-seqs", type=int)
    m.add_argument("--dtype")
    m.add_argument("--enforce-eager", action="store_true", help="skip graph compilation (faster start)")
    m.add_argument("--max-queued-sequences", type=int, default=1024, help="admission bound (then 503)")
    m.add_argument(
        "--no-paved-constraints", action="store_true", help="enforce JSON schemas with xgrammar only"
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default 8000; 0: any free port)")
    s.add_argument("--max-body-bytes", type=int, help="larger request bodies get 413")
    s.add_argument(
        "--max-buffered-body-bytes",
        type=int,
        help="chunked request bodies buffered at once, all requests together; then 503 "
        "(default 128 MiB, or --max-body-bytes if larger)",
    )
    s.add_argument("--drain-timeout", type=float, help="seconds to let in-flight requests finish on shutdown")
    s.add_argument(
        "--listen-fd",
        type=int,
        metavar="FD",
        help="also serve this inherited TCP socket (bound, not yet listening: the launcher's public "
        "port), listening on it only once every engine is ready, so until then it refuses "
        "connections; --port stays the private port for readiness checks",
    )
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    k = p.add_argument_group("KServe v2 (off unless a port is given)")
    k.add_argument("--kserve-grpc-port", type=int, help="KServe v2 gRPC port (0: any free port)")
    k.add_argument("--kserve-http-port", type=int, help="KServe v2 HTTP port (0: any free port)")
    k.add_argument(
        "--kserve-model-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="an XGBoost model directory served on KServe only (repeatable)",
    )
    k.add_argument(
        "--kserve-max-message-bytes",
        type=int,
        help="larger KServe gRPC messages / HTTP bodies are refused (default 64 MiB)",
    )
    k.add_argument(
        "--kserve-stream-max-in-flight",
        type=int,
        help="requests one ModelStreamInfer call runs at once; more get an in-band "
        "RESOURCE_EXHAUSTED (default 1024)",
    )
    k.add_argument(
        "--kserve-stream-queue-size",
        type=int,
        help="responses one ModelStreamInfer call holds for a slow client, then its requests "
        "pause (default 256)",
    )
    s.add_argument("--access-log", action="store_true", help="log every request (costs throughput)")
    return p


# In-process vLLM options that mean nothing for a remote engine (its server decides them).
_VLLM_ONLY = ("served_model_name", "max_num_seqs", "dtype", "enforce_eager", "no_paved_constraints")


def _remote_model(args: argparse.Namespace) -> RemoteModelConfig:
    name = args.model
    if not name and args.engine.startswith("sim://"):
        from paved.engine.sim import SimConfig

        name = SimConfig.from_uri(args.engine).model  # sim://MODEL names the simulated model
    if not name:
        raise ValueError("--engine needs --model NAME (the model's name on the remote server)")
    given = [f"--{f.replace('_', '-')}" for f in _VLLM_ONLY if getattr(args, f) not in (None, False)]
    if given:
        raise ValueError(f"{', '.join(given)}: only for in-process vLLM, not with --engine")
    uri = args.engine
    extra = {"max_model_len": args.max_model_len, "kind": args.kind}
    query = "&".join(f"{k}={v}" for k, v in extra.items() if v is not None)
    if query:
        uri += ("&" if "?" in uri else "?") + query
    model = RemoteModelConfig(name=name, engine=uri, max_queued_sequences=args.max_queued_sequences)
    model.validate()
    return model


def _config(args: argparse.Namespace) -> ServerConfig:
    if args.engine and args.config:
        raise ValueError("--engine goes with --model; in a --config file, set `engine` on the model")
    if args.engine:
        config = ServerConfig(models=[_remote_model(args)])
    elif args.config:
        config = config_file.load(args.config)
    elif args.model:
        model = VllmModelConfig(
            name=args.served_model_name or os.path.basename(os.path.normpath(args.model)),
            path=args.model,
            kind=args.kind or "generate",
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            dtype=args.dtype or "auto",
            enforce_eager=args.enforce_eager,
            paved_constraints=not args.no_paved_constraints,
            max_queued_sequences=args.max_queued_sequences,
        )
        model.validate()
        config = ServerConfig(models=[model])
    else:
        # The fixture: small context and batch, eager mode (boots ~20 s faster on CPU).
        tiny = VllmModelConfig(
            name="tiny",
            path=tiny_model_dir(),
            dtype="float32",
            max_model_len=2048,
            max_num_seqs=32,
            enforce_eager=True,
        )
        config = ServerConfig(models=[tiny])
    for flag, key in (
        ("host", "host"),
        ("port", "port"),
        ("max_body_bytes", "max_body_bytes"),
        ("max_buffered_body_bytes", "max_buffered_body_bytes"),
        ("drain_timeout", "drain_timeout_s"),
        ("kserve_grpc_port", "kserve_grpc_port"),
        ("kserve_http_port", "kserve_http_port"),
        ("kserve_max_message_bytes", "kserve_max_message_bytes"),
        ("kserve_stream_max_in_flight", "kserve_stream_max_in_flight"),
        ("kserve_stream_queue_size", "kserve_stream_queue_size"),
    ):
        value = getattr(args, flag)
        if value is not None:
            setattr(config, key, value)
    config.kserve_model_dirs = [*config.kserve_model_dirs, *args.kserve_model_dir]
    config.validate()
    return config


def _kserve(config: ServerConfig, models: ModelRegistry):
    """The KServe v2 server over the registry's engines, sharing its admission bound and its
    draining flag, or None when no KServe port is configured."""
    if not config.kserve:
        return None
    from paved.kserve.server import KServeServer
    from paved.kserve.xgboost_model import XGBoostModel

    # Any: mypy checks a **dict against every keyword of KServeServer, not just these three.
    limits: dict[str, Any] = {
        name: value
        for name, value in (
            ("max_message_bytes", config.kserve_max_message_bytes),
            ("stream_max_in_flight", config.kserve_stream_max_in_flight),
            ("stream_queue_size", config.kserve_stream_queue_size),
        )
        if value is not None
    }
    return KServeServer(
        models.engines,
        [XGBoostModel.from_directory(d) for d in config.kserve_model_dirs],
        host=config.host,
        grpc_port=config.kserve_grpc_port,
        http_port=config.kserve_http_port,
        admission=lambda model, n: models.admit(models.get(model), n),
        draining=lambda: models.draining,
        **limits,
    )


def settle_process() -> None:
    """Once every engine has started, what vLLM's own engine-core and worker processes do after
    theirs. Start-up's objects (a vLLM process holds ~700k: torch, transformers, configs) are
    frozen out of the garbage collector's reach, so a full collection under load no longer walks
    them with the event loop stalled (0.1-0.3 s each here). And with vLLM in this process, its
    environment variables are read once from now on (vllm.envs.enable_envs_cache): AsyncLLM's
    output handler otherwise parses os.environ for every generated token."""
    gc.collect()
    gc.freeze()
    envs = sys.modules.get("vllm.envs")  # imported only if an engine here runs vLLM
    if envs is not None:
        envs.enable_envs_cache()


class _Server(uvicorn.Server):
    """uvicorn, plus: readiness turns 503 the moment a shutdown signal arrives (load balancers
    stop routing here while in-flight requests drain), and a failed engine start ends it."""

    def __init__(self, config: uvicorn.Config, models: ModelRegistry, public: socket.socket | None = None):
        super().__init__(config)
        self.models = models
        self.failed = False
        # --listen-fd's socket, served once the engines are ready (`engines_started`).
        self.public = public
        self._engines_started = asyncio.Event()
        self._public_task: asyncio.Task | None = None

    def engines_started(self) -> None:
        settle_process()
        self._engines_started.set()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.public is not None and not self.should_exit:
            self._public_task = asyncio.create_task(self._serve_public(self.public))

    async def _serve_public(self, sock: socket.socket) -> None:
        """Listen on the public socket once the engines are ready. Its server joins
        `self.servers`, so a shutdown closes it first (new connections are refused) and drains
        its connections with the others."""
        await self._engines_started.wait()
        if self.should_exit:
            return
        config = self.config

        def protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            # As uvicorn's startup builds its own listeners' protocols.
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=_loop
            )

        # Its connections' TIME_WAIT then does not block the next server's bind of this port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server = await asyncio.get_running_loop().create_server(protocol, sock=sock, backlog=LISTEN_BACKLOG)
        self.servers.append(server)
        host, port = sock.getsockname()[:2]
        logger.info("serving the public port %s:%d (listen fd %d)", host, port, sock.fileno())

    def handle_exit(self, sig, frame) -> None:
        self.models.draining = True
        super().handle_exit(sig, frame)

    def fail(self, _: BaseException) -> None:
        self.failed = True
        self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = _config(args)
        # vLLM is imported only once the flags are valid, and only if a model runs in-process.
        models = ModelRegistry(
            [make_engine(m) for m in config.models], {m.name: m.max_queued_sequences for m in config.models}
        )
        kserve = _kserve(config, models)
    except (OSError, ValueError) as e:
        print(f"serve: {e}", file=sys.stderr)
        return 2
    server: _Server | None = None

    def start_failed(error: BaseException) -> None:
        if server is not None:
            server.fail(error)

    def engines_started() -> None:
        if server is not None:
            server.engines_started()

    def kserve_started(k) -> None:
        # Tests and scripts read this line for the (possibly ephemeral) KServe ports.
        print(f"paved frontend: KServe v2 gRPC {k.grpc_port} HTTP {k.http_port} on {k.host}", flush=True)

    app = create_app(
        models,
        max_body_bytes=config.max_body_bytes,
        max_buffered_body_bytes=config.max_buffered_body_bytes,
        on_start_failure=start_failed,
        on_started=engines_started,
        kserve=kserve,
        on_kserve_started=kserve_started,
        kserve_grace_s=min(config.drain_timeout_s, 30.0),
    )
    if kserve is not None:
        # Its request metrics (paved_kserve_*) on the frontend's /metrics: set before the
        # lifespan starts it, which is when it registers them.
        kserve.metrics_registry = app.state.paved.metrics.registry
    try:
        sock = bind(config.host, config.port)
    except OSError as e:
        print(f"serve: cannot listen on {config.host}:{config.port}: {e}", file=sys.stderr)
        return 2
    public = None
    if args.listen_fd is not None:
        try:
            public = adopt(args.listen_fd)
        except (OSError, ValueError) as e:
            sock.close()
            print(f"serve: --listen-fd {args.listen_fd}: {e}", file=sys.stderr)
            return 2
    host, port = sock.getsockname()[:2]
    uv_config = uvicorn.Config(
        app,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=args.access_log,
        log_level=args.log_level,
        timeout_keep_alive=SERVER_KEEPALIVE_S,
        backlog=LISTEN_BACKLOG,
        # uvicorn annotates int but hands it to asyncio.wait_for, which takes fractions too.
        timeout_graceful_shutdown=config.drain_timeout_s,  # type: ignore[arg-type]
    )
    server = _Server(uv_config, models, public)
    shown = f"[{host}]" if ":" in host else host
    names = ", ".join(m.name for m in config.models)
    # Tests and scripts read this line for the (possibly ephemeral) port.
    print(f"paved frontend: serving {names} on http://{shown}:{port} (ready: /health/ready)", flush=True)
    # uvicorn re-raises the shutdown signal once drained; exit cleanly rather than by signal.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.run(sockets=[sock])
    return 1 if server.failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""A standalone KServe v2 server: a Triton model repository and classic model directories,
optionally with vLLM models.

    tools/bazel run //services/kserve:serve -- [--model-repository DIR] [--model-dir DIR ...]
        [--llm-config FILE]
        [--host H] [--grpc-port 8001] [--http-port 8000] [--max-message-bytes N]
        [--stream-max-in-flight N] [--stream-queue-size N]

`--model-repository` (Triton's flag) serves every model directory of DIR (config.pbtxt or
config.json, numbered version folders; docs/kserve.md "Triton model repositories"): a model
whose config or backend is refused is listed UNAVAILABLE with the reason and the rest serve.
Without --model-repository / --model-dir / --llm-config it serves the //models/xgb fixture.
`--llm-config` takes the OpenAI frontend's config file (its [[models]] entries become
in-process vLLM engines). The listeners bind first and answer ServerReady false until every model
and engine is loaded; SIGINT / SIGTERM stop it gracefully. `GET /metrics` on the HTTP port
answers its request metrics (paved.kserve.metrics) and process metrics. LLM and embedding
requests are admitted by the frontend's `ModelRegistry` over the same engines, so each model's
`max_queued_sequences` (default 1024, set per model in the config file) bounds them here as it
does there. In the OpenAI frontend's process the same server runs beside the OpenAI API through
`paved.kserve.server.serve_kserve` instead.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from paved.kserve.grpc_server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_STREAM_MAX_IN_FLIGHT,
    DEFAULT_STREAM_QUEUE_SIZE,
)

logger = logging.getLogger("paved.kserve")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model-repository", metavar="DIR", help="Triton model repository: every subdirectory is a model"
    )
    p.add_argument("--model-dir", action="append", default=[], metavar="DIR", help="XGBoost model directory")
    p.add_argument("--llm-config", metavar="FILE", help="the OpenAI frontend's TOML/JSON model config")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=8001, help="0: any free port; -1: no gRPC")
    p.add_argument("--http-port", type=int, default=8000, help="0: any free port; -1: no HTTP")
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="larger gRPC messages / HTTP bodies are refused (RESOURCE_EXHAUSTED / 413)",
    )
    p.add_argument(
        "--stream-max-in-flight",
        type=int,
        default=DEFAULT_STREAM_MAX_IN_FLIGHT,
        help="requests one ModelStreamInfer call runs at once; more: in-band RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--stream-queue-size",
        type=int,
        default=DEFAULT_STREAM_QUEUE_SIZE,
        help="responses one ModelStreamInfer call holds for a slow client (then its requests pause)",
    )
    p.add_argument(
        "--exit-on-error",
        type=_flag,
        default=False,
        metavar="BOOL",
        help="Triton's flag: exit (status 1, the reasons on stderr) if a model of the repository "
        "fails to load at startup; default false: serve the others, the failed ones listed "
        "UNAVAILABLE with their reason",
    )
    p.add_argument(
        "--strict-readiness",
        type=_flag,
        default=True,
        metavar="BOOL",
        help="Triton's flag: ServerReady only once every model is ready (default true); false: "
        "ready while the server serves",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def _flag(value: str) -> bool:
    """Triton's boolean flag values."""
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _models(config_path: str | None) -> list:
    if not config_path:
        return []
    from paved.engine import vllm_env

    vllm_env.apply_defaults()  # before anything that may import vLLM
    from paved.frontend import config as config_file

    return config_file.load(config_path).models


def _engines(models: list) -> list:
    if not models:
        return []
    from paved.frontend import config as config_file

    return [config_file.make_engine(m) for m in models]


def _validate(args: argparse.Namespace) -> None:
    if args.model_repository is not None and not os.path.isdir(args.model_repository):
        raise ValueError(f"--model-repository {args.model_repository}: not a directory")
    if args.max_message_bytes < 1024:
        raise ValueError(f"--max-message-bytes must be at least 1024, got {args.max_message_bytes}")
    for flag in ("stream_max_in_flight", "stream_queue_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")


async def start_server(args: argparse.Namespace, engines: list, limits: dict[str, int]):
    """The registry admitting requests to `engines` and the started KServe server over both."""
    from paved.frontend.registry import ModelRegistry
    from paved.kserve.server import registry_admission, serve_kserve

    registry = ModelRegistry(engines, limits)
    server = await serve_kserve(
        engines,
        grpc_port=None if args.grpc_port < 0 else args.grpc_port,
        http_port=None if args.http_port < 0 else args.http_port,
        host=args.host,
        model_dirs=args.model_dir,
        model_repository=args.model_repository,
        max_message_bytes=args.max_message_bytes,
        admission=registry_admission(registry),
        draining=lambda: registry.draining,
        stream_max_in_flight=args.stream_max_in_flight,
        stream_queue_size=args.stream_queue_size,
        strict_readiness=args.strict_readiness,
    )
    return registry, server


async def _serve(args: argparse.Namespace, engines: list, limits: dict[str, int]) -> int:
    registry, server = await start_server(args, engines, limits)
    # Scripts and tests read this line for the (possibly ephemeral) ports.
    print(f"paved kserve: gRPC {server.grpc_port} HTTP {server.http_port} on {args.host}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    failed = False
    if args.exit_on_error:
        await server.wait_ready()
        # The repository's models (an engine that fails to start ends the server anyway).
        classic = [m for versions in server.repository.classic.values() for m in versions.values()]
        refused = [m for m in classic if m.state()[0] == "UNAVAILABLE"]
        if refused:
            for model in refused:
                version = f" version {model.version}" if model.version else ""
                reason = model.state()[1]
                print(f"serve: model '{model.name}'{version} failed to load: {reason}", file=sys.stderr)
            print("serve: exiting (--exit-on-error)", file=sys.stderr)
            failed = True
            stop.set()

    async def start_engines() -> None:
        nonlocal failed
        try:
            await registry.start()  # one engine at a time: each boot saturates a core
        except Exception:
            logger.exception("an engine failed to start")
            failed = True
            stop.set()

    boot = asyncio.create_task(start_engines())
    await stop.wait()
    registry.draining = True
    boot.cancel()
    await asyncio.gather(boot, return_exceptions=True)
    await server.stop()
    for engine in reversed(engines):
        await engine.stop()
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not args.model_dir and not args.llm_config and not args.model_repository:
        from paved.runfiles import runfile

        args.model_dir = [os.path.dirname(runfile("models/xgb/config.json"))]
    try:
        _validate(args)
        models = _models(args.llm_config)
        engines = _engines(models)
        limits = {m.name: m.max_queued_sequences for m in models}
        return asyncio.run(_serve(args, engines, limits))
    except (OSError, ValueError) as e:
        print(f"serve: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

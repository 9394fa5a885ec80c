"""A standalone KServe v2 server: classic model directories, optionally with vLLM models.

    tools/bazel run //services/kserve:serve -- [--model-dir DIR ...] [--llm-config FILE]
        [--host H] [--grpc-port 8001] [--http-port 8000]

Without --model-dir / --llm-config it serves the //models/xgb fixture. `--llm-config` takes
the OpenAI frontend's config file (its [[models]] entries become in-process vLLM engines).
The listeners bind first and answer ServerReady false until every model and engine is
loaded; SIGINT / SIGTERM stop it gracefully. In the OpenAI frontend's process the same server
runs beside the OpenAI API through `paved.kserve.server.serve_kserve` instead.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from paved.kserve.grpc_server import DEFAULT_MAX_MESSAGE_BYTES

logger = logging.getLogger("paved.kserve")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-dir", action="append", default=[], metavar="DIR", help="XGBoost model directory")
    p.add_argument("--llm-config", metavar="FILE", help="the OpenAI frontend's TOML/JSON model config")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=8001, help="0: any free port; -1: no gRPC")
    p.add_argument("--http-port", type=int, default=8000, help="0: any free port; -1: no HTTP")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def _engines(config_path: str | None) -> list:
    if not config_path:
        return []
    from paved.engine import vllm_env

    vllm_env.apply_defaults()
    from paved.frontend import config as config_file

    return [config_file.make_engine(m) for m in config_file.load(config_path).models]


async def _serve(args: argparse.Namespace, engines: list) -> int:
    from paved.kserve.server import serve_kserve

    server = await serve_kserve(
        engines,
        grpc_port=None if args.grpc_port < 0 else args.grpc_port,
        http_port=None if args.http_port < 0 else args.http_port,
        host=args.host,
        model_dirs=args.model_dir,
        max_message_bytes=args.max_message_bytes,
    )
    # Scripts and tests read this line for the (possibly ephemeral) ports.
    print(f"paved kserve: gRPC {server.grpc_port} HTTP {server.http_port} on {args.host}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    failed = False

    async def start_engines() -> None:
        nonlocal failed
        for engine in engines:  # one at a time: each boot saturates a core
            try:
                await engine.start()
            except Exception:
                logger.exception("an engine failed to start")
                failed = True
                stop.set()
                return

    boot = asyncio.create_task(start_engines())
    await stop.wait()
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
    if not args.model_dir and not args.llm_config:
        from paved.runfiles import runfile

        args.model_dir = [os.path.dirname(runfile("models/xgb/config.json"))]
    try:
        engines = _engines(args.llm_config)
        return asyncio.run(_serve(args, engines))
    except (OSError, ValueError) as e:
        print(f"serve: {e}", file=sys.stderr)
        return 2

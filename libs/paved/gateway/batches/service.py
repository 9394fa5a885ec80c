"""Files + Batches for one gateway replica: the API routes and the runner over one store.

batches = Batches.build(store, proxy, objects=LocalObjectStore(dir))
routes = batches.api.routes()          # appended to the gateway app
await batches.start() ... await batches.stop()   # the gateway's on_start / on_stop
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from paved.gateway.batches.api import BatchesAPI
from paved.gateway.batches.objects import LocalObjectStore, ObjectStore
from paved.gateway.batches.runner import BatchMetrics, BatchRunner, RunnerConfig
from paved.gateway.batches.store import BatchStore
from paved.gateway.batches.validate import Limits

if TYPE_CHECKING:
    from paved.gateway.access.state import GatewayStore
    from paved.gateway.forwarding.proxy import OpenAIProxy


@dataclass
class Batches:
    store: BatchStore
    api: BatchesAPI
    runner: BatchRunner | None

    @classmethod
    def build(
        cls,
        accounts: GatewayStore,
        proxy: OpenAIProxy,
        *,
        objects: ObjectStore,
        limits: Limits | None = None,
        runner: RunnerConfig | None = None,
        run: bool = True,
        clock: Callable[[], float] = time.time,
        window_s: float | None = None,
    ) -> Batches:
        """`run=False`: this replica serves the API but runs no lines (another one does)."""
        store = BatchStore(accounts)
        api = BatchesAPI(
            authenticator=proxy.authenticator,
            store=store,
            objects=objects,
            router=proxy.router,
            limits=limits or Limits(),
            default_max_tokens=proxy.config.default_max_tokens,
            clock=clock,
            window_s=window_s,
        )
        batch_runner = (
            BatchRunner(
                store, objects, proxy, accounts, BatchMetrics(proxy.metrics.registry), runner, clock=clock
            )
            if run
            else None
        )
        if batch_runner is not None:
            api.on_create = batch_runner.wake
        return cls(store=store, api=api, runner=batch_runner)

    async def start(self) -> None:
        await self.store.start()
        if self.runner is not None:
            await self.runner.start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.stop()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The gateway main's batch flags."""
    g = p.add_argument_group("batches (OpenAI Files + Batches API)")
    g.add_argument(
        "--files-dir",
        help="where batch files live (default $PAVED_STATE_DIR/gateway-files; replicas sharing "
        "one database need one shared directory, or S3)",
    )
    g.add_argument("--files-s3-bucket", help="keep batch files in this S3 bucket instead of --files-dir")
    g.add_argument("--files-s3-endpoint", help="the S3 endpoint URL (default: AWS, or $AWS_ENDPOINT_URL)")
    g.add_argument("--files-s3-prefix", default="paved-gateway", help="key prefix in the bucket")
    g.add_argument("--batch-max-lines", type=int, default=50_000, help="requests per batch file (50,000)")
    g.add_argument(
        "--batch-max-bytes", type=int, default=200 * 1024 * 1024, help="bytes per batch file (200 MB)"
    )
    g.add_argument("--batch-concurrency", type=int, default=32, help="batch lines this replica runs at once")
    g.add_argument(
        "--batch-max-active",
        type=int,
        default=100,
        help="unfinished batches a tenant may have at once; more is a 429 (default 100)",
    )
    g.add_argument("--batch-lease", type=float, default=30.0, help="seconds a line's lease lasts unrenewed")
    g.add_argument(
        "--batch-token-share",
        type=float,
        default=0.5,
        help="of a tenant's tokens/min, the share its batches may use, counted over all replicas "
        "in the state database (default 0.5)",
    )
    g.add_argument(
        "--batch-retention",
        type=float,
        default=30 * 24 * 3600.0,
        help="seconds a finished batch and its output / error files are kept (default 30 days)",
    )
    g.add_argument(
        "--batch-chunk-lines",
        type=int,
        default=1000,
        help="output lines per chunk written to the file store while a batch runs (default 1000)",
    )
    g.add_argument(
        "--batch-chunk-seconds",
        type=float,
        default=10.0,
        help="the longest a finished line waits for its output chunk (default 10)",
    )
    g.add_argument("--batch-window", type=float, default=24 * 3600.0, help=argparse.SUPPRESS)
    g.add_argument("--no-batch-runner", action="store_true", help="serve the API, run no batch lines here")


def check_arguments(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if args.batch_max_lines < 1 or args.batch_max_bytes < 1:
        p.error("--batch-max-lines and --batch-max-bytes must be at least 1")
    if args.batch_concurrency < 1:
        p.error("--batch-concurrency must be at least 1")
    if not 1 <= args.batch_max_active <= 1_000_000:
        p.error("--batch-max-active must be in [1, 1000000]")
    if not (args.batch_lease > 0 and args.batch_window > 0):
        p.error("--batch-lease and --batch-window must be positive")
    if not 0 < args.batch_token_share <= 1:
        p.error("--batch-token-share must be in (0, 1]")
    if not args.batch_retention > 0:
        p.error("--batch-retention must be positive")
    if args.batch_chunk_lines < 1 or not args.batch_chunk_seconds > 0:
        p.error("--batch-chunk-lines must be at least 1 and --batch-chunk-seconds positive")
    if args.files_s3_endpoint and not args.files_s3_bucket:
        p.error("--files-s3-endpoint needs --files-s3-bucket")


def _default_files_dir(state: str | None) -> Path:
    """Beside the gateway's SQLite state when it has one (the replica's own disk, which it can
    write), else under $PAVED_STATE_DIR or the user's data dir."""
    if state and state.startswith("sqlite:///"):
        return Path(state.removeprefix("sqlite:///")).parent / "gateway-files"
    return Path(os.environ.get("PAVED_STATE_DIR") or Path.home() / ".local/share/paved") / "gateway-files"


def from_arguments(args: argparse.Namespace, accounts: GatewayStore, proxy: OpenAIProxy) -> Batches:
    objects: ObjectStore
    if args.files_s3_bucket:
        from paved.gateway.batches.objects import S3ObjectStore, s3_client

        objects = S3ObjectStore(s3_client(args.files_s3_endpoint), args.files_s3_bucket, args.files_s3_prefix)
    else:
        objects = LocalObjectStore(args.files_dir or _default_files_dir(getattr(args, "state", None)))
    return Batches.build(
        accounts,
        proxy,
        objects=objects,
        limits=Limits(
            max_lines=args.batch_max_lines,
            max_bytes=args.batch_max_bytes,
            max_active_batches=args.batch_max_active,
        ),
        runner=RunnerConfig(
            concurrency=args.batch_concurrency,
            lease_s=args.batch_lease,
            token_share=args.batch_token_share,
            retention_s=args.batch_retention,
            chunk_lines=args.batch_chunk_lines,
            chunk_s=args.batch_chunk_seconds,
        ),
        run=not args.no_batch_runner,
        window_s=args.batch_window,
    )

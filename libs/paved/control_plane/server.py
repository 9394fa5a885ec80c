"""The control-plane main: `python -m paved.control_plane.server` (`tools/bazel run
//services/control_plane:serve`).

State in SQLite by default, PostgreSQL (`--state postgresql://...`) for two replicas: both
serve the API; only the one holding the leader lock (a PostgreSQL advisory lock, or a file
lock next to the SQLite file) runs the controller, and a follower that takes the lock adopts
the running replicas and resumes every rollout from its persisted phase.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from paved.control_plane.analysis import GatewayAnalyzer
from paved.control_plane.api import create_app
from paved.control_plane.controller import Controller
from paved.control_plane.dashboard import dashboard_router, gateway_origin
from paved.control_plane.driver import Driver
from paved.control_plane.errors import BadRequest
from paved.control_plane.kube_driver import KubeDriver, api_client
from paved.control_plane.kube_objects import KubeSettings
from paved.control_plane.leader import LeaderLock, lead
from paved.control_plane.local_driver import LocalDriver
from paved.control_plane.metrics_source import check_prometheus_url, parse_metrics_source
from paved.control_plane.prometheus import FileSdWriter, discover, metrics_endpoint, prometheus_router
from paved.control_plane.routes_feed import RoutesFeed
from paved.control_plane.store import ControlStore
from paved.gateway.access.auth import AdminAuth, admin_key_for_run, configured_admin_key, load_admin_key
from paved.http.sockets import SERVER_KEEPALIVE_S, bind

logger = logging.getLogger("paved.control_plane")


class _Server(uvicorn.Server):
    """uvicorn without its signal capture: the loop's handlers stop it, so the controller's
    shutdown runs (replicas keep running: a restarted control plane adopts them)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _state_dir() -> Path:
    return Path(os.environ.get("PAVED_STATE_DIR") or Path.home() / ".local/share/paved")


def _region(value: str) -> tuple[str, tuple[int, int]]:
    name, _, ports = value.partition("=")
    low, _, high = ports.partition("-")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--region {value!r}: expected NAME=LOW-HIGH (ports)") from None
    if not name or not 1024 <= lo < hi <= 65535 or hi - lo < 3:
        raise argparse.ArgumentTypeError(
            f"--region {value!r}: NAME=LOW-HIGH with 1024 <= LOW < HIGH <= 65535"
        )
    return name, (lo, hi)


def _kube_region(value: str) -> tuple[str, str]:
    name, _, context = value.partition("=")
    if not name or not context:
        raise argparse.ArgumentTypeError(
            f"--kube-region {value!r}: expected NAME=CONTEXT (or NAME=in-cluster)"
        )
    return name, context


def _drivers(args: argparse.Namespace, work_dir: Path) -> dict[str, Driver]:
    """The region drivers the flags name; BadRequest (exit 2) for an unusable combination."""
    if args.driver == "local":
        if args.kube_region:
            raise BadRequest("--kube-region needs --driver kubernetes")
        regions = dict(args.region or [("local", (30000, 30999))])
        return {
            name: LocalDriver(
                name,
                port_range=ports,
                work_dir=work_dir / name,
                cache_dir=Path(args.cache_dir) if args.cache_dir else None,
                s3_endpoint_url=args.s3_endpoint_url,
                drain_timeout_s=args.drain_timeout,
            )
            for name, ports in regions.items()
        }
    if args.region:
        raise BadRequest("--region is for --driver local; a kubernetes region is --kube-region NAME=CONTEXT")
    if not args.kube_region:
        raise BadRequest("--driver kubernetes needs at least one --kube-region NAME=CONTEXT")
    settings = KubeSettings(
        namespace=args.kube_namespace,
        image=args.kube_image,
        model_cache=args.kube_model_cache,
        drain_timeout_s=args.drain_timeout,
        gpu_resource=args.kube_gpu_resource,
        cpu=args.kube_cpu,
        memory=args.kube_memory,
        s3_endpoint_url=args.s3_endpoint_url,
    ).validate()
    return {
        name: KubeDriver(
            name, client=api_client(context=context, kubeconfig=args.kubeconfig), settings=settings
        )
        for name, context in dict(args.kube_region).items()
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="control_plane", description="paved's control plane.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8090, help="API port (default 8090; 0: any)")
    p.add_argument("--state", help="sqlite:///PATH (default under $PAVED_STATE_DIR) or postgresql://...")
    p.add_argument("--admin-key-file", help="file holding the admin key (else $PAVED_ADMIN_KEY)")
    p.add_argument(
        "--region",
        action="append",
        type=_region,
        metavar="NAME=LOW-HIGH",
        help="a region of local replicas and its port range (repeatable; default local=30000-30999)",
    )
    p.add_argument(
        "--driver",
        choices=("local", "kubernetes"),
        default="local",
        help="local: replicas are processes on this host (--region); kubernetes: pods on clusters "
        "(--kube-region, one kube context per region; docs/kubernetes.md)",
    )
    p.add_argument(
        "--kube-region",
        action="append",
        type=_kube_region,
        metavar="NAME=CONTEXT",
        help="a region on a cluster: a context of --kubeconfig, or 'in-cluster' (repeatable)",
    )
    p.add_argument("--kubeconfig", help="kubeconfig file for --kube-region contexts (default ~/.kube/config)")
    p.add_argument("--kube-namespace", default="paved", help="namespace of the replicas' objects")
    p.add_argument("--kube-image", default="", help="the launcher image, pinned by digest (NAME@sha256:...)")
    p.add_argument(
        "--kube-model-cache",
        default="",
        help="pvc:CLAIM or host:/PATH for the launchers' model cache (default: an emptyDir per pod)",
    )
    p.add_argument(
        "--kube-gpu-resource",
        default="nvidia.com/gpu",
        help="the extended resource a package's GPUs are requested as ('' on a CPU cluster)",
    )
    p.add_argument("--kube-cpu", default="2", help="CPU request of a replica pod")
    p.add_argument("--kube-memory", default="8Gi", help="memory request and limit of a replica pod")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds a draining replica has to finish its requests (a pod's grace period adds preStop)",
    )
    p.add_argument("--work-dir", help="replica logs and metrics dirs (default under $PAVED_STATE_DIR)")
    p.add_argument("--cache-dir", help="the launchers' model cache (default theirs)")
    p.add_argument("--s3-endpoint-url", help="for s3:// packages (e.g. a loopback S3)")
    p.add_argument(
        "--gateway-metrics",
        action="append",
        default=[],
        metavar="URL",
        help="a gateway's /metrics, read for rollout analysis and the dashboard (repeatable)",
    )
    p.add_argument(
        "--gateway-admin",
        action="append",
        default=[],
        metavar="URL",
        help="a gateway (http://HOST:PORT) whose batches the dashboard lists through its read-only "
        "GET /admin/v1/batches (repeatable; default: the origin of each --gateway-metrics URL, "
        "where the gateway serves its admin API too)",
    )
    p.add_argument(
        "--gateway-admin-key-file",
        metavar="PATH",
        help="file holding the gateways' admin key, sent only to --gateway-admin (default: this "
        "control plane's own admin key; `paved up` gives both one key)",
    )
    p.add_argument(
        "--prometheus-file-sd",
        metavar="PATH",
        help="keep PATH a Prometheus file_sd JSON file listing the ready replicas' metrics endpoints, "
        "the gateways and this control plane (the same as GET /v1/prometheus/targets); rewritten "
        "atomically whenever the set changes",
    )
    p.add_argument(
        "--metrics-source",
        default="scrape",
        metavar="scrape|prometheus=URL",
        help="where rollout analysis and the autoscaler read metrics: scrape (the gateways' "
        "--gateway-metrics and every ready replica's metrics endpoint, read here; default) or "
        "prometheus=URL (the same series by PromQL from a Prometheus scraping the fleet with "
        "this control plane's service discovery)",
    )
    p.add_argument(
        "--prometheus-url",
        metavar="URL",
        help="a Prometheus holding paved's recorded series: the dashboard links each model to its graphs",
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between reconcile passes")
    p.add_argument(
        "--health-timeout", type=float, default=900.0, help="seconds a replica may take to be ready"
    )
    p.add_argument(
        "--replica-retention",
        type=float,
        default=7 * 24 * 3600.0,
        help="seconds a stopped or failed replica's record is kept (its audit events stay; 0: "
        "forever; default 7 days)",
    )
    p.add_argument(
        "--drain-delay",
        type=float,
        default=2.0,
        help="seconds between taking a replica out of the routes and stopping it: how long the "
        "gateways may take to see a routes change (default 2)",
    )
    p.add_argument(
        "--no-smoke", action="store_true", help="readiness without the structured smoke generation"
    )
    p.add_argument(
        "--stop-replicas-on-exit",
        action="store_true",
        help="drain every replica on shutdown (default: leave them running for the next leader to adopt)",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def _prepare(args: argparse.Namespace) -> tuple[str, Path]:
    state_dir = _state_dir()
    state = args.state or f"sqlite:///{state_dir / 'control_plane.sqlite'}"
    if state.startswith("sqlite:///"):
        Path(state.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(args.work_dir or state_dir / "replicas")
    work_dir.mkdir(parents=True, exist_ok=True)
    return state, work_dir


async def _serve(args: argparse.Namespace, state: str, drivers: dict[str, Driver]) -> int:
    admin_key = admin_key_for_run(args.admin_key_file, "control plane")
    admin = AdminAuth(admin_key)
    store = ControlStore(state)
    await store.start()
    feed = RoutesFeed(store)
    analyzer = GatewayAnalyzer(source=parse_metrics_source(args.metrics_source, args.gateway_metrics))
    if not analyzer.configured:
        logger.warning(
            "no --gateway-metrics: rollout analysis sees no traffic, so each phase passes after its "
            "inconclusive intervals; give the gateways' /metrics URLs to gate phases on errors and latency"
        )
    controller = Controller(
        store,
        drivers,
        feed,
        analyzer,
        interval_s=args.interval,
        health_timeout_s=args.health_timeout,
        smoke=not args.no_smoke,
        drain_delay_s=args.drain_delay,
        replica_retention_s=args.replica_retention,
    )
    leader = LeaderLock(state)
    dashboard = dashboard_router(
        store,
        controller,
        admin.check,
        gateway_metrics=args.gateway_metrics,
        prometheus_url=args.prometheus_url,
        gateway_admin=args.gateway_admin or args.gateway_metrics,
        gateway_admin_key=(
            load_admin_key(args.gateway_admin_key_file) if args.gateway_admin_key_file else admin_key
        ),
    )
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    own_metrics = f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"
    prometheus = prometheus_router(
        store,
        admin.check,
        gateway_metrics=args.gateway_metrics,
        control_plane_metrics=lambda: own_metrics,
        is_leader=lambda: leader.is_leader,
    )
    app = create_app(
        store, controller, feed, admin.check, leader=leader, extra_routers=[dashboard, prometheus],
        s3_endpoint_url=args.s3_endpoint_url,
    )  # fmt: skip
    file_sd = (
        FileSdWriter(
            args.prometheus_file_sd,
            lambda: discover(store, args.gateway_metrics, own_metrics),
            interval_s=min(args.interval, 5.0),
        )
        if args.prometheus_file_sd
        else None
    )

    announced = False

    async def start_leading() -> None:
        nonlocal announced
        if not announced:  # (a start that failed is retried: one event)
            await store.audit("leader", f"control plane pid {os.getpid()} became the leader")
            announced = True
        await analyzer.start()
        await controller.start()

    def report(error: str | None) -> None:
        controller.last_error = error

    async def lead_then_exit() -> None:
        # Followers serve the API; the lock's holder runs the controller.
        await lead(leader, start_leading, controller.stop, report)
        logger.error("lost the leader lock; stopping")
        server.should_exit = True

    config = uvicorn.Config(
        app,
        loop="none",
        http="httptools",
        log_level="warning",
        access_log=False,
        timeout_keep_alive=SERVER_KEEPALIVE_S,
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    leading = asyncio.ensure_future(lead_then_exit())
    if file_sd is not None:
        # Every control plane replica writes it (followers too): the store is shared, and a
        # Prometheus next to a follower must not lose the fleet.
        await file_sd.start()
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    # uvicorn exposes no started event; a bounded poll (it binds an already-open socket).
    for _ in range(3000):
        if server.started or serving.done():
            break
        await asyncio.sleep(0.01)
    print(f"serving control plane on http://{host}:{port}", flush=True)
    try:
        await serving
    finally:
        leading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leading
        if file_sd is not None:
            await file_sd.stop()
        await controller.stop()
        if args.stop_replicas_on_exit and leader.is_leader:
            await controller.drain_all()
        await analyzer.stop()
        for driver in drivers.values():
            await driver.close()
        await leader.release()
        await store.close()
        sock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        print("control plane: --port must be 0..65535", file=sys.stderr)
        return 2
    for flag, value, low, high in (
        ("--interval", args.interval, 0.05, 3600.0),
        ("--health-timeout", args.health_timeout, 1.0, 86400.0),
        ("--drain-delay", args.drain_delay, 0.0, 300.0),
        ("--drain-timeout", args.drain_timeout, 0.1, 3600.0),
        ("--replica-retention", args.replica_retention, 0.0, 10 * 365 * 86400.0),
    ):
        # A nan or a zero interval would spin the reconcile loop; comparisons reject nan.
        if not low <= value <= high:
            print(f"control plane: {flag} must be within {low:g}..{high:g} seconds", file=sys.stderr)
            return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvloop

    for url in args.gateway_metrics:
        try:
            metrics_endpoint(url)
        except ValueError as e:
            print(f"control plane: --gateway-metrics: {e}", file=sys.stderr)
            return 2
    for url in args.gateway_admin:
        try:
            gateway_origin(url)
        except ValueError as e:
            print(f"control plane: --gateway-admin: {e}", file=sys.stderr)
            return 2
    for flag, check in (
        # A bad key file or $PAVED_ADMIN_KEY is a usage error, not a traceback from the loop.
        ("admin key", lambda: configured_admin_key(args.admin_key_file)),
        (
            "--gateway-admin-key-file",
            lambda: args.gateway_admin_key_file is None or load_admin_key(args.gateway_admin_key_file),
        ),
        ("--metrics-source", lambda: parse_metrics_source(args.metrics_source)),
        (
            "--prometheus-url",
            lambda: args.prometheus_url is None or check_prometheus_url(args.prometheus_url),
        ),
    ):
        try:
            check()
        except ValueError as e:
            print(f"control plane: {flag}: {e}", file=sys.stderr)
            return 2
    if args.prometheus_file_sd is not None:
        sd_dir = Path(args.prometheus_file_sd).parent
        if (
            not args.prometheus_file_sd.strip()
            or Path(args.prometheus_file_sd).is_dir()
            or not sd_dir.is_dir()
        ):
            print(
                f"control plane: --prometheus-file-sd {args.prometheus_file_sd!r}: a file path in an "
                "existing directory",
                file=sys.stderr,
            )
            return 2
    try:
        state, work_dir = _prepare(args)
        drivers = _drivers(args, work_dir)
    except BadRequest as e:
        print(f"control plane: {e.message}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"control plane: {e}", file=sys.stderr)
        return 1
    try:
        return uvloop.run(_serve(args, state, drivers))
    except (OSError, ValueError) as e:
        print(f"control plane: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

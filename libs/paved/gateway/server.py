"""The gateway main: `python -m paved.gateway.server --routes FILE` (`tools/bazel run
//services/gateway:serve -- --routes FILE`).

One replica needs nothing else: state in SQLite, limits in process. Several replicas share
`--state postgresql://...` (keys, tenants) and `--redis redis://...` (limits). The admin key is
read from `--admin-key-file` or `$PAVED_ADMIN_KEY`; without either a fresh one is printed once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import secrets
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from paved.gateway.access.auth import AdminAuth, Authenticator, admin_key_for_run, configured_admin_key
from paved.gateway.access.limits import make_limiter
from paved.gateway.access.state import GatewayStore
from paved.gateway.app import DEFAULT_MAX_BODY_BYTES, Gateway, create_app
from paved.gateway.batches import service as batch_service
from paved.gateway.batches.admin import admin_batch_routes
from paved.gateway.flow.flow import FlowConfig, FlowController
from paved.gateway.forwarding.proxy import OpenAIProxy, ProxyConfig
from paved.gateway.metrics import GatewayMetrics
from paved.gateway.orchestration.orchestrate import InternalClient, Orchestrator
from paved.gateway.orchestration.tokens import TokenCounter
from paved.gateway.responses.api import ResponsesAPI
from paved.gateway.routing.health import FileRoutesSource, HealthChecker
from paved.gateway.routing.router import Router
from paved.gateway.routing.routes import RoutesError, RoutesTable, load_routes_file, parse_routes
from paved.gateway.routing.wake import WakeCaller
from paved.gateway.routing.watch_source import HttpRoutesSource, routes_url
from paved.http.sockets import SERVER_KEEPALIVE_S, bind

logger = logging.getLogger("paved.gateway")


class _Server(uvicorn.Server):
    """uvicorn without its signal capture: the loop's handlers stop it, so the gateway's own
    shutdown (gRPC server, limiter, store) runs and the process exits 0 instead of uvicorn
    re-raising the signal at the end."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _default_state() -> str:
    base = Path(os.environ.get("PAVED_STATE_DIR") or Path.home() / ".local/share/paved")
    return f"sqlite:///{base / 'gateway.sqlite'}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gateway", description="paved's gateway: keys, limits, routing.")
    p.add_argument(
        "--routes",
        required=True,
        metavar="FILE|URL",
        help="routes table (.json or .toml), reloaded live; or http(s)://CONTROL_PLANE to follow "
        "its routes feed (long poll of /v1/routes)",
    )
    p.add_argument(
        "--routes-token",
        default=os.environ.get("PAVED_ROUTES_TOKEN"),
        help="bearer token for the control plane's routes feed (default $PAVED_ROUTES_TOKEN)",
    )
    p.add_argument(
        "--routes-cache",
        metavar="PATH",
        help="with --routes URL: the last table received is kept here and served at start when "
        "the control plane cannot be reached",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080; 0: any free port)")
    p.add_argument("--state", help="keys and tenants: sqlite:///PATH (default) or postgresql://...")
    p.add_argument("--redis", metavar="URL", help="redis://HOST:PORT/DB: limits shared by every replica")
    p.add_argument("--admin-key-file", help="file holding the admin API key (else $PAVED_ADMIN_KEY)")
    p.add_argument("--bootstrap-tenant", metavar="NAME", help="with --bootstrap-key-file: ensure this tenant")
    p.add_argument(
        "--bootstrap-key-file",
        metavar="PATH",
        help="if PATH does not exist: create a key for --bootstrap-tenant and write it there (mode 0600)",
    )
    p.add_argument(
        "--region",
        help="this gateway's region: its backends are preferred, others serve when it has none healthy",
    )
    p.add_argument("--kserve-grpc-port", type=int, help="KServe v2 gRPC port (off unless given; 0: any)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    p.add_argument("--connect-timeout", type=float, default=3.0, help="seconds to connect to a backend")
    p.add_argument("--upstream-timeout", type=float, default=600.0, help="seconds for a whole answer")
    p.add_argument("--stream-idle-timeout", type=float, default=120.0, help="seconds between stream events")
    p.add_argument("--max-attempts", type=int, default=3, help="backends tried before the first byte")
    p.add_argument("--default-max-tokens", type=int, default=256, help="reserved when a request names none")
    p.add_argument(
        "--queue-size",
        type=int,
        default=1024,
        help="requests held per model while its backends have no room (default 1024; 0: off, a "
        "request finding no room is answered 503 at once)",
    )
    p.add_argument(
        "--queue-max-wait",
        type=float,
        default=30.0,
        help="seconds a request may wait in the queue before a 503 (default 30)",
    )
    p.add_argument(
        "--queue-charge-unit",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="tenants share the queue's slots by time held: a request costs one turn per this "
        "many seconds it holds its slot, at least one (default 1)",
    )
    p.add_argument(
        "--wake-max-wait",
        type=float,
        default=180.0,
        help="seconds a request for a model scaled to zero is held while it wakes before a 503 "
        "(default 180; the control plane is asked to wake it at once)",
    )
    p.add_argument(
        "--tenant-weight",
        action="append",
        default=[],
        metavar="TENANT=WEIGHT",
        help="the tenant's share of a model's capacity when requests queue (default 1 each; repeatable)",
    )
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between /health/ready checks")
    p.add_argument(
        "--no-backend-metrics",
        action="store_true",
        help="do not read backends' load gauges (each backend's metrics_url, default its /metrics) in "
        "the health rounds: prefix affinity then weighs only this gateway's in-flight counts, and "
        "flow control holds a request only after a backend pushed back",
    )
    p.add_argument("--routes-poll", type=float, default=1.0, help="seconds between routes-file checks")
    p.add_argument("--auth-cache", type=float, default=0.5, help="seconds a key lookup is cached")
    p.add_argument(
        "--exact-cache",
        choices=("memory", "redis", "off"),
        help="where routes with a cache policy keep exact answers (default: redis with --redis, else memory)",
    )
    p.add_argument("--exact-cache-mb", type=int, default=64, help="in-memory exact cache size (MiB)")
    p.add_argument(
        "--semantic-cache-entries",
        type=int,
        default=1_000_000,
        help="semantic cache entries kept in this replica, over all tenants (0: off)",
    )
    p.add_argument(
        "--semantic-cache-mb",
        type=int,
        default=1024,
        help="semantic cache memory in this replica (MiB): answers, their vectors and indexes",
    )
    p.add_argument(
        "--template-timeout", type=float, default=0.25, help="seconds a prompt template may render"
    )
    p.add_argument(
        "--no-orchestration",
        action="store_true",
        help="forward only: no templates, conversations, caches or experiments",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    # Resumable streams and the Responses API (docs/gateway.md, "Responses API and resumable streams").
    p.add_argument(
        "--resumable-streams",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="chat completions streams are resumable (on by default: an id: per SSE event, the "
        "stream's id in x-paved-stream-id, GET /v1/chat/completions/streams/ID with Last-Event-ID "
        "resumes, and a client that leaves does not abort the generation for --stream-grace); "
        "--no-resumable-streams forwards them as they come and aborts on disconnect",
    )
    p.add_argument(
        "--stream-grace",
        type=float,
        default=30.0,
        metavar="S",
        help="how long a resumable stream's generation goes on with no reader (default 30)",
    )
    p.add_argument(
        "--stream-max-events",
        type=int,
        default=20000,
        metavar="N",
        help="events kept per stream (default 20000)",
    )
    p.add_argument(
        "--stream-retention",
        type=float,
        default=3600.0,
        metavar="S",
        help="how long a stream's events are kept after its last one (default 3600)",
    )
    p.add_argument(
        "--streams-per-tenant",
        type=int,
        default=1000,
        metavar="N",
        help="streams kept per tenant, the oldest dropped first (default 1000)",
    )
    p.add_argument(
        "--responses-per-tenant",
        type=int,
        default=10000,
        metavar="N",
        help="stored responses kept per tenant (default 10000)",
    )
    p.add_argument(
        "--responses-retention",
        type=float,
        default=30 * 86400.0,
        metavar="S",
        help="how long a stored response is kept (default 30 days)",
    )
    p.add_argument(
        "--responses-lease",
        type=float,
        default=15.0,
        metavar="S",
        help="a generating replica's lease (default 15): when it lapses (the replica died) another "
        "replica continues a background response where it stopped; any other response ends failed",
    )
    p.add_argument(
        "--responses-max-takeovers",
        type=int,
        default=3,
        metavar="N",
        help="times a background response is continued after its replica died before it ends "
        "failed (default 3; 0: never continued)",
    )
    batch_service.add_arguments(p)
    return p


def _check(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if not 0 <= args.port <= 65535:
        p.error("--port must be 0..65535")
    if args.max_body_bytes < 1024:
        p.error("--max-body-bytes must be at least 1024")
    for name in (
        "connect_timeout",
        "upstream_timeout",
        "stream_idle_timeout",
        "health_interval",
        "routes_poll",
    ):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not 1 <= args.max_attempts <= 10:
        p.error("--max-attempts must be 1..10")
    if args.auth_cache < 0 or args.auth_cache > 1:
        p.error("--auth-cache must be 0..1 s (a revoked key must stop working within a second)")
    if args.routes_cache and not _is_url(args.routes):
        p.error("--routes-cache needs --routes http(s)://...")
    if _is_url(args.routes):
        try:
            routes_url(args.routes)
        except RoutesError as e:
            p.error(f"--routes: {e}")
    try:
        # Here, not in build(): a bad key file or key is a usage error (exit 2, one line),
        # not a traceback from inside the event loop.
        configured_admin_key(args.admin_key_file)
    except ValueError as e:
        p.error(str(e))
    if bool(args.bootstrap_tenant) != bool(args.bootstrap_key_file):
        p.error("--bootstrap-tenant and --bootstrap-key-file go together")
    if args.exact_cache == "redis" and not args.redis:
        p.error("--exact-cache redis needs --redis")
    if not 1 <= args.exact_cache_mb <= 1 << 20:
        p.error("--exact-cache-mb must be 1..1048576")
    if not 0 <= args.semantic_cache_entries <= 100_000_000:
        p.error("--semantic-cache-entries must be 0..100000000")
    if not 1 <= args.semantic_cache_mb <= 1 << 20:
        p.error("--semantic-cache-mb must be 1..1048576")
    if not 0 < args.template_timeout <= 10:
        p.error("--template-timeout must be in (0, 10] seconds")
    if not 0 <= args.queue_size <= 1_000_000:
        p.error("--queue-size must be 0..1000000")
    if not 0 < args.queue_max_wait <= 3600:
        p.error("--queue-max-wait must be in (0, 3600] seconds")
    if not 0 < args.queue_charge_unit <= 3600:
        p.error("--queue-charge-unit must be in (0, 3600] seconds")
    if not 0 < args.wake_max_wait <= 3600:
        p.error("--wake-max-wait must be in (0, 3600] seconds")
    if not 0 <= args.stream_grace <= 3600:
        p.error("--stream-grace must be in [0, 3600] seconds")
    for name in ("stream_max_events", "streams_per_tenant", "responses_per_tenant"):
        if not 1 <= getattr(args, name) <= 10_000_000:
            p.error(f"--{name.replace('_', '-')} must be in [1, 10000000]")
    if not 0 <= args.responses_max_takeovers <= 100:
        p.error("--responses-max-takeovers must be in [0, 100]")
    for name in ("stream_retention", "responses_retention", "responses_lease"):
        if not 1 <= getattr(args, name) <= 366 * 86400:
            p.error(f"--{name.replace('_', '-')} must be in [1, 31622400] seconds")
    try:
        args.tenant_weights = _tenant_weights(args.tenant_weight)
    except ValueError as e:
        p.error(f"--tenant-weight: {e}")


def _tenant_weights(values: list[str]) -> dict[str, float]:
    weights: dict[str, float] = {}
    for value in values:
        tenant, sep, number = value.partition("=")
        if not sep or not tenant:
            raise ValueError(f"{value!r} is not TENANT=WEIGHT")
        try:
            weight = float(number)
        except ValueError:
            raise ValueError(f"{value!r}: the weight is not a number") from None
        if not (math.isfinite(weight) and 0 < weight <= 1000):
            raise ValueError(f"{value!r}: the weight must be in (0, 1000]")
        weights[tenant] = weight
    return weights


async def _bootstrap(store: GatewayStore, tenant: str, path: str) -> None:
    if await asyncio.to_thread(os.path.exists, path):
        return
    if await store.get_tenant(tenant) is None:
        await store.create_tenant(tenant)
    _, plaintext = await store.create_key(tenant, name="bootstrap")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(plaintext + "\n")
    print(f"gateway: wrote a key for tenant {tenant!r} to {path}", file=sys.stderr, flush=True)


def _is_url(routes: str) -> bool:
    return routes.startswith(("http://", "https://"))


def _routes_source(args: argparse.Namespace, router: Router) -> FileRoutesSource | HttpRoutesSource:
    if _is_url(args.routes):
        return HttpRoutesSource(args.routes, router, token=args.routes_token, cache_file=args.routes_cache)
    return FileRoutesSource(args.routes, router, poll_s=args.routes_poll)


def build(args: argparse.Namespace) -> tuple[Gateway, RoutesTable]:
    # From the control plane the first table arrives in Gateway.start (routes source start);
    # until then the router holds an empty table (/health/ready answers 503).
    table = parse_routes({"models": []}) if _is_url(args.routes) else load_routes_file(args.routes)
    state = args.state or _default_state()
    if state.startswith("sqlite:///"):
        Path(state.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    store = GatewayStore(state)
    admin_key = admin_key_for_run(args.admin_key_file, "gateway")
    router = Router(table, region=args.region)
    metrics = GatewayMetrics()
    authenticator = Authenticator(store, cache_s=args.auth_cache)
    limiter = make_limiter(args.redis)
    config = ProxyConfig(
        connect_timeout_s=args.connect_timeout,
        upstream_timeout_s=args.upstream_timeout,
        stream_idle_timeout_s=args.stream_idle_timeout,
        max_attempts=args.max_attempts,
        default_max_tokens=args.default_max_tokens,
        wake_max_wait_s=args.wake_max_wait,
    )
    flow = FlowController(
        FlowConfig(
            max_queued=args.queue_size,
            max_wait_s=args.queue_max_wait,
            tenant_weights=args.tenant_weights,
            charge_unit_s=args.queue_charge_unit,
        ),
        metrics=metrics,
    )
    proxy = OpenAIProxy(
        authenticator=authenticator,
        limiter=limiter,
        router=router,
        metrics=metrics,
        tokens=TokenCounter(),
        config=config,
        flow=flow,
        # Models scaled to zero are woken through the control plane the routes come from.
        waker=WakeCaller(routes_url(args.routes), token=args.routes_token, metrics=metrics)
        if _is_url(args.routes)
        else None,
    )
    orchestrator = None if args.no_orchestration else _orchestrator(args, store, proxy)
    proxy.orchestrator = orchestrator
    gateway = Gateway(
        store=store,
        authenticator=authenticator,
        admin=AdminAuth(admin_key),
        limiter=limiter,
        router=router,
        proxy=proxy,
        metrics=metrics,
        # Gateway's field is annotated with the file source; both implement RoutesSource.
        routes_source=_routes_source(args, router),
        health=HealthChecker(
            router, interval_s=args.health_interval, scrape_metrics=not args.no_backend_metrics
        ),
        orchestrator=orchestrator,
    )
    if proxy.waker is not None:
        gateway.on_stop.append(proxy.waker.close)
    gateway.responses = _responses(args, store, authenticator, proxy)
    gateway.on_start.append(gateway.responses.start)
    gateway.on_stop.append(gateway.responses.stop)
    return gateway, table


def _responses(
    args: argparse.Namespace, store: GatewayStore, authenticator: Authenticator, proxy: OpenAIProxy
) -> ResponsesAPI:
    """The Responses API and resumable streams: events in Redis with --redis, else the database."""
    from paved.gateway.responses import events
    from paved.gateway.responses.store import ResponseStore, StoreBounds

    bounds = events.LogBounds(
        max_events=args.stream_max_events,
        retention_s=args.stream_retention,
        max_streams_per_tenant=args.streams_per_tenant,
    )
    log: events.EventLog = (
        events.RedisEventLog(args.redis, bounds) if args.redis else events.SqlEventLog(store, bounds)
    )
    responses = ResponseStore(
        store,
        StoreBounds(
            max_per_tenant=args.responses_per_tenant,
            retention_s=args.responses_retention,
            lease_s=args.responses_lease,
        ),
        owner=secrets.token_hex(8),
    )
    return ResponsesAPI(
        proxy=proxy,
        authenticator=authenticator,
        store=responses,
        streams=events.LiveStreams(
            log,
            grace_s=args.stream_grace,
            # Longer than any wait a live writer may have between two events: its upstream's
            # idle timeout, then a queue's or a wake's wait and a takeover's lease. A response's
            # writer holding its lease is alive however long it is silent.
            writer_silence_s=args.stream_idle_timeout
            + max(args.queue_max_wait, args.wake_max_wait)
            + args.responses_lease
            + 60,
            writer_alive=responses.writing,
        ),
        resumable_chat=args.resumable_streams,
        max_takeovers=args.responses_max_takeovers,
    )


def _orchestrator(args: argparse.Namespace, store: GatewayStore, proxy: OpenAIProxy) -> Orchestrator:
    from paved.gateway.caching import cache
    from paved.gateway.experiments.experiments import ExperimentRecorder, ExperimentRegistry
    from paved.gateway.orchestration.context import ContextFitter, ConversationStore
    from paved.gateway.orchestration.templates import TemplateRegistry

    exact: cache.ExactCache | None = None
    where = args.exact_cache or ("redis" if args.redis else "memory")
    if where == "memory":
        exact = cache.InProcessExactCache(max_bytes=args.exact_cache_mb << 20)
    elif where == "redis":
        import redis.asyncio

        exact = cache.RedisExactCache(redis.asyncio.Redis.from_url(args.redis))
    semantic = (
        cache.SemanticCache(max_entries=args.semantic_cache_entries, max_bytes=args.semantic_cache_mb << 20)
        if args.semantic_cache_entries
        else None
    )
    conversations = ConversationStore(store)
    return Orchestrator(
        router=proxy.router,
        tokens=proxy.tokens,
        metrics=proxy.metrics,
        internal=InternalClient(proxy.router, lambda: proxy.session, proxy.metrics),
        templates=TemplateRegistry(store, render_timeout_s=args.template_timeout),
        conversations=conversations,
        fitter=ContextFitter(conversations),
        exact=exact,
        semantic=semantic,
        entry_ids=cache.EntryIds(store),
        experiments=ExperimentRegistry(store),
        recorder=ExperimentRecorder(store),
        default_max_tokens=args.default_max_tokens,
    )


async def _serve(args: argparse.Namespace) -> int:
    gateway, _ = build(args)
    extra_routes = []
    grpc_server = None
    with contextlib.suppress(ImportError):
        from paved.gateway.forwarding.kserve_http import kserve_http_routes

        extra_routes = list(
            kserve_http_routes(
                gateway.router,
                gateway.authenticator,
                gateway.limiter,
                lambda: gateway.proxy.session,
                # The gateway-wide bounds, as on the OpenAI side (the defaults were their own).
                deadline_s=args.upstream_timeout,
                stream_deadline_s=args.upstream_timeout,
                connect_timeout_s=args.connect_timeout,
                max_body_bytes=args.max_body_bytes,
                # One queue, one wake loop and one held count per model, over every protocol.
                held=gateway.proxy.held,
            )
        )
    if gateway.responses is not None:
        extra_routes.extend(gateway.responses.routes())
    batches = batch_service.from_arguments(args, gateway.store, gateway.proxy)
    extra_routes.extend(batches.api.routes())
    extra_routes.extend(admin_batch_routes(gateway.store, gateway.admin))
    gateway.on_start.append(batches.start)
    gateway.on_stop.append(batches.stop)
    app = create_app(
        gateway,
        max_body_bytes=args.max_body_bytes,
        extra_routes=extra_routes,
        manage_lifespan=False,
        # The multipart envelope around a largest batch file.
        max_upload_bytes=args.batch_max_bytes + (1 << 20),
    )
    await gateway.start()
    if args.bootstrap_key_file:
        await _bootstrap(gateway.store, args.bootstrap_tenant, args.bootstrap_key_file)
    grpc_port = None
    if args.kserve_grpc_port is not None:
        import grpc

        from paved.gateway.forwarding.kserve_grpc import KServeForwarder

        forwarder = KServeForwarder(
            gateway.router,
            gateway.authenticator,
            gateway.limiter,
            held=gateway.proxy.held,
            deadline_s=args.upstream_timeout,
            stream_deadline_s=args.upstream_timeout,
            connect_timeout_s=args.connect_timeout,
            max_message_bytes=args.max_body_bytes,
        )
        # --max-body-bytes bounds a gRPC message as it bounds an HTTP body (it was 64 MiB here).
        grpc_server = grpc.aio.server(options=[("grpc.max_receive_message_length", args.max_body_bytes)])
        grpc_server.add_generic_rpc_handlers((forwarder.handler(),))
        grpc_port = grpc_server.add_insecure_port(f"{args.host}:{args.kserve_grpc_port}")
        await grpc_server.start()
        gateway.on_stop.append(forwarder.close)

    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        loop="none",
        http="httptools",
        log_level="warning",
        access_log=False,
        timeout_keep_alive=SERVER_KEEPALIVE_S,
        timeout_graceful_shutdown=10,
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    # uvicorn exposes no started event; a bounded poll (it binds an already-open socket).
    for _ in range(3000):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if task.done():
        await task
    if grpc_port is not None:
        print(f"gateway KServe v2 gRPC {grpc_port} on {host}", flush=True)
    print(f"serving gateway on http://{host}:{port}", flush=True)
    try:
        await task
    finally:
        if grpc_server is not None:
            await grpc_server.stop(5)
        await gateway.stop()
        sock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    _check(args, p)
    batch_service.check_arguments(args, p)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop

        return uvloop.run(_serve(args))
    except RoutesError as e:
        what = "no routes from" if _is_url(args.routes) else "bad routes file"
        print(f"gateway: {what} {args.routes}: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"gateway: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

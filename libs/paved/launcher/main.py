"""`tools/bazel run //services/launcher:launch -- PACKAGE_URI`: materialize, check, start, gate.

Phases (reported on the admin port's /status and in the log):
  materializing -> checking_plugins -> starting -> ready -> draining -> stopped | failed

1. PROMETHEUS_MULTIPROC_DIR (if set) is cleaned of a previous run's files (paved.launcher.metrics_dir).
2. The package is materialized into the local cache (paved.launcher.materialize): a warm start
   touches no network.
3. Plugin wheels are installed (during 2) and their entry points checked in a child process.
4. The child starts on private loopback ports: the paved frontend with the engine in-process
   (embedded mode) or vLLM's OpenAI server alone (standalone), paved.kserve over the classic
   model directory or Triton model repository (a kserve package: KServe v2 HTTP on the HTTP
   port, gRPC with --grpc-port; ready once every model of it is), or any `--child-cmd`.
5. Once the child's readiness endpoint answers 200, the public ports listen; before that they
   refuse connections. A child that can serve the public HTTP socket itself (the paved frontend
   in embedded mode, a `--child-cmd` with {http_fd}) inherits it and listens on it once ready:
   no relay. Other routes (vLLM standalone, gRPC, a child-cmd without {http_fd}) are relayed by
   the launcher (paved.launcher.gate). They are bound (reserved, not
   listening) before step 1, so a taken --port / --grpc-port fails the start at once (exit 1,
   "cannot bind the public port") rather than after the model loaded, and no other process can
   take them meanwhile (unless a previous run's TIME_WAIT forced the SO_REUSEADDR fallback of
   gate.reserve: then another SO_REUSEADDR server could still bind them). If the child exits
   first, the launcher exits 1 with the child's last error line and the public ports were
   never opened.
6. SIGTERM / SIGINT: readiness turns 503, public listeners close, the child gets SIGTERM and
   drains in-flight requests (the frontend's --drain-timeout); the launcher exits 0 once it
   has, or kills the child's process group and exits 1 after drain + grace seconds.

Metrics (`--metrics-port`, paved.launcher.metrics_port): a metrics proxy serves /metrics from
right after step 1 until the launcher exits, ungated: the engine's PROMETHEUS_MULTIPROC_DIR
files merged with the child's own /metrics (upstream `frontend`, reported down until the child
answers). Its address is in /status "ports" and the ready line.

Exit codes: 0 clean stop, 1 failed start / drain deadline exceeded / child died, 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import decimal
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from paved.launcher import metrics_dir, plugins
from paved.launcher.cache import DEFAULT_LOCK_TIMEOUT_S, Cache
from paved.launcher.gate import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    AdminServer,
    Gate,
    Route,
    free_port,
    http_get,
    reserve,
)
from paved.launcher.materialize import Materialized, Materializer
from paved.launcher.metrics_port import MetricsPort
from paved.launcher.storage import Downloader, MiB, TransferConfig, make_s3_client

log = logging.getLogger("paved.launcher")
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# "ValueError: ...", also behind a log prefix ("(Worker pid=1) ERROR ... [file.py:12] ...").
_EXCEPTION_LINE = re.compile(r"(?:^|[\s\]])((?:[A-Za-z_][\w.]*)?(?:Error|Exception): .+)$")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?$", re.IGNORECASE)


class LaunchError(RuntimeError):
    """The start failed; the message is the reason shown to the operator."""


_MAX_SIZE = (1 << 63) - 1  # what off_t (ftruncate, pread) holds


def parse_size(text: str) -> int:
    """Bytes, 0.._MAX_SIZE; argparse.ArgumentTypeError otherwise (argparse: exit 2)."""
    m = _SIZE.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500G, 2TiB, 1048576)")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    # Decimal, not float: 400 digits made float() inf, and int(inf) an OverflowError traceback.
    value = decimal.Decimal(m.group(1)) * 1024 ** " KMGT".index(unit or " ")
    if value > _MAX_SIZE:
        raise argparse.ArgumentTypeError(f"too large: {text!r} (at most {_MAX_SIZE} bytes)")
    return int(value)


def default_cache_dir() -> str:
    if os.environ.get("PAVED_CACHE_DIR"):
        return os.environ["PAVED_CACHE_DIR"]
    home = os.environ.get("HOME")
    if home and os.access(home, os.W_OK):
        return os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"), "paved", "models"
        )
    return os.path.join(tempfile.gettempdir(), "paved-models")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch",
        description="Materialize a model package (s3://bucket/prefix, a directory or a tarball) "
        "into the local cache, then start and gate the engine.",
    )
    p.add_argument("package", help="s3://bucket/prefix[.tar], /path/to/package[.tar.gz]")
    c = p.add_argument_group("cache")
    c.add_argument(
        "--cache-dir", default=default_cache_dir(), help="default $PAVED_CACHE_DIR or ~/.cache/paved/models"
    )
    c.add_argument(
        "--cache-max-bytes",
        type=parse_size,
        # $PAVED_CACHE_MAX_BYTES is read in main(): parsed here, a bad value raised while the
        # parser was built (a traceback, exit 1).
        help="LRU budget for cached blobs, e.g. 200G (default $PAVED_CACHE_MAX_BYTES, else unbounded)",
    )
    c.add_argument(
        "--lock-timeout",
        type=float,
        default=DEFAULT_LOCK_TIMEOUT_S,
        help="seconds to wait for a cache lock another launcher holds (e.g. while it downloads the "
        "same package) before failing with the holder's pid (default 3600)",
    )
    c.add_argument("--refresh", action="store_true", help="re-read model.json even if the URI is cached")
    c.add_argument("--verify", action="store_true", help="re-hash cached files on a warm start")
    c.add_argument(
        "--materialize-only",
        action="store_true",
        help="print the materialized package as JSON; start nothing",
    )
    s = p.add_argument_group("S3")
    s.add_argument(
        "--s3-endpoint-url", help="S3-compatible endpoint (default $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL)"
    )
    s.add_argument("--s3-addressing-style", choices=("auto", "path", "virtual"))
    s.add_argument("--workers", type=int, default=8, help="parallel transfers")
    s.add_argument("--part-size", type=parse_size, default=64 * MiB, help="ranged GET size (default 64MiB)")
    s.add_argument("--max-attempts", type=int, default=5, help="tries per part before giving up")
    s.add_argument("--progress", choices=("auto", "bar", "log"), default="auto")
    e = p.add_argument_group("serving")
    e.add_argument("--mode", choices=("embedded", "standalone"), help="override the package's mode")
    e.add_argument(
        "--host",
        default="127.0.0.1",
        help="public bind address (default 127.0.0.1); IPv6 when it contains ':', and a name binds "
        "one address of its resolution, not every one",
    )
    e.add_argument("--port", type=int, default=8000, help="public HTTP port (0: any free port)")
    e.add_argument("--grpc-port", type=int, help="public gRPC port (needs a --child-cmd with {grpc_port})")
    e.add_argument("--admin-host", default="127.0.0.1")
    e.add_argument("--admin-port", type=int, help="control-plane port: /health/live, /health/ready, /status")
    e.add_argument(
        "--child-cmd",
        help="serve with this command instead; placeholders {python} {model_dir} {model_id} {config} "
        "(the frontend's JSON config) {http_port} {grpc_port} {http_fd}; it must answer --ready-path "
        "with 200 on {http_port} once ready. With {http_fd} (the number of an inherited socket bound "
        "to the public HTTP address, not listening: the paved frontend's --listen-fd) the child serves "
        "the public port itself, listening once ready, instead of through the launcher's relay",
    )
    e.add_argument("--ready-path", help="readiness path of the child (default /health/ready; vLLM: /health)")
    e.add_argument(
        "--start-timeout", type=float, default=900.0, help="seconds for the engine to become ready"
    )
    e.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM"
    )
    e.add_argument("--stop-grace", type=float, default=15.0, help="extra seconds for the engine to shut down")
    e.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="relayed connections open at once on the public ports; more get 503 (HTTP) or are "
        "closed (default 1024)",
    )
    e.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        help="close a relayed connection after this many seconds without a byte either way "
        "(default 600; 0: never)",
    )
    e.add_argument(
        "--metrics-dir",
        default=os.environ.get("PROMETHEUS_MULTIPROC_DIR"),
        help="PROMETHEUS_MULTIPROC_DIR for the engine (default: the environment's); cleaned at start",
    )
    e.add_argument(
        "--metrics-port",
        type=int,
        help="serve a metrics proxy here for the launcher's whole run: the --metrics-dir files plus "
        "the child's /metrics (0: any free port; default: none)",
    )
    e.add_argument("--metrics-host", default="127.0.0.1", help="bind address of --metrics-port")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


# ---------------------------------------------------------------------------------------------
# The child command.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ChildSpec:
    argv: list[str]
    ready_path: str
    ports: dict[str, int]  # route name -> private port
    # Routes whose public socket the child inherits and serves itself (no relay).
    handoff: frozenset[str] = frozenset()


def _frontend_config(m: Materialized, port: int, drain_timeout_s: float) -> dict:
    from paved.engine.vllm_config import VllmModelConfig

    named = {f.name for f in dataclasses.fields(VllmModelConfig)} - {"name", "path", "engine_args"}
    args = _engine_args(m.package.engine_args)
    model: dict[str, Any] = {"name": m.package.model_id, "path": m.model_dir}
    model.update({k: args.pop(k) for k in list(args) if k in named})
    if args:
        model["engine_args"] = args
    return {
        "server": {"host": "127.0.0.1", "port": port, "drain_timeout_s": drain_timeout_s},
        "models": [model],
    }


def _engine_args(engine_args: dict[str, Any]) -> dict[str, Any]:
    """The package's engine args less what paved itself reads: `kserve` declares the model's
    KServe v2 interface (the control plane's fingerprint; a KServe port for its replicas), and
    vLLM rejects an argument it does not know."""
    return {k: v for k, v in engine_args.items() if k != "kserve"}


def _vllm_flags(engine_args: dict[str, Any]) -> list[str]:
    out = []
    for key, value in _engine_args(engine_args).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        else:
            out += [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]
    return out


CHILD_CMD_FIELDS = ("python", "model_dir", "model_id", "config", "http_port", "grpc_port", "http_fd")


def child_argv(cmd: str, values: dict[str, Any]) -> list[str]:
    """--child-cmd split like a shell and its placeholders filled; ValueError naming the
    problem (unbalanced quotes, an unknown {field}, a bad format) otherwise."""
    try:
        parts = shlex.split(cmd)
    except ValueError as e:
        raise ValueError(f"{e} in {cmd!r}") from None
    if not parts:
        raise ValueError("empty command")
    argv = []
    for part in parts:
        try:
            argv.append(part.format(**values))
        except KeyError as e:
            known = " ".join(f"{{{f}}}" for f in CHILD_CMD_FIELDS)
            raise ValueError(f"unknown placeholder {{{e.args[0]}}} in {part!r} (known: {known})") from None
        except (IndexError, ValueError, AttributeError, TypeError) as e:
            raise ValueError(f"{part!r}: {e} (a literal brace is written {{{{ or }}}})") from None
    return argv


def child_spec(
    args: argparse.Namespace, m: Materialized, state_dir: str, public_fds: dict[str, int] | None = None
) -> ChildSpec:
    """`public_fds`: route name -> the descriptor of its reserved public socket, for a child that
    can serve it itself (see `ChildSpec.handoff`)."""
    public_fds = public_fds or {}
    ports = {"http": free_port()}
    kserve_mode = m.package.mode == "kserve"
    if kserve_mode and args.mode:
        raise LaunchError(f"--mode {args.mode}: {m.package.model_id} is a kserve package (a classic model)")
    if args.grpc_port is not None:
        if not kserve_mode and (not args.child_cmd or "{grpc_port}" not in args.child_cmd):
            raise LaunchError("--grpc-port needs a --child-cmd that serves gRPC on {grpc_port}")
        ports["grpc"] = free_port()
    if kserve_mode and not args.child_cmd:
        # KServe v2 HTTP on the public HTTP port, gRPC on the public gRPC port when asked.
        argv = [
            sys.executable, "-m", "paved.kserve.main",
            "--model-repository" if m.package.kserve_layout() == "repository" else "--model-dir", m.model_dir,
            "--host", "127.0.0.1", "--http-port", str(ports["http"]),
            "--grpc-port", str(ports.get("grpc", -1)),
        ]  # fmt: skip
        return ChildSpec(argv, args.ready_path or "/health/ready", ports)
    # The paved frontend's config file (also what `paved.kserve.main --llm-config` reads).
    config = os.path.join(state_dir, "frontend.json")
    with open(config, "w") as f:
        json.dump(_frontend_config(m, ports["http"], args.drain_timeout), f, indent=2)
    if args.child_cmd:
        values = {
            "python": sys.executable,
            "model_dir": m.model_dir,
            "model_id": m.package.model_id,
            "config": config,
            "http_port": ports["http"],
            "grpc_port": ports.get("grpc", ""),
            "http_fd": public_fds.get("http", ""),
        }
        argv = child_argv(args.child_cmd, values)
        takes_fd = "{http_fd}" in args.child_cmd and "http" in public_fds
        return ChildSpec(
            argv, args.ready_path or "/health/ready", ports, frozenset({"http"} if takes_fd else ())
        )
    if (args.mode or m.package.mode) == "embedded":
        argv = [sys.executable, "-m", "paved.frontend.server", "--config", config]
        if "http" in public_fds:
            argv += ["--listen-fd", str(public_fds["http"])]
            return ChildSpec(argv, args.ready_path or "/health/ready", ports, frozenset({"http"}))
        return ChildSpec(argv, args.ready_path or "/health/ready", ports)
    # The package's flags first: argparse keeps the last of a flag, so the launcher's own win
    # over any spelling a package might find for them (an abbreviation such as --hos).
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        *_vllm_flags(m.package.engine_args),
        "--model", m.model_dir, "--served-model-name", m.package.model_id,
        "--host", "127.0.0.1", "--port", str(ports["http"]),
    ]  # fmt: skip
    return ChildSpec(argv, args.ready_path or "/health", ports)


def child_env(m: Materialized, metrics_path: str | None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [m.plugin_dir] if m.plugin_dir else []
    paths += [p for p in sys.path if p and os.path.isdir(p)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if metrics_path:
        env["PROMETHEUS_MULTIPROC_DIR"] = metrics_path
    return env


# ---------------------------------------------------------------------------------------------
# The supervisor.
# ---------------------------------------------------------------------------------------------
class Launcher:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.phase = "starting"
        self.reason: str | None = None
        self.started = time.monotonic()
        self.timings: dict[str, float] = {}
        self.materialized: Materialized | None = None
        self.entry_points: list[dict] = []
        self.gate: Gate | None = None
        # The public ports' sockets, bound at the start; handed to the gate once it exists, or
        # to the child at its spawn (then closed here).
        self.public: dict[str, socket.socket] = {}
        # The public addresses the child serves itself (handed off at its spawn).
        self.handed_off: dict[str, tuple[str, int]] = {}
        self.child: asyncio.subprocess.Process | None = None
        self.child_tail: collections.deque[str] = collections.deque(maxlen=500)
        self._stop = asyncio.Event()
        self._stop_signal: str | None = None
        # fd of the metrics dir lock, held (open) for the launcher's life.
        self._metrics_lock: int | None = None
        self.metrics: MetricsPort | None = None

    # -- control plane ---------------------------------------------------------------------
    def ready(self) -> bool:
        return self.phase == "ready"

    def status(self) -> dict:
        # The public ports are known (held, refusing connections) from the start; `phase` says
        # whether they serve.
        bound = self.gate.bound if self.gate else {k: s.getsockname()[:2] for k, s in self.public.items()}
        ports = {k: list(v) for k, v in {**self.handed_off, **bound}.items()}
        if self.metrics is not None:
            ports["metrics"] = list(self.metrics.address)
        return {
            "phase": self.phase,
            "reason": self.reason,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "timings_s": {k: round(v, 3) for k, v in self.timings.items()},
            "package": self.materialized.summary() if self.materialized else None,
            "entry_points": self.entry_points,
            "ports": ports,
            "child_pid": self.child.pid if self.child else None,
            # Routes the child serves itself; the connection counts below are the relay's.
            "served_by_child": sorted(self.handed_off),
            "connections": {
                "open": self.gate.open_connections,
                "refused": self.gate.refused,
                "closed_idle": self.gate.idle_closed,
            }
            if self.gate
            else None,
        }

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        self.timings[phase] = time.monotonic() - self.started
        log.info("phase: %s (%.2fs)", phase, self.timings[phase])

    def _on_signal(self, name: str) -> None:
        if self._stop.is_set():
            log.warning("%s again: still stopping", name)
            return
        log.info("%s received: stopping", name)
        self._stop_signal = name
        self._stop.set()

    async def _until_stopped(self, fn: Callable[[], Any]) -> Any:
        """Run blocking `fn` in a daemon thread; None if a stop signal came first."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def settle(error: BaseException | None, result: object) -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        def work() -> None:
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised by the awaiting coroutine
                loop.call_soon_threadsafe(settle, e, None)
            else:
                loop.call_soon_threadsafe(settle, None, result)

        threading.Thread(target=work, daemon=True, name="paved-launcher-work").start()
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({fut, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if fut.done():
            return fut.result()
        return None

    # -- run -------------------------------------------------------------------------------
    async def run(self) -> int:
        args = self.args
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig.name)
        admin = None
        if args.admin_port is not None:
            admin = AdminServer(self.status, self.ready)
            try:
                admin_address = await admin.start(args.admin_host, args.admin_port)
            except OSError as e:
                print(f"launcher: start failed: cannot bind the admin port: {e}", file=sys.stderr, flush=True)
                return EXIT_FAILED
            log.info("admin endpoints on http://%s:%d (/health/ready, /status)", *admin_address)
        state_dir = tempfile.mkdtemp(prefix="paved-launcher-")
        try:
            return await self._run(state_dir)
        except LaunchError as e:
            self.reason = str(e)
            self._set_phase("failed")
            log.error("FAILED: %s", e)
            what = "failed" if "ready" in self.timings else "start failed"
            print(f"launcher: {what}: {e}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        finally:
            await self._kill_child()
            if self.gate is not None:
                await self.gate.abort()
            for sock in self.public.values():  # reserved but never handed to the gate
                sock.close()
            self.public.clear()
            if admin is not None:
                admin.close()
            if self.metrics is not None:
                await asyncio.to_thread(self.metrics.close)
            shutil.rmtree(state_dir, ignore_errors=True)

    async def _run(self, state_dir: str) -> int:
        args = self.args
        self._reserve_public_ports()
        # abspath reads the working directory: a syscall, kept off the loop like the others.
        metrics_path = (
            await asyncio.to_thread(os.path.abspath, args.metrics_dir) if args.metrics_dir else None
        )
        if metrics_path:
            try:
                self._metrics_lock = metrics_dir.prepare(metrics_path)
            except (metrics_dir.MetricsDirError, OSError) as e:
                raise LaunchError(str(e)) from None
            log.info("PROMETHEUS_MULTIPROC_DIR=%s cleaned", metrics_path)
        if args.metrics_port is not None:
            # Only now: before the cleaning it would serve the previous run's counters.
            try:
                self.metrics = MetricsPort(metrics_path, args.metrics_host, args.metrics_port)
            except OSError as e:
                raise LaunchError(f"cannot bind the metrics port: {e}") from None
            log.info("metrics proxy on %s", self.metrics.url)

        self._set_phase("materializing")
        m = await self._until_stopped(self._materialize)
        if m is None:
            return self._stopped_before_ready()
        self.materialized = m
        env = child_env(m, metrics_path)

        self._set_phase("checking_plugins")
        eps = await self._until_stopped(lambda: self._check_plugins(m, env))
        if eps is None:
            return self._stopped_before_ready()
        self.entry_points = [dataclasses.asdict(ep) for ep in eps]
        for ep in eps:
            log.info(
                "entry point %s: %s = %s (%s%s)",
                ep.group,
                ep.name,
                ep.value,
                ep.dist,
                ", from the package" if ep.from_package else "",
            )

        self._set_phase("starting")
        spec = child_spec(args, m, state_dir, {k: s.fileno() for k, s in self.public.items()})
        # The child's /metrics on its HTTP port: the frontend's, or for a kserve package
        # paved.kserve's own (its paved_kserve_* request metrics, which it also records in the
        # multiprocess files: the files' copy is the one kept).
        if self.metrics is not None:
            self.metrics.set_frontend(spec.ports["http"])
        child = await self._start_child(spec, env)
        if not await self._wait_ready(spec):
            return self._stopped_before_ready()

        routes = [Route("http", args.host, args.port, spec.ports["http"])]
        if "grpc" in spec.ports:
            routes.append(Route("grpc", args.host, args.grpc_port, spec.ports["grpc"]))
        self.gate = Gate(
            [r for r in routes if r.name not in spec.handoff],
            sockets=self.public,
            max_connections=args.max_connections,
            idle_timeout_s=args.idle_timeout,
        )
        self.public = {}  # the gate owns (and closes) them now
        try:
            await self.gate.open()
        except OSError as e:
            raise LaunchError(f"cannot bind the public port: {e}") from None
        self._set_phase("ready")
        bound = {**self.handed_off, **self.gate.bound}
        if self.metrics is not None:
            bound["metrics"] = self.metrics.address
        ports = ", ".join(f"{k} {h}:{p}" for k, (h, p) in bound.items())
        # Scripts and tests read this line.
        print(f"paved launcher: ready: {m.package.model_id}:{m.package.version} on {ports}", flush=True)

        child_exit = asyncio.ensure_future(child.wait())
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({child_exit, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not stop.done():
            stop.cancel()
            raise LaunchError(
                f"the engine process exited (code {child_exit.result()}): {self._child_reason()}"
            )
        return await self._drain(child_exit)

    def _reserve_public_ports(self) -> None:
        """Bind --port (and --grpc-port) now, not listening: a model can load for minutes, and
        meanwhile another process could take a port bound only when it is ready."""
        args = self.args
        wanted = [("http", "--port", args.port)]
        if args.grpc_port is not None:
            wanted.append(("grpc", "--grpc-port", args.grpc_port))
        for name, flag, port in wanted:
            try:
                self.public[name] = reserve(args.host, port)
            except OSError as e:
                raise LaunchError(f"cannot bind the public port {args.host}:{port} ({flag}): {e}") from None
        held = (f"{k} {s.getsockname()[0]}:{s.getsockname()[1]}" for k, s in self.public.items())
        log.info("public ports held, refusing connections until ready: %s", ", ".join(held))

    def _materialize(self) -> Materialized:
        args = self.args
        config = TransferConfig(
            workers=args.workers, part_size=args.part_size, max_attempts=args.max_attempts
        )
        downloader = Downloader(
            config,
            lambda: make_s3_client(
                args.s3_endpoint_url, addressing_style=args.s3_addressing_style, config=config
            ),
        )
        tty = {"auto": None, "bar": True, "log": False}[args.progress]
        cache = Cache(args.cache_dir, args.cache_max_bytes, lock_timeout_s=args.lock_timeout)
        materializer = Materializer(cache, downloader, args.verify, tty)
        try:
            return materializer.materialize(_resolve_uri(args.package), refresh=args.refresh)
        except Exception as e:
            raise LaunchError(f"materializing {args.package}: {e}") from e

    @staticmethod
    def _check_plugins(m: Materialized, env: dict[str, str]) -> list[plugins.EntryPointInfo]:
        try:
            return plugins.check(m.plugin_dir, env)
        except plugins.PluginError as e:
            raise LaunchError(str(e)) from None

    async def _start_child(self, spec: ChildSpec, env: dict[str, str]) -> asyncio.subprocess.Process:
        log.info("starting: %s", shlex.join(spec.argv))
        handed = {name: self.public[name] for name in spec.handoff}
        try:
            self.child = await asyncio.create_subprocess_exec(
                *spec.argv,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                # Its own process group: the terminal's Ctrl-C reaches only the launcher, which
                # drains; a forced stop kills the whole group (vLLM's engine core included).
                start_new_session=True,
                limit=1 << 20,
                pass_fds=[s.fileno() for s in handed.values()],
            )
        except OSError as e:
            raise LaunchError(f"cannot start {spec.argv[0]}: {e}") from None
        # The child holds the handed-off sockets now; without the launcher's copy, the port
        # stops listening the moment the child closes it (drain) or dies.
        for name, sock in handed.items():
            self.handed_off[name] = sock.getsockname()[:2]
            del self.public[name]
            sock.close()
        self._tee = asyncio.ensure_future(self._tee_output(self.child.stdout))
        return self.child

    async def _tee_output(self, stream: asyncio.StreamReader | None) -> None:
        if stream is None:
            return
        out = sys.stderr.buffer
        while True:
            try:
                line = await stream.readline()
            except (ValueError, asyncio.LimitOverrunError):
                line = await stream.read(1 << 16)
            if not line:
                return
            out.write(line)
            out.flush()
            self.child_tail.append(line.decode(errors="replace").rstrip())

    def _child_reason(self) -> str:
        """The exceptions in the child's last output lines, root cause first ("A -> B -> C"):
        vLLM's final error often only says "see root cause above"."""
        lines = [ln for ln in self.child_tail if ln.strip()]
        errors: list[str] = []
        for i, ln in enumerate(lines):
            m = _EXCEPTION_LINE.search(ln)
            if not m:
                continue
            error = m.group(1)
            # A multi-line message (pydantic's ValidationError): keep its first detail line.
            if (
                i + 1 < len(lines)
                and lines[i + 1][:1].isspace()
                and not lines[i + 1].lstrip().startswith("File ")
            ):
                error += ": " + lines[i + 1].strip()[:400]
            if error not in errors:
                errors.append(error)
        if errors:
            return " -> ".join(errors if len(errors) <= 3 else [errors[0], *errors[-2:]])
        return " | ".join(lines[-3:]) or "no output"

    async def _wait_ready(self, spec: ChildSpec) -> bool:
        """True once the child answers 200; False on a stop signal; LaunchError otherwise."""
        assert self.child is not None  # noqa: S101 - set by _start_child, which ran before
        deadline = time.monotonic() + self.args.start_timeout
        port = spec.ports["http"]
        while True:
            if self._stop.is_set():
                return False
            if self.child.returncode is not None:
                await asyncio.wait({self._tee}, timeout=2)
                raise LaunchError(
                    f"the engine failed to start (exit code {self.child.returncode}): {self._child_reason()}"
                )
            if time.monotonic() > deadline:
                raise LaunchError(f"the engine was not ready after {self.args.start_timeout:.0f}s")
            with contextlib.suppress(OSError, TimeoutError):
                status, _ = await http_get("127.0.0.1", port, spec.ready_path)
                if status == 200:
                    return True
            stop = asyncio.ensure_future(self._stop.wait())
            exited = asyncio.ensure_future(self.child.wait())
            await asyncio.wait({stop, exited}, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            exited.cancel()

    def _stopped_before_ready(self) -> int:
        log.info("stopped by %s before the engine was ready", self._stop_signal)
        self._set_phase("stopped")
        return EXIT_OK

    async def _drain(self, child_exit: asyncio.Future) -> int:
        args = self.args
        assert self.gate is not None and self.child is not None  # noqa: S101 - set before ready
        self._set_phase("draining")
        self.gate.close_listeners()
        open_conns = self.gate.open_connections
        # A port the child serves itself closes when it gets the SIGTERM (uvicorn's shutdown).
        log.info(
            "draining: relayed listeners closed, %d relayed connection(s) open; SIGTERM to the engine",
            open_conns,
        )
        with contextlib.suppress(ProcessLookupError):
            self.child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + args.drain_timeout + args.stop_grace
        done, _ = await asyncio.wait({child_exit}, timeout=max(deadline - time.monotonic(), 0))
        conns_done = await self.gate.wait_connections(max(deadline - time.monotonic(), 0))
        if not done:
            self.reason = (
                f"the engine did not stop within {args.drain_timeout + args.stop_grace:.0f}s; killed"
            )
            self._set_phase("failed")
            log.error(self.reason)
            return EXIT_FAILED
        code = child_exit.result()
        if code not in (0, -signal.SIGTERM):
            self.reason = f"the engine exited with code {code} while draining: {self._child_reason()}"
            self._set_phase("failed")
            log.error(self.reason)
            return EXIT_FAILED
        if not conns_done:
            log.warning(
                "%d relayed connection(s) still open at the deadline; closing them",
                self.gate.open_connections,
            )
        self._set_phase("stopped")
        return EXIT_OK

    async def _kill_child(self) -> None:
        child = self.child
        if child is None:
            return
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            await child.wait()
        else:
            # The leader is gone; its process group may still hold engine processes.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
        if getattr(self, "_tee", None) is not None:
            await asyncio.wait({self._tee}, timeout=2)


def _resolve_uri(uri: str) -> str:
    if "://" in uri and not uri.startswith("file://"):
        return uri
    path = uri[len("file://") :] if uri.startswith("file://") else uri
    # `bazel run` changes the directory; relative paths are the caller's.
    return os.path.abspath(
        os.path.join(os.environ.get("BUILD_WORKING_DIRECTORY", ""), os.path.expanduser(path))
    )


def materialize_only(args: argparse.Namespace) -> int:
    launcher = Launcher(args)
    try:
        m = launcher._materialize()
    except LaunchError as e:
        print(f"launcher: materialize failed: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    print(json.dumps(m.summary()), flush=True)
    return EXIT_OK


def _bad_bounds(args: argparse.Namespace) -> str | None:
    """Why a bound flag is unusable, or None."""
    if args.max_connections < 1:
        return f"--max-connections must be >= 1, got {args.max_connections}"
    if not math.isfinite(args.idle_timeout) or args.idle_timeout < 0:
        return f"--idle-timeout must be >= 0 seconds (0: never), got {args.idle_timeout}"
    if not math.isfinite(args.lock_timeout) or args.lock_timeout <= 0:
        return f"--lock-timeout must be > 0 seconds, got {args.lock_timeout}"
    if not math.isfinite(args.start_timeout) or args.start_timeout <= 0:
        return f"--start-timeout must be > 0 seconds, got {args.start_timeout}"
    for flag, seconds in (("--drain-timeout", args.drain_timeout), ("--stop-grace", args.stop_grace)):
        if not math.isfinite(seconds) or seconds < 0:
            return f"{flag} must be >= 0 seconds, got {seconds}"
    if args.child_cmd is not None:
        # Checked before anything starts: it used to fail only after materializing.
        sample = {f: 0 if f.endswith(("_port", "_fd")) else "x" for f in CHILD_CMD_FIELDS}
        try:
            child_argv(args.child_cmd, sample)
        except ValueError as e:
            return f"--child-cmd: {e}"
    for flag, port in (
        ("--port", args.port),
        ("--grpc-port", args.grpc_port),
        ("--admin-port", args.admin_port),
        ("--metrics-port", args.metrics_port),
    ):
        if port is not None and not 0 <= port <= 65535:
            return f"{flag} must be 0..65535 (0: any free port), got {port}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s launcher %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    env_budget = os.environ.get("PAVED_CACHE_MAX_BYTES")
    if args.cache_max_bytes is None and env_budget:
        try:
            args.cache_max_bytes = parse_size(env_budget)
        except argparse.ArgumentTypeError as e:
            print(f"launch: $PAVED_CACHE_MAX_BYTES (--cache-max-bytes): {e}", file=sys.stderr)
            return EXIT_USAGE
    if args.workers < 1 or args.max_attempts < 1 or args.part_size < MiB:
        print("launch: --workers and --max-attempts must be >= 1, --part-size >= 1MiB", file=sys.stderr)
        return EXIT_USAGE
    bad = _bad_bounds(args)
    if bad:
        print(f"launch: {bad}", file=sys.stderr)
        return EXIT_USAGE
    if args.materialize_only:
        return materialize_only(args)
    from paved.engine import vllm_env

    # The child (and vLLM's engine processes under it) inherit these defaults.
    vllm_env.apply_defaults()
    return asyncio.run(Launcher(args).run())


if __name__ == "__main__":
    sys.exit(main())

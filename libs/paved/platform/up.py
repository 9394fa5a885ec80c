"""`up`: the control plane, a gateway following its routes, the tiny model and the XGBoost
fixture, in one command.

What runs: the control plane (its dashboard at /dashboard), a gateway following its routes
(OpenAI API, KServe v2 HTTP on the same port, KServe v2 gRPC on PORT+1), the tiny LLM package
(it declares its KServe interface, so each replica serves KServe gRPC too) and the XGBoost
fixture as a kserve-mode package, both rolled out through the control plane's API; every
replica is a launcher with a metrics proxy port of its own.

Invariants:
  * Every process is an existing main started as a child (`python -m paved.control_plane.server`,
    `python -m paved.gateway.server`, `python -m moto.server`); nothing here serves requests.
  * Each child is the leader of its own process group, and every child (and every launcher and
    engine below it: they inherit the environment) carries `PAVED_PLATFORM=<token>`. `stop()`
    signals the groups, waits a bounded time, SIGKILLs what is left, then sweeps /proc for the
    token, so no process outlives the platform, whether it stops after a failed start, on
    Ctrl-C/SIGTERM/SIGHUP, or because a child died. A SIGKILL of `up` itself runs none of that:
    its guardian (paved.platform.guardian, started first) then ends them.
  * One admin key for the control plane and the gateway: read from `WORK/admin_key` or generated
    there (mode 0600); it reaches the children through files and the environment, never argv.
  * Loopback only; every HTTP call has a deadline and every wait loop a bound.
  * Usage errors raise `UsageError` (exit 2), runtime failures `PlatformError` (exit 1), each
    with a one-line message.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from paved import procs
from paved.control_plane.prometheus import MAX_RULES_INTERVAL_S, RULE_FILES, scrape_config
from paved.net import free_port
from paved.platform import guardian
from paved.platform import prometheus as local_prometheus
from paved.runfiles import runfile

HOST = "127.0.0.1"
MARKER_ENV = guardian.MARKER_ENV
MODEL_ID = "tiny"
VERSION = "v1"
TENANT = "demo"
SIM_ENGINE = "sim://tiny?tokens_per_s=200&max_num_seqs=64"
PORTS_PER_REGION = 200  # HTTP, admin, [KServe gRPC,] metrics per replica, room for a surge
CP_PORT_OFFSET = 10  # --port 8080: gateway 8080, control plane 8090 (their own defaults)
S3_BUCKET = "paved-models"
S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
}
HTTP_TIMEOUT_S = 10.0
XGB_MODEL_ID = "xgb_scorer"
KSERVE_PORT_OFFSET = 1  # --port 8080: the gateway's KServe v2 gRPC on 8081
MAX_PROMETHEUS_INTERVAL_S = MAX_RULES_INTERVAL_S
# The SLO tickets read 3-day windows (1x burn over 3d): with less history kept, rate(...[3d]) is
# silently the rate over what is left (2 days with Prometheus' default here).
PROMETHEUS_RETENTION = "4d"


class UsageError(Exception):
    """A bad flag or flag combination: exit status 2."""


class PlatformError(Exception):
    """The platform could not start or a child died: exit status 1."""


class _Stop(Exception):
    """Raised in the main thread by the SIGTERM/SIGHUP handler (SIGINT raises KeyboardInterrupt)."""


@dataclass
class Config:
    work_dir: Path
    port: int = 8080  # gateway; the control plane on port + 10; 0: any free ports
    replica_port_base: int = 30000  # region i's replicas on base + 200 i .. + 199
    state: str | None = None  # the control plane's; default sqlite:///WORK/control_plane.sqlite
    redis: str | None = None  # the gateway's limits
    regions: int = 1
    replicas: int = 1  # per region
    engine: str = "vllm"  # or "sim"
    s3: bool = False
    boot_timeout_s: float = 1800.0
    prometheus: bool = True  # Debian's prometheus on loopback, scraping the fleet
    prometheus_interval_s: int = 15  # its scrape and rule evaluation interval

    def validate(self) -> None:
        if self.work_dir.exists() and not self.work_dir.is_dir():
            raise UsageError(f"--work-dir {self.work_dir}: exists and is not a directory")
        if not (self.port == 0 or 1024 <= self.port <= 65535 - CP_PORT_OFFSET):
            raise UsageError(f"--port {self.port}: 0 (any free ports) or 1024..{65535 - CP_PORT_OFFSET}")
        if not 1 <= self.regions <= 8:
            raise UsageError(f"--regions {self.regions}: between 1 and 8")
        if not 1 <= self.replicas <= 32:
            raise UsageError(f"--replicas {self.replicas}: between 1 and 32")
        top = self.replica_port_base + PORTS_PER_REGION * self.regions - 1
        if self.replica_port_base < 1024 or top > 65535:
            raise UsageError(
                f"--replica-ports {self.replica_port_base}: ports {self.replica_port_base}-{top} must lie "
                "within 1024-65535"
            )
        if self.port and self.replica_port_base <= self.port + CP_PORT_OFFSET and self.port <= top:
            raise UsageError(f"--port {self.port} overlaps the replica ports {self.replica_port_base}-{top}")
        if not 1 <= self.prometheus_interval_s <= MAX_PROMETHEUS_INTERVAL_S:
            raise UsageError(
                f"--prometheus-interval {self.prometheus_interval_s}: between 1 and "
                f"{MAX_PROMETHEUS_INTERVAL_S} seconds (paved's rules take rates over 1 minute, which "
                "need 4 scrapes in it)"
            )
        if self.engine not in ("vllm", "sim"):
            raise UsageError(f"--engine {self.engine!r}: vllm or sim")
        if self.state is not None:
            _check_state(self.state)
        if self.redis is not None:
            _check_redis(self.redis)

    def region_args(self) -> list[tuple[str, int, int]]:
        names = ["local"] if self.regions == 1 else [f"r{i + 1}" for i in range(self.regions)]
        out = []
        for i, name in enumerate(names):
            lo = self.replica_port_base + PORTS_PER_REGION * i
            out.append((name, lo, lo + PORTS_PER_REGION - 1))
        return out


def _check_state(state: str) -> None:
    if state.startswith("sqlite:///"):
        path = state.removeprefix("sqlite:///")
        if not path or path.endswith("/"):
            raise UsageError(f"--state {state!r}: sqlite:///PATH names a file")
        return
    parts = urllib.parse.urlsplit(state)
    if parts.scheme not in (
        "postgresql",
        "postgresql+psycopg",
        "postgresql+psycopg2",
    ) or not parts.path.strip("/"):
        raise UsageError(f"--state {state!r}: sqlite:///PATH or postgresql://USER@HOST:PORT/DB")


def _check_redis(url: str) -> None:
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("redis", "rediss") or not parts.hostname or port == -1:
        raise UsageError(f"--redis {url!r}: redis://HOST:PORT/DB")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--work-dir",
        help="state, keys, logs and replica dirs (default: a new directory under the system temp dir)",
    )
    p.add_argument(
        "--port",
        type=_int("--port"),
        default=8080,
        help="gateway port; the control plane listens on PORT+10 (default 8080; 0: any free ports)",
    )
    p.add_argument(
        "--replica-ports",
        type=_int("--replica-ports"),
        default=30000,
        metavar="BASE",
        help=f"region i's replicas use ports BASE+{PORTS_PER_REGION}i.. (default 30000)",
    )
    p.add_argument(
        "--state",
        help="the control plane's store: sqlite:///PATH (default in the work dir) or postgresql://...",
    )
    p.add_argument("--redis", metavar="URL", help="redis://HOST:PORT/DB for the gateway's shared limits")
    p.add_argument("--regions", type=_int("--regions"), default=1, help="regions of local replicas (1..8)")
    p.add_argument("--replicas", type=_int("--replicas"), default=1, help="replicas per region (1..32)")
    p.add_argument(
        "--engine",
        default="vllm",
        choices=("vllm", "sim"),
        help="vllm (the tiny model on vLLM) or sim (the simulated engine: many replicas, no vLLM)",
    )
    p.add_argument("--s3", action="store_true", help="serve the package from a loopback S3 (moto)")
    p.add_argument(
        "--boot-timeout", type=float, default=1800.0, help="seconds for every replica to be ready (1800)"
    )
    p.add_argument(
        "--no-prometheus",
        action="store_true",
        help="do not start Prometheus (by default /usr/bin/prometheus scrapes the fleet on a free loopback "
        "port, with paved's rules and alerts)",
    )
    p.add_argument(
        "--prometheus-interval",
        type=_int("--prometheus-interval"),
        default=15,
        metavar="SECONDS",
        help="Prometheus' scrape and rule evaluation interval (1..15, default 15)",
    )


def _int(flag: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: not an integer") from None

    return parse


def config_from_args(args: argparse.Namespace) -> Config:
    if args.work_dir:
        # `bazel run` starts mains in the runfiles tree: relative paths are the caller's.
        base = os.environ.get("BUILD_WORKING_DIRECTORY", "")
        work_dir = Path(base, os.path.expanduser(args.work_dir)).absolute()
    else:
        work_dir = Path(tempfile.gettempdir(), "paved-up-(new)")  # made once the flags are valid
    if not 0 < args.boot_timeout <= 86400:
        raise UsageError(f"--boot-timeout {args.boot_timeout}: between 0 and 86400 seconds")
    cfg = Config(
        work_dir=work_dir,
        port=args.port,
        replica_port_base=args.replica_ports,
        state=args.state,
        redis=args.redis,
        regions=args.regions,
        replicas=args.replicas,
        engine=args.engine,
        s3=args.s3,
        boot_timeout_s=args.boot_timeout,
        prometheus=not args.no_prometheus,
        prometheus_interval_s=args.prometheus_interval,
    )
    cfg.validate()
    if not args.work_dir:
        cfg.work_dir = Path(tempfile.mkdtemp(prefix="paved-up-"))
    return cfg


class _Child:
    """One main in its own process group; stdout and stderr appended to `log`."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path):
        self.name = name
        self.log = log
        self._out: IO[bytes] = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self._lines: list[str] = []
        self._seen = threading.Condition()
        self.proc = subprocess.Popen(  # noqa: S603 - argv built by Platform, no shell
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._out,
            env=env,
            cwd=cwd,
            start_new_session=True,  # its own group: stop() signals it and whatever it forked
        )
        threading.Thread(target=self._pump, name=f"{name}-stdout", daemon=True).start()

    def _pump(self) -> None:
        stdout = self.proc.stdout
        if stdout is None:  # never: Popen(stdout=PIPE)
            return
        for raw in stdout:
            with contextlib.suppress(ValueError):  # the log closed by stop()
                self._out.write(raw)
                self._out.flush()
            with self._seen:
                self._lines.append(raw.decode(errors="replace"))
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    def wait_line(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        checked = 0
        with self._seen:
            while True:
                for line in self._lines[checked:]:
                    match = pattern.search(line)
                    if match:
                        return match
                checked = len(self._lines)
                left = deadline - time.monotonic()
                if self.proc.poll() is not None:
                    raise PlatformError(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
                if left <= 0:
                    raise PlatformError(f"{self.name} did not start within {timeout_s:.0f} s; see {self.log}")
                self._seen.wait(min(left, 0.5))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout_s: float) -> None:
        """SIGTERM to the group, then SIGKILL once `timeout_s` has passed."""
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                print(f"up: {self.name} still running after {timeout_s:.0f} s; killing it", file=sys.stderr)
        # The group too: a grandchild may outlive its parent.
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._out.close()


def marked_processes(token: str) -> dict[int, str]:
    """pid -> command line of every live process carrying PAVED_PLATFORM=token."""
    return procs.marked_processes(MARKER_ENV, token)


@dataclass
class Platform:
    """`start()` brings everything up (printing progress through `say`), `stop()` takes it
    all down; `stop()` is safe to call at any point, and more than once."""

    cfg: Config
    say: Callable[[str], None] = field(default=lambda line: print(line, flush=True))
    token: str = field(default_factory=lambda: secrets.token_hex(8))

    def __post_init__(self) -> None:
        self.children: list[_Child] = []
        self.admin_key = ""
        self.api_key = ""
        self.gateway_url = ""
        self.control_plane_url = ""
        self.s3_endpoint: str | None = None
        self.package_uri = ""
        self.replicas: list[dict[str, Any]] = []
        self.xgb_replicas: list[dict[str, Any]] = []
        self.xgb_package_uri = ""
        self.kserve_grpc = ""
        self.prometheus_url = ""
        self.rules_dir: Path | None = None
        self._stopped = False
        self._guardian: subprocess.Popen[bytes] | None = None

    # -- start -------------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        work = cfg.work_dir
        try:
            work.mkdir(parents=True, exist_ok=True)
            (work / "logs").mkdir(exist_ok=True)
        except OSError as e:
            raise PlatformError(f"--work-dir {work}: {e.strerror}") from None
        self.admin_key = self._admin_key(work / "admin_key")
        env = dict(os.environ)
        # The children import paved from where this process does (a `bazel run` runfiles tree).
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        self._start_guardian(env)  # first, and without the token: nothing may outlive this process
        env[MARKER_ENV] = self.token
        env["PAVED_ADMIN_KEY"] = self.admin_key
        env["PAVED_ROUTES_TOKEN"] = self.admin_key  # the gateway's --routes-token default
        env.pop("PAVED_STATE_DIR", None)  # every path below is explicit

        package = self._package("tiny_kserve_package.tar")
        xgb = self._package("xgb_package.tar")
        if cfg.s3:
            env.update(S3_CREDENTIALS)
            self.package_uri, self.xgb_package_uri = self._start_s3(env, [package, xgb])
            # The control plane reads the package too (its fingerprint), with a client that
            # finds the endpoint in the environment.
            env["AWS_ENDPOINT_URL_S3"] = self.s3_endpoint or ""
        else:
            self.package_uri, self.xgb_package_uri = package, xgb

        gw_port = cfg.port or free_port(HOST)
        kserve_port = cfg.port + KSERVE_PORT_OFFSET if cfg.port else 0
        cp_port = cfg.port + CP_PORT_OFFSET if cfg.port else free_port(HOST)
        state = cfg.state or f"sqlite:///{work / 'control_plane.sqlite'}"
        regions = cfg.region_args()
        cp_argv = [
            sys.executable, "-m", "paved.control_plane.server",
            "--host", HOST, "--port", str(cp_port),
            "--state", state,
            "--work-dir", str(work / "replicas"),
            "--cache-dir", str(work / "cache"),
            "--gateway-metrics", f"http://{HOST}:{gw_port}/metrics",
            "--stop-replicas-on-exit",
        ]  # fmt: skip
        for name, lo, hi in regions:
            cp_argv += ["--region", f"{name}={lo}-{hi}"]
        file_sd = work / "prometheus" / "targets.json"
        if cfg.prometheus:
            # Known before the control plane starts: its dashboard links to the graphs there.
            prom_port = free_port(HOST)
            self.prometheus_url = f"http://{HOST}:{prom_port}"
            self.rules_dir = _rules_dir()
            try:
                file_sd.parent.mkdir(exist_ok=True)
            except OSError as e:
                raise PlatformError(f"{file_sd.parent}: {e.strerror}") from None
            cp_argv += ["--prometheus-file-sd", str(file_sd), "--prometheus-url", self.prometheus_url]
        if self.s3_endpoint:
            cp_argv += ["--s3-endpoint-url", self.s3_endpoint]
        self.say(f"starting the control plane ({_redact(state)}; {len(regions)} region(s))")
        cp = self._spawn("control plane", cp_argv, env, "control_plane.log")
        self.control_plane_url = cp.wait_line(
            re.compile(r"serving control plane on (http://\S+)"), 120
        ).group(1)
        if cfg.prometheus:
            self._start_prometheus(prom_port, file_sd)

        gw_argv = [
            sys.executable, "-m", "paved.gateway.server",
            "--routes", f"{self.control_plane_url}/v1/routes",
            "--routes-cache", str(work / "routes_cache.json"),
            "--host", HOST, "--port", str(gw_port),
            "--kserve-grpc-port", str(kserve_port),
            "--state", f"sqlite:///{work / 'gateway.sqlite'}",
            "--bootstrap-tenant", TENANT,
            "--bootstrap-key-file", str(work / f"{TENANT}.key"),
        ]  # fmt: skip
        if cfg.redis:
            gw_argv += ["--redis", cfg.redis]
        self.say("starting the gateway (following the control plane's routes)")
        gw = self._spawn("gateway", gw_argv, env, "gateway.log")
        self.gateway_url = gw.wait_line(re.compile(r"serving gateway on (http://\S+)"), 120).group(1)
        grpc = gw.wait_line(re.compile(r"gateway KServe v2 gRPC (\d+) on"), 30).group(1)
        self.kserve_grpc = f"{HOST}:{grpc}"
        try:
            self.api_key = (work / f"{TENANT}.key").read_text().strip()
        except OSError as e:
            raise PlatformError(f"the gateway wrote no key for tenant {TENANT}: {e.strerror}") from None

        names = [name for name, _, _ in regions]
        self._deploy(
            MODEL_ID, self.package_uri, names, cfg.replicas, SIM_ENGINE if cfg.engine == "sim" else "package"
        )
        # The classic model is cheap: one replica per region, whatever --replicas says.
        self._deploy(XGB_MODEL_ID, self.xgb_package_uri, names, 1, "package")
        self.replicas = self._wait_replicas(MODEL_ID, cfg.replicas * len(regions))
        self.xgb_replicas = self._wait_replicas(XGB_MODEL_ID, len(regions))
        self._wait_served()

    def _start_prometheus(self, port: int, file_sd: Path) -> None:
        """Debian's prometheus on 127.0.0.1:`port`, discovering the fleet from the file the
        control plane keeps (file_sd: no credentials to hand over), with paved's rules."""
        cfg = self.cfg
        home = cfg.work_dir / "prometheus"
        interval = f"{cfg.prometheus_interval_s}s"
        rules = [str(self.rules_dir / Path(f).name) for f in RULE_FILES] if self.rules_dir else []
        text = scrape_config(
            file_sd=str(file_sd),
            rule_files=rules,
            scrape_interval=interval,
            evaluation_interval=interval,
            refresh_interval=interval,
        )
        config = home / "prometheus.yml"
        try:
            config.write_text(text)
            argv = local_prometheus.argv(config, home / "data", port, retention=PROMETHEUS_RETENTION)
        except OSError as e:
            raise PlatformError(f"{config}: {e.strerror}") from None
        except local_prometheus.PrometheusError as e:
            raise PlatformError(f"{e} (or --no-prometheus)") from None
        # The platform's environment without the admin key (Prometheus needs none), so whatever
        # marks this platform's processes (its own marker, a supervisor's) marks Prometheus too.
        env = {k: v for k, v in os.environ.items() if k != "PAVED_ADMIN_KEY"}
        env[MARKER_ENV] = self.token
        self.say(
            f"starting Prometheus on {self.prometheus_url} (every {interval}; rules from {self.rules_dir})"
        )
        child = self._spawn("prometheus", argv, env, "prometheus.log")
        try:
            local_prometheus.wait_ready(self.prometheus_url, child.proc, 60, child.log)
        except local_prometheus.PrometheusError as e:
            raise PlatformError(str(e)) from None

    def _start_guardian(self, env: dict[str, str]) -> None:
        """paved.platform.guardian, in a session of its own, reading a pipe whose write end only
        this process holds: if this process dies without stop() (SIGKILL), the kernel closes
        the pipe and the guardian ends everything carrying the token."""
        with open(self.cfg.work_dir / "logs" / "guardian.log", "ab") as log:
            try:
                self._guardian = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                    [sys.executable, "-m", "paved.platform.guardian", self.token],
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=log,
                    env=env,
                    cwd=self.cfg.work_dir,
                    start_new_session=True,
                )
            except OSError as e:
                raise PlatformError(f"cannot start the guardian process: {e.strerror or e}") from None

    def _release_guardian(self) -> None:
        """After stop()'s own sweep: the guardian reads EOF, finds nothing and exits."""
        child, self._guardian = self._guardian, None
        if child is None:
            return
        with contextlib.suppress(OSError):
            if child.stdin is not None:
                child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], log: str) -> _Child:
        child = _Child(name, argv, env, self.cfg.work_dir / "logs" / log, self.cfg.work_dir)
        self.children.append(child)
        return child

    @staticmethod
    def _admin_key(path: Path) -> str:
        try:
            key = path.read_text().strip()
        except FileNotFoundError:
            key = ""
        except (OSError, UnicodeDecodeError) as e:
            # A directory, an unreadable file or bytes that are not text: say which, not a traceback.
            raise PlatformError(
                f"cannot read the admin key from {path}: {getattr(e, 'strerror', None) or e}"
            ) from None
        if key:
            return key
        key = "adm-" + secrets.token_hex(24)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            raise PlatformError(f"cannot write the admin key to {path}: {e.strerror}") from None
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        os.chmod(path, 0o600)
        return key

    @staticmethod
    def _package(name: str) -> str:
        try:
            return runfile(f"services/launcher/{name}")
        except FileNotFoundError:
            target = name.removesuffix(".tar")
            raise PlatformError(
                f"no {name}: run through Bazel, or `tools/bazel build //services/launcher:{target}`"
            ) from None

    def _start_s3(self, env: dict[str, str], packages: list[str]) -> list[str]:
        port = free_port(HOST)
        self.say(f"starting a loopback S3 (moto) on port {port}")
        s3 = self._spawn(
            "s3", [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)], env, "s3.log"
        )
        self.s3_endpoint = f"http://{HOST}:{port}"
        deadline = time.monotonic() + 60
        while True:
            if not s3.alive():
                raise PlatformError(f"the S3 server exited; see {s3.log}")
            try:
                httpx.get(self.s3_endpoint + "/moto-api/", timeout=2)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise PlatformError(f"the S3 server did not answer within 60 s; see {s3.log}") from None
                time.sleep(0.2)
        import boto3  # only with --s3
        from botocore.config import Config as BotoConfig

        client = boto3.client(
            "s3",
            endpoint_url=self.s3_endpoint,
            aws_access_key_id=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=S3_CREDENTIALS["AWS_DEFAULT_REGION"],
            config=BotoConfig(s3={"addressing_style": "path"}, connect_timeout=5, read_timeout=60),
        )
        client.create_bucket(Bucket=S3_BUCKET)
        uris = []
        for package in packages:
            key = f"{VERSION}/{os.path.basename(package)}"
            client.upload_file(package, S3_BUCKET, key)
            uris.append(f"s3://{S3_BUCKET}/{key}")
        return uris

    def api(self, method: str, path: str, body: Any = None) -> httpx.Response:
        try:
            return httpx.request(
                method,
                self.control_plane_url + path,
                json=body,
                headers={"Authorization": f"Bearer {self.admin_key}"},
                timeout=HTTP_TIMEOUT_S,
            )
        except httpx.HTTPError as e:
            raise PlatformError(f"control plane {method} {path}: {type(e).__name__}: {e}") from None

    def _deploy(self, model_id: str, package_uri: str, regions: list[str], n: int, engine: str) -> None:
        body = {
            "model_id": model_id,
            "version": VERSION,
            "package_uri": package_uri,
            "replicas": n,
            # --replicas is what runs: the autoscaler keeps it there.
            "min_replicas": n,
            "max_replicas": n,
            "regions": regions,
            "engine": engine,
        }
        r = self.api("POST", "/v1/deployments", body)
        if r.status_code == 409:
            self.say(
                f"{model_id}@{VERSION} is already registered (a reused work dir): its replicas come back"
            )
        elif r.status_code not in (200, 201):
            raise PlatformError(f"registering {model_id}@{VERSION}: {r.status_code} {_error(r)}")
        else:
            self.say(f"registered {model_id}@{VERSION} from {package_uri} (engine {engine})")
        r = self.api("POST", "/v1/rollouts", {"model_id": model_id, "version": VERSION, "params": {}})
        if r.status_code == 409:
            self.say(f"rollout of {model_id}@{VERSION}: {_error(r)}")
        elif r.status_code not in (200, 201):
            raise PlatformError(f"rolling out {model_id}@{VERSION}: {r.status_code} {_error(r)}")
        else:
            self.say(f"rollout {r.json()['id']}: {n} replica(s) in each of {', '.join(regions)}")

    def _check_children(self) -> None:
        for child in self.children:
            if not child.alive():
                raise PlatformError(f"{child.name} exited with {child.proc.returncode}; see {child.log}")

    def _wait_replicas(self, model_id: str, want: int) -> list[dict[str, Any]]:
        deadline = time.monotonic() + self.cfg.boot_timeout_s
        states: dict[str, str] = {}
        while True:
            self._check_children()
            r = self.api("GET", f"/v1/replicas?model_id={model_id}")
            if r.status_code != 200:
                raise PlatformError(f"control plane GET /v1/replicas: {r.status_code} {_error(r)}")
            replicas = r.json()["data"]
            for rep in replicas:
                if states.get(rep["id"]) != rep["state"]:
                    states[rep["id"]] = rep["state"]
                    why = f" ({rep['reason']})" if rep.get("reason") else ""
                    self.say(
                        f"replica {rep['id']} {rep['model_id']}@{rep['version']} [{rep['region']}] "
                        f"{rep['url']}: {rep['state']}{why}"
                    )
            ready = [rep for rep in replicas if rep["state"] == "ready"]
            if len(ready) >= want:
                ready.sort(key=lambda rep: (rep["region"], rep["id"]))
                return ready
            if time.monotonic() > deadline:
                raise PlatformError(
                    f"{len(ready)} of {want} {model_id} replicas ready after "
                    f"{self.cfg.boot_timeout_s:.0f} s; "
                    f"see {self.cfg.work_dir / 'replicas'}"
                )
            time.sleep(0.5)

    def _wait_served(self) -> None:
        """Until one chat completion through the gateway answers 200: the gateway has the routes
        and has found the backends healthy."""
        deadline = time.monotonic() + 120
        last = ""
        while time.monotonic() < deadline:
            self._check_children()
            try:
                r = httpx.post(
                    self.gateway_url + "/v1/chat/completions",
                    headers={"Authorization": f"Bearer {self.api_key}"},
                    json={
                        "model": MODEL_ID,
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 1,
                    },
                    timeout=60,
                )
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {_error(r)}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(0.5)
        raise PlatformError(f"the gateway does not serve {MODEL_ID} after 120 s: {last}")

    def summary(self) -> list[str]:
        lines = [
            f"paved platform is up (work dir {self.cfg.work_dir}, logs in {self.cfg.work_dir / 'logs'}):",
            f"  gateway: {self.gateway_url}  (OpenAI API at {self.gateway_url}/v1, KServe v2 HTTP "
            f"at {self.gateway_url}/v2)",
            f"  gateway KServe v2 gRPC: {self.kserve_grpc}  (models {MODEL_ID}, {XGB_MODEL_ID})",
            f"  control plane: {self.control_plane_url}",
        ]
        if self.prometheus_url:
            lines.append(
                f"  prometheus: {self.prometheus_url}  (alerts at {self.prometheus_url}/alerts; targets from "
                f"{self.cfg.work_dir / 'prometheus' / 'targets.json'})"
            )
        if self.s3_endpoint:
            lines.append(f"  s3: {self.s3_endpoint}  (package {self.package_uri})")
        for rep in [*self.replicas, *self.xgb_replicas]:
            lines.append(
                f"  replica {rep['id']} {rep['model_id']}@{rep['version']} [{rep['region']}]: {rep['url']}"
                f"  metrics: {rep.get('metrics_url') or rep['url'] + '/metrics'}"
            )
        lines += [
            f"  admin key: {self.admin_key}  (also in {self.cfg.work_dir / 'admin_key'})",
            f"  api key ({TENANT}): {self.api_key}",
            f"  pids: {' '.join(str(c.proc.pid) for c in self.children)}",
            f"try: curl {self.gateway_url}/v1/chat/completions -H 'Authorization: Bearer {self.api_key}' "
            f'-H \'Content-Type: application/json\' -d \'{{"model": "{MODEL_ID}", "messages": '
            '[{"role": "user", "content": "hello"}]}\'',
            "Ctrl-C (or SIGTERM, or closing the terminal) stops everything.",
        ]
        return lines

    def wait(self) -> None:
        """Until a child dies (PlatformError); signals interrupt it."""
        while True:
            self._check_children()
            time.sleep(0.5)

    # -- stop --------------------------------------------------------------------------------
    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        by_name = {c.name: c for c in self.children}
        # The gateway first (no new traffic), then the control plane, which drains its replicas
        # (--stop-replicas-on-exit), then the S3 they may still read from.
        # Prometheus goes first: it would only record the others going down.
        for name, timeout_s in (
            ("prometheus", 10.0),
            ("gateway", 20.0),
            ("control plane", 90.0),
            ("s3", 10.0),
        ):
            child = by_name.get(name)
            if child is not None:
                child.stop(timeout_s)
        # Replicas run in their own sessions (a control plane that crashed leaves them running):
        # whatever still carries the token is ended here.
        guardian.sweep(self.token, 15.0)
        self._release_guardian()


def _rules_dir() -> Path | None:
    """ops/prometheus/rules: in the runfiles (a Bazel run), else in this checkout; None when
    neither has it (Prometheus then runs without rules)."""
    with contextlib.suppress(FileNotFoundError):
        return Path(runfile(f"ops/prometheus/{RULE_FILES[0]}")).parent
    here = Path(__file__).resolve().parents[3] / "ops" / "prometheus" / "rules"
    return here if here.is_dir() else None


def _redact(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    return url


def _error(r: httpx.Response) -> str:
    try:
        body = r.json()
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
    except ValueError:
        message = None
    return " ".join(str(message or r.text[:200]).split())


def run(args: argparse.Namespace, prog: str = "up") -> int:
    """Start, print the summary, wait for a signal or a dead child, stop. Exit status."""
    try:
        cfg = config_from_args(args)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    platform = Platform(cfg)

    def on_term(signum: int, frame: Any) -> None:
        raise _Stop

    # SIGHUP too: closing the terminal (or losing the ssh session) `up` runs in kills it by
    # default, and its children, each in a session of its own, would not get the hangup and
    # would run on without it.
    previous = {sig: signal.signal(sig, on_term) for sig in _STOP_SIGNALS}
    status = 0
    try:
        platform.start()
        for line in platform.summary():
            print(line, flush=True)
        platform.wait()
    except (KeyboardInterrupt, _Stop):
        _report(f"{prog}: stopping")
    except PlatformError as e:
        _report(f"{prog}: error: {e}", sys.stderr)
        status = 1
    finally:
        # A second Ctrl-C must not cut the teardown short: every wait in stop() is bounded.
        for sig in (*_STOP_SIGNALS, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        try:
            platform.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            signal.signal(signal.SIGINT, signal.default_int_handler)
    _report(f"{prog}: stopped")
    return status


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _report(line: str, stream: IO[str] | None = None) -> None:
    """Print `line`; a terminal that has hung up (EIO) or a closed pipe must not turn the
    teardown's messages into a traceback."""
    with contextlib.suppress(OSError):
        print(line, file=stream or sys.stdout, flush=True)


def build_parser(prog: str = "up") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="The paved platform on this machine: control plane, gateway and the tiny model.",
    )
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

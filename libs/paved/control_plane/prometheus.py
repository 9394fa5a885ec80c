"""Prometheus and the control plane: service discovery of the fleet, the control plane's own
metrics, the scrape config that ties them together, and the SLO rules generated from one small
objectives file (ops/prometheus/slos.yaml).

Service discovery (`target_groups`, served as `GET /v1/prometheus/targets` behind the admin key,
and written as a file_sd JSON file by `FileSdWriter`) is Prometheus' http_sd / file_sd format: a
JSON list of `{"targets": ["host:port"], "labels": {...}}`. Invariants callers rely on:
- one group per endpoint, in a stable order (replicas by model, version, region, id; then the
  gateways in the order given; then the control plane): the same fleet gives the same bytes, so a
  file_sd writer can compare and Prometheus sees no spurious changes;
- only `ready` replicas with a metrics_url are listed (a starting replica's metrics are not worth
  a failed scrape, a draining one is leaving); their labels are `paved_role="replica"`,
  `paved_model`, `paved_version`, `paved_region`, `paved_replica`; gateways carry
  `paved_role="gateway"`, the control plane `paved_role="control_plane"`; `__metrics_path__` (and
  `__scheme__` for https, `__param_*` for a query) carry the rest of each metrics URL;
- no label value is ever empty (Prometheus treats an empty label as absent).

The SLO rules (`slo_rules`) are multi-window multi-burn-rate alerts (the Google SRE workbook,
"Alerting on SLOs", method 6): page when the error budget burns 14.4x over 1h and 5m or 6x over
6h and 30m, ticket at 3x over 1d and 2h or 1x over 3d and 6h. The SLIs are the gateways'
(`paved_gateway_requests_total` by `model` alias: 5xx are errors; 4xx, 429 and 499 are the
callers'), and `paved_gateway_request_duration_seconds` (a request is slow above the model's
latency threshold, which must be one of that histogram's buckets).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import tempfile
import urllib.parse
from collections import Counter as _Tally
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.utils import floatToGoString

from paved.control_plane.errors import ControlError
from paved.control_plane.store import ControlStore
from paved.control_plane.types import Deployment, Replica
from paved.gateway.errors import GatewayError
from paved.gateway.metrics import _LATENCY_BUCKETS as GATEWAY_LATENCY_BUCKETS

logger = logging.getLogger("paved.control_plane.prometheus")

ROLES = ("replica", "gateway", "control_plane")
TARGETS_PATH = "/v1/prometheus/targets"
METRICS_PATH = "/metrics"
CONTROL_PLANE_PREFIX = "paved_control_plane_"

TargetGroup = dict[str, Any]


# -- service discovery --------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricsEndpoint:
    """A metrics URL split the way Prometheus wants it: `target` host:port and the labels that
    rebuild the rest (`__metrics_path__`, `__scheme__` unless http, `__param_<name>`)."""

    target: str
    labels: dict[str, str]


def metrics_endpoint(url: str) -> MetricsEndpoint:
    """ValueError unless `url` is http(s)://HOST[:PORT]/PATH[?QUERY] (the port defaults to the
    scheme's)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"metrics URL {url!r:.200}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.fragment:
        raise ValueError(f"metrics URL {url!r:.200}: expected http(s)://HOST:PORT/PATH")
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    labels = {"__metrics_path__": parts.path or "/metrics"}
    if parts.scheme != "http":
        labels["__scheme__"] = parts.scheme
    for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"metrics URL {url!r:.200}: query parameter {name!r} is not a label name")
        labels[f"__param_{name}"] = value
    return MetricsEndpoint(f"{host}:{port}", labels)


def target_groups(
    deployments: Iterable[Deployment],
    replicas: Iterable[Replica],
    gateway_metrics: Sequence[str] = (),
    control_plane_metrics: str | None = None,
) -> list[TargetGroup]:
    """The http_sd / file_sd document for this fleet (see the module docstring for its
    invariants). A replica whose metrics_url cannot be split is left out with a warning: one bad
    record must not hide the rest of the fleet from Prometheus."""
    by_id = {d.id: d for d in deployments}
    listed: list[tuple[tuple[str, ...], TargetGroup]] = []
    for r in replicas:
        d = by_id.get(r.deployment_id)
        if r.state != "ready" or not r.metrics_url or d is None:
            continue
        try:
            endpoint = metrics_endpoint(r.metrics_url)
        except ValueError as e:
            logger.warning("replica %s left out of service discovery: %s", r.id, e)
            continue
        labels = {
            **endpoint.labels,
            "paved_role": "replica",
            "paved_model": d.spec.model_id,
            "paved_version": d.spec.version,
            "paved_region": r.region,
            "paved_replica": r.id,
        }
        key = (d.spec.model_id, d.spec.version, r.region, r.id)
        listed.append((key, {"targets": [endpoint.target], "labels": labels}))
    groups = [group for _, group in sorted(listed, key=lambda kv: kv[0])]
    for url in gateway_metrics:
        endpoint = metrics_endpoint(url)
        groups.append({"targets": [endpoint.target], "labels": {**endpoint.labels, "paved_role": "gateway"}})
    if control_plane_metrics:
        endpoint = metrics_endpoint(control_plane_metrics)
        groups.append(
            {"targets": [endpoint.target], "labels": {**endpoint.labels, "paved_role": "control_plane"}}
        )
    return groups


async def discover(
    store: ControlStore, gateway_metrics: Sequence[str] = (), control_plane_metrics: str | None = None
) -> list[TargetGroup]:
    """`target_groups` over the store's deployments (deleted ones too: a replica may outlive its
    deployment's deletion for a drain) and replicas."""
    deployments = await store.list_deployments(include_deleted=True)
    replicas = await store.list_replicas(states=("ready",))
    return target_groups(deployments, replicas, gateway_metrics, control_plane_metrics)


def dumps_targets(groups: list[TargetGroup]) -> str:
    """The file_sd bytes: stable (sorted keys) so equal fleets compare equal."""
    return json.dumps(groups, indent=2, sort_keys=True) + "\n"


def write_file_sd(path: str | os.PathLike[str], groups: list[TargetGroup]) -> None:
    """Writes atomically (a temporary file in the same directory, then rename): Prometheus
    watches the file and must never read half of it."""
    target = Path(path)
    text = dumps_targets(groups)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class FileSdWriter:
    """Keeps a file_sd JSON file equal to `produce()`: polls every `interval_s`, rewrites only
    when the document changed (and once at start). A failing `produce` (store down) or write
    keeps the last good file: Prometheus goes on scraping the fleet it knew."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        produce: Callable[[], Awaitable[list[TargetGroup]]],
        *,
        interval_s: float = 2.0,
    ):
        if not (math.isfinite(interval_s) and 0.01 <= interval_s <= 3600):
            raise ValueError("interval_s must be within 0.01..3600 seconds")
        self.path = Path(path)
        self.interval_s = interval_s
        self._produce = produce
        self._written: str | None = None
        self._task: asyncio.Task[None] | None = None
        self.writes = 0

    async def refresh(self) -> bool:
        """One pass: True when the file was (re)written."""
        groups = await self._produce()
        text = dumps_targets(groups)
        if text == self._written:
            return False
        await asyncio.to_thread(write_file_sd, self.path, groups)
        self._written = text
        self.writes += 1
        return True

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - keep the last good file, retry next pass
                logger.warning("file_sd %s not refreshed: %s", self.path, e)
            await asyncio.sleep(self.interval_s)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="prometheus-file-sd")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


# -- the control plane's own metrics ------------------------------------------------------------


class _Families:
    def __init__(self, families: list[GaugeMetricFamily]):
        self._families = families

    def collect(self) -> Iterable[GaugeMetricFamily]:
        return self._families


async def control_plane_families(store: ControlStore, *, is_leader: bool = True) -> list[GaugeMetricFamily]:
    """The fleet as the store records it, read at scrape time (every control plane replica
    answers the same; `paved_control_plane_leader` tells which one leads):

    - paved_control_plane_replicas{model,version,region,state}: replicas by state;
    - paved_control_plane_desired_replicas{model,version,region}: what active deployments want;
    - paved_control_plane_rollouts{model,status}: rollouts on record by status (records are never
      deleted, so each status' count only grows but for `running`);
    - paved_control_plane_leader: 1 on the replica running the controller.
    """
    deployments = await store.list_deployments(include_deleted=True)
    by_id = {d.id: d for d in deployments}
    replicas = _Tally(
        (by_id[r.deployment_id].spec.model_id, by_id[r.deployment_id].spec.version, r.region, r.state)
        for r in await store.list_replicas()
        if r.deployment_id in by_id
    )
    family = GaugeMetricFamily(
        "paved_control_plane_replicas",
        "Replicas on record by model, version, region and state.",
        labels=["model", "version", "region", "state"],
    )
    for labels, count in sorted(replicas.items()):
        family.add_metric(list(labels), count)
    desired = GaugeMetricFamily(
        "paved_control_plane_desired_replicas",
        "Replicas an active deployment wants per region (the autoscaler and rollouts move it).",
        labels=["model", "version", "region"],
    )
    for d in deployments:
        if d.state != "active":
            continue
        for region, n in sorted((await store.get_desired(d.id)).items()):
            desired.add_metric([d.spec.model_id, d.spec.version, region], n)
    rollouts = GaugeMetricFamily(
        "paved_control_plane_rollouts",
        "Rollouts on record by model and status (running, succeeded, rolled_back, failed, halted).",
        labels=["model", "status"],
    )
    for (model, status), count in sorted((await store.rollout_counts()).items()):
        rollouts.add_metric([model, status], count)
    leader = GaugeMetricFamily(
        "paved_control_plane_leader", "1 when this control plane runs the controller (holds the lock)."
    )
    leader.add_metric([], 1.0 if is_leader else 0.0)
    return [family, desired, rollouts, leader]


async def control_plane_exposition(store: ControlStore, *, is_leader: bool = True) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(await control_plane_families(store, is_leader=is_leader)))
    return generate_latest(registry)


def prometheus_router(
    store: ControlStore,
    check_admin: Callable[[str | None], None],
    *,
    gateway_metrics: Sequence[str] = (),
    control_plane_metrics: Callable[[], str | None] = lambda: None,
    is_leader: Callable[[], bool] = lambda: True,
) -> APIRouter:
    """`GET /v1/prometheus/targets` (admin key: Prometheus' `authorization` block sends it as a
    Bearer token) and `GET /metrics` (open, like every paved process' /metrics: counts by model
    name, nothing secret). `control_plane_metrics` is called per request because the control
    plane learns its own address only once it is bound; `gateway_metrics` URLs are checked here,
    so a bad one fails at start, not at the first scrape."""
    gateways = list(gateway_metrics)
    for url in gateways:
        metrics_endpoint(url)
    router = APIRouter()

    @router.get(TARGETS_PATH)
    async def targets(request: Request) -> Response:
        try:
            check_admin(request.headers.get("authorization"))
        except GatewayError as e:
            raise ControlError(e.status, e.message, code=e.code, headers=e.headers) from None
        groups = await discover(store, gateways, control_plane_metrics())
        return Response(dumps_targets(groups), media_type="application/json")

    @router.get(METRICS_PATH)
    async def metrics() -> Response:
        body = await control_plane_exposition(store, is_leader=is_leader())
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    return router


# -- the scrape config --------------------------------------------------------------------------


# The rules' shortest window is 1m (paved:replica_http_errors:ratio_rate1m, which pages on a bad
# version): rate() needs two samples in it, and a scrape every 60 s leaves one, so the alert
# could never fire. Four scrapes per window, as Prometheus advises: at most 15 s between them.
MAX_RULES_INTERVAL_S = 15
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}


def _duration(value: str, flag: str) -> str:
    if not re.fullmatch(r"[1-9][0-9]{0,5}(ms|s|m|h)", value):
        raise ValueError(f"{flag} {value!r:.40}: a Prometheus duration like 15s, 1m")
    return value


def _rules_interval(value: str, flag: str) -> str:
    """A scrape or evaluation interval paved's rules can work with (see MAX_RULES_INTERVAL_S)."""
    _duration(value, flag)
    number, unit = re.fullmatch(r"([0-9]+)(ms|s|m|h)", value).groups()  # type: ignore[union-attr]
    if int(number) * _SECONDS[unit] > MAX_RULES_INTERVAL_S:
        raise ValueError(
            f"{flag} {value}: at most {MAX_RULES_INTERVAL_S}s (paved's rules take rates over 1 minute, "
            "which need 4 scrapes in it)"
        )
    return value


def scrape_config(
    *,
    control_plane_url: str | None = None,
    credentials_file: str | None = None,
    file_sd: str | None = None,
    rule_files: Sequence[str] = (),
    job_name: str = "paved",
    scrape_interval: str = "15s",
    evaluation_interval: str = "15s",
    refresh_interval: str = "15s",
) -> str:
    """A prometheus.yml: one scrape job discovering the fleet from the control plane
    (`http_sd_configs` at `control_plane_url` + TARGETS_PATH, authorized with the admin key read
    from `credentials_file`), or from a file_sd JSON file (`file_sd`, as written by the control
    plane's --prometheus-file-sd), plus `rule_files`. ValueError for an unusable value, naming
    it. The scrapes themselves carry no credentials: paved's /metrics endpoints are open and the
    admin key must not travel to every replica."""
    import yaml  # type: ignore[import-untyped]  # PyYAML ships no stubs

    if (control_plane_url is None) == (file_sd is None):
        raise ValueError("give exactly one of control_plane_url (http_sd) and file_sd")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]{0,63}", job_name):
        raise ValueError(f"job name {job_name!r:.80}: letters, digits, _ and -")
    job: dict[str, Any] = {
        "job_name": job_name,
        "scrape_interval": _rules_interval(scrape_interval, "scrape interval"),
    }
    if control_plane_url is not None:
        parts = urllib.parse.urlsplit(control_plane_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"control plane URL {control_plane_url!r:.200}: expected http(s)://HOST:PORT")
        if not credentials_file:
            raise ValueError("http_sd needs credentials_file: the file holding the control plane's admin key")
        job["http_sd_configs"] = [
            {
                "url": control_plane_url.rstrip("/") + TARGETS_PATH,
                "refresh_interval": _duration(refresh_interval, "refresh interval"),
                "authorization": {"type": "Bearer", "credentials_file": credentials_file},
            }
        ]
    else:
        job["file_sd_configs"] = [
            {"files": [file_sd], "refresh_interval": _duration(refresh_interval, "refresh interval")}
        ]
    config = {
        "global": {
            "scrape_interval": _rules_interval(scrape_interval, "scrape interval"),
            "evaluation_interval": _rules_interval(evaluation_interval, "evaluation interval"),
        },
        "rule_files": list(rule_files),
        "scrape_configs": [job],
    }
    header = (
        "# Prometheus configuration for paved (printed by `paved render prometheus`).\n"
        "# Targets: every ready replica's metrics endpoint, the gateways and the control plane,\n"
        "# labelled paved_role, paved_model, paved_version, paved_region, paved_replica.\n"
    )
    return header + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


# The recorded series a model's graphs show (the labels each rule group keeps: the gateways'
# `model`, the replicas' `paved_model`, the control plane's `model`).
MODEL_GRAPHS = (
    'paved:gateway_availability:ratio_rate5m{{model="{model}"}}',
    'paved:replica_http_errors:ratio_rate1m{{paved_model="{model}"}}',
    'paved:gateway_request_duration_seconds:p95_5m{{model="{model}"}}',
    'paved:vllm_num_requests_waiting:sum{{paved_model="{model}"}}',
    'paved:fleet_replicas_ready:sum{{model="{model}"}}',
)


def graph_url(prometheus_url: str, model: str, *, range_input: str = "1h") -> str:
    """Prometheus' /graph page with `model`'s recorded series, one panel each. ValueError for a
    model id that is not one (it is quoted into PromQL)."""
    if not _MODEL.fullmatch(model):
        raise ValueError(f"model {model!r:.80}: not a model id")
    params: dict[str, str] = {}
    for i, expr in enumerate(MODEL_GRAPHS):
        params[f"g{i}.expr"] = expr.format(model=model)
        params[f"g{i}.tab"] = "0"  # the graph, not the table
        params[f"g{i}.range_input"] = range_input
    return prometheus_url.rstrip("/") + "/graph?" + urllib.parse.urlencode(params)


# -- SLOs ---------------------------------------------------------------------------------------

# (severity, long window, short window, burn-rate factor, for): the SRE workbook's table.
BURN_ALERTS: tuple[tuple[str, str, str, float, str], ...] = (
    ("page", "1h", "5m", 14.4, "2m"),
    ("page", "6h", "30m", 6.0, "2m"),
    ("ticket", "1d", "2h", 3.0, "15m"),
    ("ticket", "3d", "6h", 1.0, "15m"),
)
SLO_WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
GENERATED_HEADER = (
    "# GENERATED from ops/prometheus/slos.yaml by paved.control_plane.prometheus.slo_rules:\n"
    "# edit slos.yaml, then `PYTHONPATH=libs .venv/bin/python -m paved.control_plane.prometheus`;\n"
    "# never this file.\n"
)
# Where the objectives and the rules live in the repository (and in a target's runfiles).
OPS_DIR = "ops/prometheus"
SLOS_FILE = "slos.yaml"
SLO_RULES_FILE = "rules/slo.rules.yml"
RULE_FILES = ("rules/paved.rules.yml", SLO_RULES_FILE)


@dataclass(frozen=True)
class Objective:
    """One model's (or the default's) objectives: `availability` percent of requests without a
    5xx; `latency` percent answered within `latency_threshold_s` (a gateway histogram bucket)."""

    availability: float
    latency: float
    latency_threshold_s: float


@dataclass(frozen=True)
class SloConfig:
    default: Objective
    models: Mapping[str, Objective] = field(default_factory=dict)


def _percent(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 100:
        raise ValueError(f"{where}: a percentage strictly between 0 and 100, got {value!r:.40}")
    return float(value)


def _objective(data: Any, where: str, base: Objective | None) -> Objective:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a mapping")
    unknown = set(data) - {"availability", "latency"}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; known: availability, latency")
    latency = data.get("latency", {})
    if not isinstance(latency, dict) or set(latency) - {"objective", "threshold_s"}:
        raise ValueError(f"{where}.latency: a mapping with objective and threshold_s")
    if base is None and ("availability" not in data or set(latency) != {"objective", "threshold_s"}):
        raise ValueError(f"{where}: needs availability and latency.objective, latency.threshold_s")
    availability = (
        _percent(data["availability"], f"{where}.availability")
        if "availability" in data
        else base.availability  # type: ignore[union-attr]
    )
    objective = (
        _percent(latency["objective"], f"{where}.latency.objective")
        if "objective" in latency
        else base.latency  # type: ignore[union-attr]
    )
    if "threshold_s" in latency:
        threshold = latency["threshold_s"]
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, int | float)
            or float(threshold) not in GATEWAY_LATENCY_BUCKETS
        ):
            raise ValueError(
                f"{where}.latency.threshold_s: one of the gateway latency histogram's buckets "
                f"{list(GATEWAY_LATENCY_BUCKETS)}, got {threshold!r:.40}"
            )
        threshold = float(threshold)
    else:
        threshold = base.latency_threshold_s  # type: ignore[union-attr]
    return Objective(availability, objective, threshold)


def parse_slos(data: Any) -> SloConfig:
    """ValueError naming the field for anything but {defaults: {...}, models: {NAME: {...}}};
    a model's entry overrides only the keys it gives."""
    if not isinstance(data, dict) or set(data) - {"defaults", "models"} or "defaults" not in data:
        raise ValueError("slos: a mapping with 'defaults' and optional 'models'")
    default = _objective(data["defaults"], "defaults", None)
    models_data = data.get("models") or {}
    if not isinstance(models_data, dict):
        raise ValueError("models: a mapping of model name to objectives")
    models = {}
    for name, entry in sorted(models_data.items()):
        if not isinstance(name, str) or not _MODEL.fullmatch(name):
            raise ValueError(f"models: {name!r:.80} is not a model name")
        models[name] = _objective(entry, f"models.{name}", default)
    return SloConfig(default, models)


def load_slos(path: str | os.PathLike[str]) -> SloConfig:
    import yaml

    with open(path, encoding="utf-8") as f:
        return parse_slos(yaml.safe_load(f))


def _regex(names: Iterable[str]) -> str:
    # A PromQL string holding an RE2 alternation: '.' escaped for the regex, the backslash for
    # the string.
    return "|".join(n.replace(".", "\\\\.") for n in sorted(names))


def _number(value: float) -> str:
    return f"{value:.6g}"


def _selectors(config: SloConfig, key: Callable[[Objective], Any]) -> list[tuple[Objective, str]]:
    """Disjoint model selectors covering every model (but ''), one per distinct objective value
    of `key`: models overriding it, grouped, and the rest under the default."""
    groups: dict[Any, list[str]] = {}
    for name, objective in config.models.items():
        if key(objective) != key(config.default):
            groups.setdefault(key(objective), []).append(name)
    out: list[tuple[Objective, str]] = []
    overridden = [n for names in groups.values() for n in names]
    default_sel = f'model!="", model!~"{_regex(overridden)}"' if overridden else 'model!=""'
    out.append((config.default, default_sel))
    for _, names in sorted(groups.items(), key=lambda kv: kv[1]):
        out.append((config.models[names[0]], f'model=~"{_regex(names)}"'))
    return out


def slo_rules(config: SloConfig) -> dict[str, Any]:
    """The rule file (a dict for yaml): SLI error ratios per model over every window, then the
    burn-rate alerts per distinct objective."""
    availability_records = [
        {
            "record": f"paved:slo_availability_errors:ratio_rate{w}",
            "expr": (
                # `or ... * 0`: a model without any 5xx records 0, not nothing.
                f'(\n  sum by (model) (rate(paved_gateway_requests_total{{model!="", status=~"5.."}}[{w}]))\n'
                f'  or\n  0 * sum by (model) (rate(paved_gateway_requests_total{{model!=""}}[{w}]))\n)\n'
                f'/\nsum by (model) (rate(paved_gateway_requests_total{{model!=""}}[{w}]))'
            ),
        }
        for w in SLO_WINDOWS
    ]
    latency_records = []
    for objective, sel in _selectors(config, lambda o: o.latency_threshold_s):
        le = floatToGoString(objective.latency_threshold_s)
        for w in SLO_WINDOWS:
            latency_records.append(
                {
                    "record": f"paved:slo_latency_slow:ratio_rate{w}",
                    "expr": (
                        f"1 - (\n  sum by (model) (rate(paved_gateway_request_duration_seconds_bucket"
                        f'{{{sel}, le="{le}"}}[{w}]))\n  /\n  sum by (model) (rate('
                        f"paved_gateway_request_duration_seconds_count{{{sel}}}[{w}]))\n)"
                    ),
                    "labels": {"paved_latency_threshold_s": le},
                }
            )
    alerts = []
    for slo, record, key, what in (
        ("availability", "paved:slo_availability_errors", lambda o: o.availability, "5xx answers"),
        ("latency", "paved:slo_latency_slow", lambda o: (o.latency, o.latency_threshold_s), "slow answers"),
    ):
        for objective, sel in _selectors(config, key):
            target = objective.availability if slo == "availability" else objective.latency
            budget = 1 - target / 100
            for severity in ("page", "ticket"):
                pairs = [b for b in BURN_ALERTS if b[0] == severity]
                expr = "\nor\n".join(
                    f"(\n  {record}:ratio_rate{long}{{{sel}}} > {_number(factor * budget)}\n  and\n"
                    f"  {record}:ratio_rate{short}{{{sel}}} > {_number(factor * budget)}\n)"
                    for _, long, short, factor, _ in pairs
                )
                name = f"Paved{slo.capitalize()}BudgetBurn"
                detail = (
                    f"within {floatToGoString(objective.latency_threshold_s)} s"
                    if slo == "latency"
                    else "without a 5xx"
                )
                alerts.append(
                    {
                        "alert": name,
                        "expr": expr,
                        "for": pairs[0][4],
                        "labels": {"severity": severity, "slo": slo, "objective": _number(target)},
                        "annotations": {
                            "summary": f"{{{{ $labels.model }}}}: {slo} error budget burning fast"
                            if severity == "page"
                            else f"{{{{ $labels.model }}}}: {slo} error budget burning",
                            "description": (
                                f"{{{{ $labels.model }}}} is spending its {slo} error budget "
                                f"({_number(target)} % of requests {detail}) at "
                                + " or ".join(f"{_number(f)}x over {lw}/{sw}" for _, lw, sw, f, _ in pairs)
                                + f" ({what}, measured at the gateways)."
                            ),
                        },
                    }
                )
    return {
        "groups": [
            {"name": "paved-slo-availability", "interval": "30s", "rules": availability_records},
            {"name": "paved-slo-latency", "interval": "30s", "rules": latency_records},
            {"name": "paved-slo-alerts", "rules": alerts},
        ]
    }


def render_slo_rules(config: SloConfig) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    def text(dumper: yaml.SafeDumper, value: str) -> Any:
        # Multi-line expressions as blocks: the checked-in file stays readable.
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return GENERATED_HEADER + yaml.dump(
        slo_rules(config), Dumper=Dumper, sort_keys=False, default_flow_style=False, width=100
    )


def regenerate(ops_dir: str | os.PathLike[str], *, check: bool = False) -> bool:
    """Writes `ops_dir`/rules/slo.rules.yml from `ops_dir`/slos.yaml (check: writes nothing).
    True when the file already held exactly that text."""
    root = Path(ops_dir)
    text = render_slo_rules(load_slos(root / SLOS_FILE))
    out = root / SLO_RULES_FILE
    current = out.read_text(encoding="utf-8") if out.exists() else None
    if current == text:
        return True
    if not check:
        out.write_text(text, encoding="utf-8")
    return False


def main(argv: list[str] | None = None) -> int:
    """`python -m paved.control_plane.prometheus [--ops-dir ops/prometheus] [--check]`."""
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="python -m paved.control_plane.prometheus",
        description="Regenerate the SLO rules (rules/slo.rules.yml) from slos.yaml.",
    )
    p.add_argument("--ops-dir", default=OPS_DIR, help=f"where slos.yaml and rules/ are (default {OPS_DIR})")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when the rules are stale")
    args = p.parse_args(argv)
    try:
        same = regenerate(args.ops_dir, check=args.check)
    except (OSError, ValueError) as e:
        print(f"prometheus: {e}", file=sys.stderr)
        return 2
    out = Path(args.ops_dir) / SLO_RULES_FILE
    if args.check and not same:
        print(f"prometheus: {out} is stale; regenerate it (without --check)", file=sys.stderr)
        return 1
    print(f"{out}: {'up to date' if same else 'rewritten'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

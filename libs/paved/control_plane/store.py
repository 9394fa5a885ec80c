"""The control plane's durable state: deployments, replicas, rollouts, the audit log and the
published routes tables, in SQLite (one control plane) or PostgreSQL (several replicas of the
control plane sharing one database).

`ControlStore` wraps a synchronous SQLAlchemy engine; every public method is a coroutine that
runs its database work in a worker thread (`asyncio.to_thread`), so the event loop never blocks
on the database (the style of paved.gateway.access.state).

Invariants:
- At most one non-deleted deployment per `(model_id, version)`, at most one `current`
  deployment per model and at most one `running` rollout per model: each is a partial unique
  index, so two control planes racing get one success and one Conflict (409), never two rows.
- `update_rollout(expect_phase=...)` is a compare-and-set on the stored phase (one conditional
  UPDATE): of two control planes advancing the same rollout, exactly one wins, the other gets
  Conflict. An abort request (`request_abort`) is sticky: no later state write drops it.
- Replica states only move forward (starting -> ready -> (unhealthy -> ready)* -> draining ->
  stopped, or failed from any live state); a backwards move is Conflict.
- Routes revisions are strictly increasing in commit order (publishers are serialised), and
  publishing the latest table again returns the latest revision without a new row.
- Every input is validated before it reaches SQL (BadRequest, 400); unknown ids are NotFound
  (404); an unreachable or slow database is Unavailable (503), never a 500 or a hang
  (PostgreSQL connections carry connect and statement timeouts; SQLite a busy timeout).
- Datetimes are UTC-aware on the way in and out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar, cast, get_args

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from paved.control_plane.errors import BadRequest, Conflict, ControlError, NotFound, Unavailable
from paved.control_plane.types import (
    AuditEvent,
    AutoscalePolicy,
    Deployment,
    DeploymentSpec,
    Replica,
    ReplicaState,
    RolloutStatus,
    Strategy,
)
from paved.gateway.routing.routes import RoutesError, parse_routes
from paved.sql import engine_for, utc, utc_now

logger = logging.getLogger("paved.control_plane")

# The model package's own name rule (paved.launcher.package), so every stored model id and
# version is one a package can carry.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
REGION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
REPLICA_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_REPLICAS = 1000
MAX_REGIONS = 64
MAX_URI_LEN = 2048
MAX_MESSAGE_LEN = 4096
MAX_KIND_LEN = 64
MAX_AUDIT_LIMIT = 1000
MAX_JSON_BYTES = 1 << 20
# The longest idle delay before scale to zero (a week): beyond it, keep a replica instead.
MAX_SCALE_TO_ZERO_AFTER_S = 7 * 86400.0
# Old routes revisions kept (the feed only ever serves the latest; a few are kept to debug).
ROUTES_KEPT = 200
STRATEGIES: tuple[str, ...] = get_args(Strategy)
REPLICA_STATES: tuple[str, ...] = get_args(ReplicaState)
ROLLOUT_STATUSES: tuple[str, ...] = get_args(RolloutStatus)
DEPLOYMENT_STATES = ("active", "inactive", "deleted")
# Forward-only replica lifecycle (types.py); a same-state update (new reason, url) is allowed.
REPLICA_TRANSITIONS: dict[str, frozenset[str]] = {
    "starting": frozenset({"ready", "unhealthy", "draining", "stopped", "failed"}),
    "ready": frozenset({"unhealthy", "draining", "stopped", "failed"}),
    "unhealthy": frozenset({"ready", "draining", "stopped", "failed"}),
    "draining": frozenset({"stopped", "failed"}),
    "stopped": frozenset(),
    "failed": frozenset({"stopped"}),
}
REPLICA_FIELDS = frozenset(
    {"state", "url", "admin_url", "kserve_grpc", "kserve_http", "metrics_url", "driver_ref", "reason"}
)
# Advisory lock ids (any constants unique to this schema): DDL and routes publishing.
_DDL_LOCK_ID = 0x7061766563  # "pavec"
_ROUTES_LOCK_ID = 0x7061766572  # "paver"
_T = TypeVar("_T")

metadata = sa.MetaData()

deployments_table = sa.Table(
    "cp_deployments",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("model_id", sa.String(128), nullable=False),
    sa.Column("version", sa.String(128), nullable=False),
    sa.Column("spec", sa.JSON, nullable=False),
    sa.Column("fingerprint", sa.JSON, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("current", sa.Boolean, nullable=False, default=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("last_traffic_at", sa.DateTime(timezone=True), nullable=True),
)
sa.Index(
    "cp_deployments_live",
    deployments_table.c.model_id,
    deployments_table.c.version,
    unique=True,
    sqlite_where=deployments_table.c.state != "deleted",
    postgresql_where=deployments_table.c.state != "deleted",
)
sa.Index(
    "cp_deployments_current",
    deployments_table.c.model_id,
    unique=True,
    sqlite_where=deployments_table.c.current.is_(True),
    postgresql_where=deployments_table.c.current.is_(True),
)

replicas_table = sa.Table(
    "cp_replicas",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("deployment_id", sa.String(64), sa.ForeignKey("cp_deployments.id"), nullable=False, index=True),
    sa.Column("region", sa.String(63), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("url", sa.String(MAX_URI_LEN), nullable=False),
    sa.Column("admin_url", sa.String(MAX_URI_LEN), nullable=False),
    sa.Column("kserve_grpc", sa.String(MAX_URI_LEN), nullable=True),
    sa.Column("kserve_http", sa.String(MAX_URI_LEN), nullable=True),
    sa.Column("metrics_url", sa.String(MAX_URI_LEN), nullable=True),
    sa.Column("driver_ref", sa.JSON, nullable=False),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)

rollouts_table = sa.Table(
    "cp_rollouts",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("model_id", sa.String(128), nullable=False, index=True),
    sa.Column("from_version", sa.String(128), nullable=True),
    sa.Column("to_version", sa.String(128), nullable=False),
    sa.Column("strategy", sa.String(16), nullable=False),
    sa.Column("phase", sa.String(64), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("params", sa.JSON, nullable=False),
    sa.Column("state", sa.JSON, nullable=False),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)
sa.Index(
    "cp_rollouts_running",
    rollouts_table.c.model_id,
    unique=True,
    sqlite_where=rollouts_table.c.status == "running",
    postgresql_where=rollouts_table.c.status == "running",
)

audit_table = sa.Table(
    "cp_audit",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("kind", sa.String(MAX_KIND_LEN), nullable=False),
    sa.Column("model_id", sa.String(128), nullable=True, index=True),
    sa.Column("version", sa.String(128), nullable=True),
    sa.Column("rollout_id", sa.String(64), nullable=True, index=True),
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("data", sa.JSON, nullable=False),
    sqlite_autoincrement=True,
)

routes_table = sa.Table(
    "cp_routes",
    metadata,
    sa.Column("revision", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("digest", sa.String(64), nullable=False),
    sa.Column("routes", sa.JSON, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    # Revisions are never reused, even after old rows are pruned.
    sqlite_autoincrement=True,
)

# Desired replicas per (deployment, region): what rollouts, the autoscaler and the API set and
# the controller converges to; a restarted control plane converges to the same fleet.
desired_table = sa.Table(
    "cp_desired",
    metadata,
    sa.Column("deployment_id", sa.String(64), primary_key=True),
    sa.Column("region", sa.String(128), primary_key=True),
    sa.Column("replicas", sa.Integer, nullable=False),
)

# Small named JSON values the controller keeps across restarts (e.g. the rollouts' weights).
kv_table = sa.Table(
    "cp_kv",
    metadata,
    sa.Column("key", sa.String(128), primary_key=True),
    sa.Column("value", sa.JSON, nullable=False),
)


@dataclass(frozen=True)
class RolloutRecord:
    id: str
    model_id: str
    from_version: str | None  # None for a first deploy
    to_version: str
    strategy: Strategy
    phase: str
    status: RolloutStatus
    params: dict[str, Any]
    state: dict[str, Any]  # the rollout state machine's own JSON
    reason: str | None
    created_at: datetime
    updated_at: datetime


# -- validation ----------------------------------------------------------------------------


def _name(value: object, what: str) -> str:
    if not isinstance(value, str) or NAME_RE.fullmatch(value) is None:
        raise BadRequest(f"{what} must match {NAME_RE.pattern}, got {value!r:.80}")
    return value


def _int(value: object, what: str, lo: int, hi: int) -> int:
    # bool is an int subclass; True as a count is a bug, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise BadRequest(f"{what} must be an integer in [{lo}, {hi}], got {value!r:.40}")
    return value


def _pos(value: object, what: str, *, allow_zero: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value < 0 if allow_zero else value <= 0):  # type: ignore[operator]
        bound = ">= 0" if allow_zero else "> 0"
        raise BadRequest(f"{what} must be a finite number {bound}, got {value!r:.40}")
    return float(cast(float, value))


def _text(value: object, what: str, limit: int, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or len(value) > limit or (not value and not allow_empty):
        raise BadRequest(
            f"{what} must be a {'' if allow_empty else 'non-empty '}string of at most {limit} characters"
        )
    return value


def _opt_text(value: object, what: str, limit: int) -> str | None:
    return None if value is None else _text(value, what, limit)


def _json_obj(value: object, what: str, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"{what} must be a JSON object")
    try:
        raw = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{what} must be JSON-serialisable ({exc})") from None
    if len(raw) > limit:
        raise BadRequest(f"{what} must be at most {limit} bytes of JSON")
    return cast(dict[str, Any], json.loads(raw))


def _aware(value: object, what: str) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise BadRequest(f"{what} must be a timezone-aware datetime")
    return value.astimezone(UTC)


def validate_autoscale(policy: object) -> AutoscalePolicy:
    if not isinstance(policy, AutoscalePolicy):
        raise BadRequest("autoscale must be an AutoscalePolicy")
    if not isinstance(policy.enabled, bool):
        raise BadRequest("autoscale.enabled must be a boolean")
    for f in dataclasses.fields(policy):
        if f.name not in ("enabled", "scale_to_zero_after_s"):
            _pos(getattr(policy, f.name), f"autoscale.{f.name}")
    if policy.scale_to_zero_after_s is not None:
        after = _pos(policy.scale_to_zero_after_s, "autoscale.scale_to_zero_after_s")
        if after > MAX_SCALE_TO_ZERO_AFTER_S:
            raise BadRequest(
                f"autoscale.scale_to_zero_after_s must be at most {MAX_SCALE_TO_ZERO_AFTER_S:g} s, "
                f"got {after:g}"
            )
        if not policy.enabled:
            raise BadRequest("autoscale.scale_to_zero_after_s needs autoscale.enabled true")
    if policy.target_kv_usage > 1:
        raise BadRequest("autoscale.target_kv_usage is a fraction of the KV cache: (0, 1]")
    if policy.panic_window_s > policy.stable_window_s:
        raise BadRequest("autoscale.panic_window_s must not exceed stable_window_s")
    if policy.panic_threshold < 1:
        raise BadRequest("autoscale.panic_threshold must be >= 1 (a ratio of desired to ready replicas)")
    return policy


# Route options a deployment may set for its alias (the gateway's routes keys that are policy,
# not topology: backends, weights, strategy and current stay the control plane's).
ROUTE_OPTIONS = frozenset(
    {"cache", "template", "max_model_len", "summarizer", "summarizer_temperature", "tokenizer"}
)
_MAX_ROUTE_OPTIONS_BYTES = 16 * 1024


def validate_route_options(model_id: str, options: object) -> dict[str, Any]:
    """`options` if the gateway would accept a route of them, else BadRequest naming the key
    (checked with the gateway's own routes parser, so a published table never fails there)."""
    if not isinstance(options, dict):
        raise BadRequest("route must be a JSON object of route options")
    unknown = sorted(set(options) - ROUTE_OPTIONS)
    if unknown:
        raise BadRequest(f"unknown route option(s) {unknown}; known: {sorted(ROUTE_OPTIONS)}")
    try:
        size = len(json.dumps(options))
    except (TypeError, ValueError):
        raise BadRequest("route options must be JSON values") from None
    if size > _MAX_ROUTE_OPTIONS_BYTES:
        raise BadRequest(f"route options are {size} bytes of JSON, more than {_MAX_ROUTE_OPTIONS_BYTES}")
    try:
        # A stand-in backend: the parser wants one, and options never depend on it.
        backend = {"url": "http://127.0.0.1:1", "version": "v"}
        parse_routes({"models": [{"alias": model_id, **options, "backends": [backend]}]})
    except RoutesError as e:
        raise BadRequest(f"route options rejected: {e}") from None
    return options


_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_TOLERATION_KEYS = frozenset({"key", "operator", "value", "effect", "toleration_seconds"})
MAX_TOLERATIONS = 32


def validate_placement(placement: object) -> dict[str, Any]:
    """`placement` if a cluster could take it, else BadRequest naming the key: node_selector
    label keys and values as Kubernetes spells them, tolerations with a known operator and
    effect (what the API server would refuse is refused here, at registration)."""
    if not isinstance(placement, dict):
        raise BadRequest("placement must be a JSON object with node_selector and/or tolerations")
    unknown = sorted(set(placement) - {"node_selector", "tolerations"})
    if unknown:
        raise BadRequest(f"unknown placement field(s) {unknown}; known: ['node_selector', 'tolerations']")
    selector = placement.get("node_selector", {})
    if not isinstance(selector, dict) or len(selector) > MAX_TOLERATIONS:
        raise BadRequest(f"placement.node_selector must be an object of at most {MAX_TOLERATIONS} labels")
    for key, value in selector.items():
        if not isinstance(key, str) or _LABEL_KEY.fullmatch(key) is None:
            raise BadRequest(f"placement.node_selector key {key!r:.80} is not a Kubernetes label key")
        if not isinstance(value, str) or _LABEL_VALUE.fullmatch(value) is None:
            raise BadRequest(f"placement.node_selector[{key!r}] = {value!r:.80} is not a label value")
    tolerations = placement.get("tolerations", [])
    if not isinstance(tolerations, list) or len(tolerations) > MAX_TOLERATIONS:
        raise BadRequest(f"placement.tolerations must be a list of at most {MAX_TOLERATIONS} objects")
    for i, t in enumerate(tolerations):
        where = f"placement.tolerations[{i}]"
        if not isinstance(t, dict) or set(t) - _TOLERATION_KEYS:
            raise BadRequest(f"{where} must be an object with keys among {sorted(_TOLERATION_KEYS)}")
        operator = t.get("operator", "Equal")
        if operator not in ("Equal", "Exists"):
            raise BadRequest(f"{where}.operator must be 'Equal' or 'Exists', got {operator!r:.40}")
        if t.get("effect", "") not in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise BadRequest(f"{where}.effect must be NoSchedule, PreferNoSchedule or NoExecute")
        key = t.get("key", "")
        if not isinstance(key, str) or (key and _LABEL_KEY.fullmatch(key) is None):
            raise BadRequest(f"{where}.key {key!r:.80} is not a Kubernetes label key")
        if not key and operator != "Exists":
            raise BadRequest(f"{where}: an empty key needs operator 'Exists'")
        value = t.get("value", "")
        if not isinstance(value, str) or _LABEL_VALUE.fullmatch(value) is None:
            raise BadRequest(f"{where}.value {value!r:.80} is not a label value")
        if operator == "Exists" and value:
            raise BadRequest(f"{where}: operator 'Exists' takes no value")
        seconds = t.get("toleration_seconds")
        if seconds is not None:
            # The API server's own rules (checked there by a dry run): an int64, and only for
            # NoExecute, the one effect that evicts. Accepted here, each failed every replica
            # create afterwards with a misleading 503.
            if isinstance(seconds, bool) or not isinstance(seconds, int) or not 0 <= seconds < 2**63:
                raise BadRequest(f"{where}.toleration_seconds must be an integer in [0, 2^63)")
            if t.get("effect") != "NoExecute":
                raise BadRequest(f"{where}.toleration_seconds needs effect 'NoExecute'")
    return placement


def validate_spec(spec: object) -> DeploymentSpec:
    """The spec if every field is sane, else BadRequest naming the field."""
    if not isinstance(spec, DeploymentSpec):
        raise BadRequest("spec must be a DeploymentSpec")
    _name(spec.model_id, "model_id")
    _name(spec.version, "version")
    _text(spec.package_uri, "package_uri", MAX_URI_LEN)
    if spec.strategy not in STRATEGIES:
        raise BadRequest(f"strategy must be one of {list(STRATEGIES)}, got {spec.strategy!r:.40}")
    _int(spec.min_replicas, "min_replicas", 0, MAX_REPLICAS)
    _int(spec.max_replicas, "max_replicas", 1, MAX_REPLICAS)
    if spec.min_replicas > spec.max_replicas:
        raise BadRequest("min_replicas must not exceed max_replicas")
    _int(spec.replicas, "replicas", spec.min_replicas, spec.max_replicas)
    if not isinstance(spec.regions, tuple) or not 1 <= len(spec.regions) <= MAX_REGIONS:
        raise BadRequest(f"regions must be a tuple of 1 to {MAX_REGIONS} region names")
    for region in spec.regions:
        if not isinstance(region, str) or REGION_RE.fullmatch(region) is None:
            raise BadRequest(f"each region must match {REGION_RE.pattern}, got {region!r:.80}")
    if len(set(spec.regions)) != len(spec.regions):
        raise BadRequest("regions must not repeat")
    engine = _text(spec.engine, "engine", MAX_URI_LEN)
    if engine != "package" and not engine.startswith("sim://"):
        raise BadRequest("engine must be 'package' or a sim:// URI")
    validate_autoscale(spec.autoscale)
    if spec.autoscale.scale_to_zero_after_s is not None and spec.min_replicas != 0:
        # A floor above zero and an idle delay to zero contradict each other: say so rather
        # than silently ignore one.
        raise BadRequest(
            f"autoscale.scale_to_zero_after_s needs min_replicas 0, got min_replicas {spec.min_replicas}"
        )
    if not isinstance(spec.no_gc, bool):
        raise BadRequest("no_gc must be a boolean")
    validate_route_options(spec.model_id, spec.route)
    validate_placement(spec.placement)
    return spec


def validate_replica(r: object) -> Replica:
    if not isinstance(r, Replica):
        raise BadRequest("replica must be a Replica")
    if not isinstance(r.id, str) or REPLICA_ID_RE.fullmatch(r.id) is None:
        raise BadRequest(f"replica id must match {REPLICA_ID_RE.pattern}")
    _text(r.deployment_id, "deployment_id", 64)
    if not isinstance(r.region, str) or REGION_RE.fullmatch(r.region) is None:
        raise BadRequest(f"region must match {REGION_RE.pattern}")
    _replica_fields(dataclasses.asdict(r) | {"driver_ref": r.driver_ref})
    return r


def _replica_fields(fields: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if key == "state":
            if value not in REPLICA_STATES:
                raise BadRequest(f"replica state must be one of {list(REPLICA_STATES)}, got {value!r:.40}")
            out[key] = value
        elif key in ("url", "admin_url"):
            out[key] = _text(value, key, MAX_URI_LEN, allow_empty=True)
        elif key in ("kserve_grpc", "kserve_http", "metrics_url"):
            out[key] = _opt_text(value, key, MAX_URI_LEN)
        elif key == "reason":
            out[key] = _opt_text(value, key, MAX_MESSAGE_LEN)
        elif key == "driver_ref":
            out[key] = _json_obj(value, "driver_ref")
    return out


def new_replica_id() -> str:
    return "rep_" + uuid.uuid4().hex[:20]


# -- (de)serialisation ---------------------------------------------------------------------

_SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(DeploymentSpec))


def spec_to_dict(spec: DeploymentSpec) -> dict[str, Any]:
    d = dataclasses.asdict(spec)
    d["regions"] = list(spec.regions)
    return d


def spec_from_dict(raw: dict[str, Any], *, stored: bool = False) -> DeploymentSpec:
    """The spec sent as JSON; unknown keys and bad values are BadRequest.

    `stored`: a spec read back from the store, checked when it was written. Rules tightened
    since, and fields a newer control plane added, do not make it unreadable (one such row
    would fail every reconcile pass and every list, for every deployment): unknown fields are
    dropped and a rule it breaks now is logged, not raised."""
    if not isinstance(raw, dict):
        raise BadRequest("spec must be a JSON object")
    unknown = sorted(set(raw) - _SPEC_FIELDS)
    values = dict(raw)
    if unknown and stored:
        logger.warning("stored deployment spec has field(s) %s this version does not know; ignored", unknown)
        for key in unknown:
            del values[key]
    elif unknown:
        raise BadRequest(f"unknown deployment field(s) {unknown}; known: {sorted(_SPEC_FIELDS)}")
    if "regions" in values:
        regions = values["regions"]
        if not isinstance(regions, list | tuple):
            raise BadRequest("regions must be a list of region names")
        values["regions"] = tuple(regions)
    if "autoscale" in values:
        auto = values["autoscale"]
        if not isinstance(auto, dict):
            raise BadRequest("autoscale must be a JSON object")
        auto_known = {f.name for f in dataclasses.fields(AutoscalePolicy)}
        bad = sorted(set(auto) - auto_known)
        if bad and not stored:
            raise BadRequest(f"unknown autoscale field(s) {bad}; known: {sorted(auto_known)}")
        values["autoscale"] = AutoscalePolicy(**{k: v for k, v in auto.items() if k in auto_known})
    try:
        spec = DeploymentSpec(**values)
    except TypeError as exc:
        raise BadRequest(f"invalid deployment spec: {exc}") from None
    if not stored:
        return validate_spec(spec)
    try:
        validate_spec(spec)
    except BadRequest as e:
        logger.warning(
            "stored deployment %s@%s breaks a rule of this version: %s", spec.model_id, spec.version, e
        )
    return spec


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def deployment_to_dict(d: Deployment) -> dict[str, Any]:
    return {
        "id": d.id,
        "spec": spec_to_dict(d.spec),
        "fingerprint": d.fingerprint,
        "created_at": d.created_at.isoformat(),
        "state": d.state,
        "current": d.current,
        "last_traffic_at": _iso(d.last_traffic_at),
    }


def replica_to_dict(r: Replica) -> dict[str, Any]:
    return dataclasses.asdict(r)


def rollout_to_dict(r: RolloutRecord) -> dict[str, Any]:
    d = dataclasses.asdict(r)
    d["created_at"] = r.created_at.isoformat()
    d["updated_at"] = r.updated_at.isoformat()
    return d


def audit_to_dict(e: AuditEvent) -> dict[str, Any]:
    d = dataclasses.asdict(e)
    d["at"] = e.at.isoformat()
    return d


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _deployment_from_row(row: Any) -> Deployment:
    return Deployment(
        id=row.id,
        spec=spec_from_dict(dict(row.spec), stored=True),
        fingerprint=dict(row.fingerprint or {}),
        created_at=utc(row.created_at) or utc_now(),  # NOT NULL column: the fallback never runs
        state=row.state,
        current=bool(row.current),
        last_traffic_at=utc(row.last_traffic_at),
    )


def _replica_from_row(row: Any) -> Replica:
    return Replica(
        id=row.id,
        deployment_id=row.deployment_id,
        region=row.region,
        state=row.state,
        url=row.url,
        admin_url=row.admin_url,
        kserve_grpc=row.kserve_grpc,
        kserve_http=row.kserve_http,
        metrics_url=row.metrics_url,
        driver_ref=dict(row.driver_ref or {}),
        reason=row.reason,
    )


def _rollout_from_row(row: Any) -> RolloutRecord:
    return RolloutRecord(
        id=row.id,
        model_id=row.model_id,
        from_version=row.from_version,
        to_version=row.to_version,
        strategy=row.strategy,
        phase=row.phase,
        status=row.status,
        params=dict(row.params or {}),
        state=dict(row.state or {}),
        reason=row.reason,
        created_at=utc(row.created_at) or utc_now(),
        updated_at=utc(row.updated_at) or utc_now(),
    )


def _audit_from_row(row: Any) -> AuditEvent:
    return AuditEvent(
        id=int(row.id),
        at=utc(row.at) or utc_now(),
        kind=row.kind,
        model_id=row.model_id,
        version=row.version,
        rollout_id=row.rollout_id,
        message=row.message,
        data=dict(row.data or {}),
    )


class ControlStore:
    """Construct with a URL, `await start()`, use, `await close()`."""

    def __init__(self, url: str):
        self._engine = engine_for(url, what="control-plane store")
        self._is_pg = self._engine.dialect.name == "postgresql"
        # SQLite: one writer at a time anyway, and the in-memory database is one shared
        # connection that must not be used by two threads at once.
        self._local_lock = threading.Lock() if not self._is_pg else None

    @property
    def dialect(self) -> str:
        return self._engine.dialect.name

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        try:
            return await asyncio.to_thread(self._locked, fn, *args)
        except ControlError:
            raise
        except (OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError) as exc:
            # The database is down, slow or unreachable: a 503 the caller may retry, not a 500.
            # The driver's message can carry connection details, so it is not passed on.
            raise Unavailable("the control plane's store is unavailable", code="store_unavailable") from exc

    def _locked(self, fn: Callable[..., _T], *args: Any) -> _T:
        if self._local_lock is None:
            return fn(*args)
        with self._local_lock:
            return fn(*args)

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        with self._engine.begin() as conn:
            yield conn

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the tables if missing (idempotent; safe concurrently across replicas)."""
        await self._run(self._start_sync)

    def _start_sync(self) -> None:
        if self._is_pg:
            with self._tx() as conn:
                # Held to commit: a second replica waits here, then finds the tables.
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": _DDL_LOCK_ID})
                metadata.create_all(conn)
            return
        # SQLite: BEGIN IMMEDIATE serialises processes, but keep the gateway's retry in case a
        # concurrent creator's schema change is seen mid-way.
        for attempt in range(3):
            try:
                with self._tx() as conn:
                    metadata.create_all(conn)
                return
            except (OperationalError, ProgrammingError):
                if attempt == 2:
                    raise

    async def close(self) -> None:
        await asyncio.to_thread(self._engine.dispose)

    # -- deployments -----------------------------------------------------------------------

    async def create_deployment(
        self,
        spec: DeploymentSpec,
        fingerprint: dict[str, Any],
        state: Literal["active", "inactive", "deleted"] = "active",
    ) -> Deployment:
        """Insert the deployment in `state` (one write: a registration is never seen, nor
        left by a crash, in a state it was not meant to have)."""
        validate_spec(spec)
        deployment = Deployment(
            id="dep_" + uuid.uuid4().hex,
            spec=spec,
            fingerprint=_json_obj(fingerprint, "fingerprint"),
            created_at=utc_now(),
            state=state,
        )
        return await self._run(self._create_deployment_sync, deployment)

    def _create_deployment_sync(self, d: Deployment) -> Deployment:
        try:
            with self._tx() as conn:
                conn.execute(
                    deployments_table.insert().values(
                        id=d.id,
                        model_id=d.spec.model_id,
                        version=d.spec.version,
                        spec=spec_to_dict(d.spec),
                        fingerprint=d.fingerprint,
                        state=d.state,
                        current=False,
                        created_at=d.created_at,
                        last_traffic_at=None,
                    )
                )
        except IntegrityError:
            raise Conflict(
                f"deployment {d.spec.model_id}@{d.spec.version} already exists", code="deployment_exists"
            ) from None
        return d

    async def get_deployment(self, model_id: str, version: str) -> Deployment | None:
        """The non-deleted deployment of (model_id, version), if any."""
        if not all(isinstance(v, str) and NAME_RE.fullmatch(v) for v in (model_id, version)):
            return None
        return await self._run(self._get_deployment_sync, model_id, version)

    def _get_deployment_sync(self, model_id: str, version: str) -> Deployment | None:
        t = deployments_table
        with self._engine.connect() as conn:
            row = conn.execute(
                sa.select(t).where(t.c.model_id == model_id, t.c.version == version, t.c.state != "deleted")
            ).first()
        return None if row is None else _deployment_from_row(row)

    async def get_deployment_by_id(self, deployment_id: str) -> Deployment | None:
        if not isinstance(deployment_id, str) or not 0 < len(deployment_id) <= 64:
            return None
        return await self._run(self._get_deployment_by_id_sync, deployment_id)

    def _get_deployment_by_id_sync(
        self, deployment_id: str, conn: Connection | None = None
    ) -> Deployment | None:
        t = deployments_table
        if conn is not None:
            row = conn.execute(sa.select(t).where(t.c.id == deployment_id)).first()
        else:
            with self._engine.connect() as c:
                row = c.execute(sa.select(t).where(t.c.id == deployment_id)).first()
        return None if row is None else _deployment_from_row(row)

    async def list_deployments(
        self, model_id: str | None = None, include_deleted: bool = False
    ) -> list[Deployment]:
        """Oldest first."""
        if model_id is not None:
            _name(model_id, "model_id")
        return await self._run(self._list_deployments_sync, model_id, bool(include_deleted))

    def _list_deployments_sync(self, model_id: str | None, include_deleted: bool) -> list[Deployment]:
        t = deployments_table
        query = sa.select(t).order_by(t.c.created_at, t.c.id)
        if model_id is not None:
            query = query.where(t.c.model_id == model_id)
        if not include_deleted:
            query = query.where(t.c.state != "deleted")
        with self._engine.connect() as conn:
            rows = conn.execute(query).all()
        return [_deployment_from_row(r) for r in rows]

    async def update_deployment(
        self,
        deployment_id: str,
        *,
        replicas: int | None = None,
        state: Literal["active", "inactive"] | None = None,
        no_gc: bool | None = None,
        last_traffic_at: datetime | None = None,
        min_replicas: int | None = None,
        max_replicas: int | None = None,
        autoscale: AutoscalePolicy | None = None,
        route: dict[str, Any] | None = None,
    ) -> Deployment:
        """Change the given fields (None leaves one as it is); the resulting spec must be valid
        (replicas within [min_replicas, max_replicas]). A deleted deployment is Conflict."""
        if state is not None and state not in ("active", "inactive"):
            raise BadRequest("state must be 'active' or 'inactive' (use delete_deployment to delete)")
        if no_gc is not None and not isinstance(no_gc, bool):
            raise BadRequest("no_gc must be a boolean")
        if last_traffic_at is not None:
            last_traffic_at = _aware(last_traffic_at, "last_traffic_at")
        if autoscale is not None:
            validate_autoscale(autoscale)
        spec_changes: dict[str, Any] = {
            k: v
            for k, v in {
                "replicas": replicas,
                "no_gc": no_gc,
                "min_replicas": min_replicas,
                "max_replicas": max_replicas,
                "autoscale": autoscale,
                "route": route,
            }.items()
            if v is not None
        }
        return await self._run(
            self._update_deployment_sync, deployment_id, spec_changes, state, last_traffic_at
        )

    def _update_deployment_sync(
        self,
        deployment_id: str,
        spec_changes: dict[str, Any],
        state: str | None,
        last_traffic_at: datetime | None,
    ) -> Deployment:
        t = deployments_table
        with self._tx() as conn:
            # FOR UPDATE: two control planes changing one deployment never lose an update.
            row = conn.execute(sa.select(t).where(t.c.id == deployment_id).with_for_update()).first()
            if row is None:
                raise NotFound(f"no deployment with id '{deployment_id}'", code="deployment_not_found")
            current = _deployment_from_row(row)
            if current.state == "deleted":
                raise Conflict(f"deployment '{deployment_id}' is deleted", code="deployment_deleted")
            values: dict[str, Any] = {}
            if spec_changes:
                spec = validate_spec(dataclasses.replace(current.spec, **spec_changes))
                # Fields a newer control plane stored (this one does not know them) are kept.
                kept = {k: v for k, v in dict(row.spec).items() if k not in _SPEC_FIELDS}
                values["spec"] = {**kept, **spec_to_dict(spec)}
            # A state or traffic change leaves the stored spec as it is: one stored before a
            # rule was tightened is not checked (and refused) again on every write.
            if state is not None:
                values["state"] = state
            if last_traffic_at is not None:
                values["last_traffic_at"] = last_traffic_at
            if values:
                conn.execute(t.update().where(t.c.id == deployment_id).values(**values))
            updated = self._get_deployment_by_id_sync(deployment_id, conn)
        assert updated is not None  # noqa: S101 - the row is locked by this transaction
        return updated

    async def set_current(self, model_id: str, version: str) -> Deployment:
        """Make (model_id, version) the one current deployment of the model, atomically."""
        _name(model_id, "model_id")
        _name(version, "version")
        return await self._run(self._set_current_sync, model_id, version)

    def _set_current_sync(self, model_id: str, version: str) -> Deployment:
        t = deployments_table
        try:
            with self._tx() as conn:
                target = conn.execute(
                    sa.select(t.c.id)
                    .where(t.c.model_id == model_id, t.c.version == version, t.c.state != "deleted")
                    .with_for_update()
                ).scalar_one_or_none()
                if target is None:
                    raise NotFound(f"no deployment {model_id}@{version}", code="deployment_not_found")
                conn.execute(
                    t.update()
                    .where(t.c.model_id == model_id, t.c.id != target, t.c.current.is_(True))
                    .values(current=False)
                )
                conn.execute(t.update().where(t.c.id == target).values(current=True))
                updated = self._get_deployment_by_id_sync(target, conn)
        except IntegrityError:
            # Another control plane made a different version current at the same moment.
            raise Conflict(
                f"the current version of {model_id} changed concurrently; retry", code="conflict"
            ) from None
        assert updated is not None  # noqa: S101 - written in this transaction
        return updated

    async def delete_deployment(self, deployment_id: str) -> Deployment:
        """Mark deleted (idempotent); a deleted deployment is never current."""
        if not isinstance(deployment_id, str) or not 0 < len(deployment_id) <= 64:
            raise NotFound("no deployment with that id", code="deployment_not_found")
        return await self._run(self._delete_deployment_sync, deployment_id)

    def _delete_deployment_sync(self, deployment_id: str) -> Deployment:
        t = deployments_table
        with self._tx() as conn:
            conn.execute(t.update().where(t.c.id == deployment_id).values(state="deleted", current=False))
            updated = self._get_deployment_by_id_sync(deployment_id, conn)
        if updated is None:
            raise NotFound(f"no deployment with id '{deployment_id}'", code="deployment_not_found")
        return updated

    # -- replicas --------------------------------------------------------------------------

    async def add_replica(self, replica: Replica) -> Replica:
        validate_replica(replica)
        return await self._run(self._add_replica_sync, replica)

    def _add_replica_sync(self, r: Replica) -> Replica:
        now = utc_now()
        try:
            with self._tx() as conn:
                exists = conn.execute(
                    sa.select(deployments_table.c.id).where(deployments_table.c.id == r.deployment_id)
                ).first()
                if exists is None:
                    raise NotFound(f"no deployment with id '{r.deployment_id}'", code="deployment_not_found")
                conn.execute(
                    replicas_table.insert().values(
                        id=r.id,
                        deployment_id=r.deployment_id,
                        region=r.region,
                        state=r.state,
                        url=r.url,
                        admin_url=r.admin_url,
                        kserve_grpc=r.kserve_grpc,
                        kserve_http=r.kserve_http,
                        metrics_url=r.metrics_url,
                        driver_ref=dict(r.driver_ref),
                        reason=r.reason,
                        created_at=now,
                        updated_at=now,
                    )
                )
        except IntegrityError:
            raise Conflict(f"a replica with id '{r.id}' already exists", code="replica_exists") from None
        return r

    async def update_replica(self, replica_id: str, **fields: Any) -> Replica:
        """Change fields among REPLICA_FIELDS; a state change must follow REPLICA_TRANSITIONS."""
        unknown = sorted(set(fields) - REPLICA_FIELDS)
        if unknown:
            raise BadRequest(f"unknown replica field(s) {unknown}; known: {sorted(REPLICA_FIELDS)}")
        values = _replica_fields(fields)
        return await self._run(self._update_replica_sync, replica_id, values)

    def _update_replica_sync(self, replica_id: str, values: dict[str, Any]) -> Replica:
        t = replicas_table
        with self._tx() as conn:
            row = conn.execute(sa.select(t).where(t.c.id == replica_id).with_for_update()).first()
            if row is None:
                raise NotFound(f"no replica with id '{replica_id}'", code="replica_not_found")
            new_state = values.get("state", row.state)
            if new_state != row.state and new_state not in REPLICA_TRANSITIONS[row.state]:
                raise Conflict(
                    f"replica '{replica_id}' cannot go from {row.state} to {new_state}", code="bad_transition"
                )
            if values:
                conn.execute(t.update().where(t.c.id == replica_id).values(**values, updated_at=utc_now()))
            row = conn.execute(sa.select(t).where(t.c.id == replica_id)).first()
        return _replica_from_row(row)

    async def get_replica(self, replica_id: str) -> Replica | None:
        if not isinstance(replica_id, str) or REPLICA_ID_RE.fullmatch(replica_id) is None:
            return None
        return await self._run(self._get_replica_sync, replica_id)

    def _get_replica_sync(self, replica_id: str) -> Replica | None:
        with self._engine.connect() as conn:
            row = conn.execute(sa.select(replicas_table).where(replicas_table.c.id == replica_id)).first()
        return None if row is None else _replica_from_row(row)

    async def list_replicas(
        self,
        deployment_id: str | None = None,
        region: str | None = None,
        states: Iterable[str] | None = None,
    ) -> list[Replica]:
        """Oldest first, filtered by each given criterion."""
        wanted: tuple[str, ...] | None = None
        if states is not None:
            if isinstance(states, str):
                raise BadRequest("states must be a collection of replica states, not one string")
            wanted = tuple(states)
            bad = [s for s in wanted if s not in REPLICA_STATES]
            if bad:
                raise BadRequest(f"unknown replica state(s) {bad}; known: {list(REPLICA_STATES)}")
        return await self._run(self._list_replicas_sync, deployment_id, region, wanted)

    def _list_replicas_sync(
        self, deployment_id: str | None, region: str | None, states: tuple[str, ...] | None
    ) -> list[Replica]:
        t = replicas_table
        query = sa.select(t).order_by(t.c.created_at, t.c.id)
        if deployment_id is not None:
            query = query.where(t.c.deployment_id == deployment_id)
        if region is not None:
            query = query.where(t.c.region == region)
        if states is not None:
            query = query.where(t.c.state.in_(states))
        with self._engine.connect() as conn:
            rows = conn.execute(query).all()
        return [_replica_from_row(r) for r in rows]

    async def delete_replica(self, replica_id: str) -> bool:
        """Forget a replica (idempotent); True if a row was removed."""
        if not isinstance(replica_id, str) or not replica_id:
            return False
        return await self._run(self._delete_replica_sync, replica_id)

    def _delete_replica_sync(self, replica_id: str) -> bool:
        with self._tx() as conn:
            result = conn.execute(replicas_table.delete().where(replicas_table.c.id == replica_id))
        return bool(result.rowcount)

    async def prune_replicas(self, before: datetime) -> int:
        """Forget stopped and failed replicas last updated before `before` (their audit events
        stay); returns how many. A crash-looping deployment adds a row per attempt."""
        return await self._run(self._prune_replicas_sync, before)

    def _prune_replicas_sync(self, before: datetime) -> int:
        t = replicas_table
        with self._tx() as conn:
            result = conn.execute(
                t.delete().where(t.c.state.in_(("stopped", "failed")), t.c.updated_at < before)
            )
        return int(result.rowcount or 0)

    # -- rollouts --------------------------------------------------------------------------

    async def create_rollout(
        self,
        model_id: str,
        from_version: str | None,
        to_version: str,
        strategy: Strategy,
        params: dict[str, Any],
        *,
        phase: str = "starting",
    ) -> RolloutRecord:
        """A running rollout in `phase`; Conflict if the model already has a running one."""
        _name(model_id, "model_id")
        if from_version is not None:
            _name(from_version, "from_version")
        _name(to_version, "to_version")
        if strategy not in STRATEGIES:
            raise BadRequest(f"strategy must be one of {list(STRATEGIES)}")
        now = utc_now()
        record = RolloutRecord(
            id="ro_" + uuid.uuid4().hex,
            model_id=model_id,
            from_version=from_version,
            to_version=to_version,
            strategy=strategy,
            phase=_text(phase, "phase", 64),
            status="running",
            params=_json_obj(params, "params"),
            state={},
            reason=None,
            created_at=now,
            updated_at=now,
        )
        return await self._run(self._create_rollout_sync, record)

    def _create_rollout_sync(self, r: RolloutRecord) -> RolloutRecord:
        try:
            with self._tx() as conn:
                conn.execute(rollouts_table.insert().values(**dataclasses.asdict(r)))
        except IntegrityError:
            raise Conflict(
                f"model {r.model_id} already has a running rollout", code="rollout_running"
            ) from None
        return r

    async def get_rollout(self, rollout_id: str) -> RolloutRecord | None:
        if not isinstance(rollout_id, str) or not 0 < len(rollout_id) <= 64:
            return None
        return await self._run(self._get_rollout_sync, rollout_id)

    def _get_rollout_sync(self, rollout_id: str, conn: Connection | None = None) -> RolloutRecord | None:
        query = sa.select(rollouts_table).where(rollouts_table.c.id == rollout_id)
        if conn is not None:
            row = conn.execute(query).first()
        else:
            with self._engine.connect() as c:
                row = c.execute(query).first()
        return None if row is None else _rollout_from_row(row)

    async def list_rollouts(
        self,
        model_id: str | None = None,
        status: str | None = None,
        *,
        after: str | None = None,
        limit: int | None = None,
    ) -> list[RolloutRecord]:
        """Oldest first; with `after` (a rollout's id) those that come after it, at most `limit`
        (a page: rollouts are kept, so a fleet's list only grows). NotFound for an unknown
        `after`."""
        if model_id is not None:
            _name(model_id, "model_id")
        if status is not None and status not in ROLLOUT_STATUSES:
            raise BadRequest(f"status must be one of {list(ROLLOUT_STATUSES)}")
        if after is not None:
            _text(after, "after", 64)
        if limit is not None:  # one past a page: the caller learns whether there are more
            _int(limit, "limit", 1, MAX_AUDIT_LIMIT + 1)
        return await self._run(self._list_rollouts_sync, model_id, status, after, limit)

    def _list_rollouts_sync(
        self, model_id: str | None, status: str | None, after: str | None, limit: int | None
    ) -> list[RolloutRecord]:
        t = rollouts_table
        query = sa.select(t).order_by(t.c.created_at, t.c.id)
        if model_id is not None:
            query = query.where(t.c.model_id == model_id)
        if status is not None:
            query = query.where(t.c.status == status)
        if limit is not None:
            query = query.limit(limit)
        with self._engine.connect() as conn:
            if after is not None:
                created = conn.execute(sa.select(t.c.created_at).where(t.c.id == after)).scalar()
                if created is None:
                    raise NotFound(f"no rollout {after!r} to list after")
                query = query.where(
                    sa.or_(t.c.created_at > created, sa.and_(t.c.created_at == created, t.c.id > after))
                )
            rows = conn.execute(query).all()
        return [_rollout_from_row(r) for r in rows]

    async def newest_rollouts(self, limit: int) -> list[RolloutRecord]:
        """The `limit` most recent rollouts, newest first (the dashboard's)."""
        _int(limit, "limit", 1, MAX_AUDIT_LIMIT)
        return await self._run(self._newest_rollouts_sync, limit)

    def _newest_rollouts_sync(self, limit: int) -> list[RolloutRecord]:
        t = rollouts_table
        query = sa.select(t).order_by(t.c.created_at.desc(), t.c.id.desc()).limit(limit)
        with self._engine.connect() as conn:
            return [_rollout_from_row(r) for r in conn.execute(query).all()]

    async def rollout_counts(self) -> dict[tuple[str, str], int]:
        """(model_id, status) -> how many rollouts are on record, counted by the database."""
        return await self._run(self._rollout_counts_sync)

    def _rollout_counts_sync(self) -> dict[tuple[str, str], int]:
        t = rollouts_table
        query = sa.select(t.c.model_id, t.c.status, sa.func.count()).group_by(t.c.model_id, t.c.status)
        with self._engine.connect() as conn:
            return {(model, status): int(n) for model, status, n in conn.execute(query).all()}

    async def update_rollout(
        self,
        rollout_id: str,
        *,
        phase: str | None = None,
        status: RolloutStatus | None = None,
        state: dict[str, Any] | None = None,
        reason: str | None = None,
        expect_phase: str | None = None,
    ) -> RolloutRecord:
        """Change the given fields. With `expect_phase`, only if the stored phase still is that
        (compare-and-set), else Conflict. `state` replaces the stored state, except that an
        abort request already stored (`abort_requested`, `abort_reason`) is kept."""
        if phase is not None:
            _text(phase, "phase", 64)
        if expect_phase is not None:
            _text(expect_phase, "expect_phase", 64)
        if status is not None and status not in ROLLOUT_STATUSES:
            raise BadRequest(f"status must be one of {list(ROLLOUT_STATUSES)}")
        values: dict[str, Any] = {}
        if phase is not None:
            values["phase"] = phase
        if status is not None:
            values["status"] = status
        if reason is not None:
            values["reason"] = _text(reason, "reason", MAX_MESSAGE_LEN)
        new_state = None if state is None else _json_obj(state, "state")
        return await self._run(self._update_rollout_sync, rollout_id, values, new_state, expect_phase, None)

    async def request_abort(self, rollout_id: str, reason: str = "aborted by request") -> RolloutRecord:
        """Set state.abort_requested (and abort_reason) without touching anything else; the
        rollout honours it at its next step. Conflict if the rollout is no longer running."""
        _text(reason, "reason", MAX_MESSAGE_LEN)
        return await self._run(
            self._update_rollout_sync,
            rollout_id,
            {},
            None,
            None,
            {"abort_requested": True, "abort_reason": reason},
        )

    def _update_rollout_sync(
        self,
        rollout_id: str,
        values: dict[str, Any],
        state: dict[str, Any] | None,
        expect_phase: str | None,
        merge: dict[str, Any] | None,
    ) -> RolloutRecord:
        t = rollouts_table
        try:
            with self._tx() as conn:
                row = conn.execute(sa.select(t).where(t.c.id == rollout_id).with_for_update()).first()
                if row is None:
                    raise NotFound(f"no rollout with id '{rollout_id}'", code="rollout_not_found")
                stored = dict(row.state or {})
                if merge is not None:
                    if row.status != "running":
                        raise Conflict(
                            f"rollout '{rollout_id}' is {row.status}, not running", code="rollout_finished"
                        )
                    values = {**values, "state": {**stored, **merge}}
                elif state is not None:
                    sticky = {k: stored[k] for k in ("abort_requested", "abort_reason") if k in stored}
                    values = {**values, "state": {**state, **sticky}}
                where = [t.c.id == rollout_id]
                if expect_phase is not None:
                    # The conditional UPDATE is the compare-and-set (also across processes on
                    # SQLite, where FOR UPDATE is a no-op but the write lock is held).
                    where.append(t.c.phase == expect_phase)
                result = conn.execute(t.update().where(*where).values(**values, updated_at=utc_now()))
                if result.rowcount != 1:
                    raise Conflict(
                        f"rollout '{rollout_id}' is in phase {row.phase!r}, not {expect_phase!r}",
                        code="phase_conflict",
                    )
                updated = self._get_rollout_sync(rollout_id, conn)
        except IntegrityError:
            raise Conflict("the model already has another running rollout", code="rollout_running") from None
        assert updated is not None  # noqa: S101 - written in this transaction
        return updated

    # -- audit -----------------------------------------------------------------------------

    async def audit(
        self,
        kind: str,
        message: str,
        *,
        model_id: str | None = None,
        version: str | None = None,
        rollout_id: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> AuditEvent:
        _text(kind, "kind", MAX_KIND_LEN)
        _text(message, "message", MAX_MESSAGE_LEN, allow_empty=True)
        if model_id is not None:
            _name(model_id, "model_id")
        if version is not None:
            _name(version, "version")
        if rollout_id is not None:
            _text(rollout_id, "rollout_id", 64)
        payload = _json_obj(data if data is not None else {}, "data")
        return await self._run(self._audit_sync, kind, message, model_id, version, rollout_id, payload)

    def _audit_sync(
        self,
        kind: str,
        message: str,
        model_id: str | None,
        version: str | None,
        rollout_id: str | None,
        data: dict[str, Any],
    ) -> AuditEvent:
        at = utc_now()
        with self._tx() as conn:
            result = conn.execute(
                audit_table.insert()
                .values(
                    at=at,
                    kind=kind,
                    model_id=model_id,
                    version=version,
                    rollout_id=rollout_id,
                    message=message,
                    data=data,
                )
                .returning(audit_table.c.id)
            )
            event_id = int(result.scalar_one())
        return AuditEvent(
            id=event_id,
            at=at,
            kind=kind,
            model_id=model_id,
            version=version,
            rollout_id=rollout_id,
            message=message,
            data=data,
        )

    async def list_audit(
        self,
        *,
        model_id: str | None = None,
        rollout_id: str | None = None,
        after_id: int | None = None,
        limit: int = 200,
    ) -> list[AuditEvent]:
        """Events in order (ascending id), after `after_id` if given, at most `limit`. With
        `model_id`: that model's events and the fleet-wide ones (no model: a leader change), which
        concern every model (a new leader adopts its replicas and resumes its rollout)."""
        if model_id is not None:
            _name(model_id, "model_id")
        if rollout_id is not None:
            _text(rollout_id, "rollout_id", 64)
        if after_id is not None:
            _int(after_id, "after_id", 0, 2**63 - 1)
        _int(limit, "limit", 1, MAX_AUDIT_LIMIT)
        return await self._run(self._list_audit_sync, model_id, rollout_id, after_id, limit)

    def _list_audit_sync(
        self, model_id: str | None, rollout_id: str | None, after_id: int | None, limit: int
    ) -> list[AuditEvent]:
        t = audit_table
        query = sa.select(t).order_by(t.c.id).limit(limit)
        if model_id is not None:
            query = query.where(sa.or_(t.c.model_id == model_id, t.c.model_id.is_(None)))
        if rollout_id is not None:
            query = query.where(t.c.rollout_id == rollout_id)
        if after_id is not None:
            query = query.where(t.c.id > after_id)
        with self._engine.connect() as conn:
            rows = conn.execute(query).all()
        return [_audit_from_row(r) for r in rows]

    # -- routes ----------------------------------------------------------------------------

    async def publish_routes(self, table: dict[str, Any]) -> int:
        """Store a routes table; its revision. The same content as the latest -> the latest's
        revision, no new row. (Validating the table's meaning is the feed's job.)"""
        # The gateway's own bound on a routes table (paved.gateway.routing.routes.MAX_FILE_BYTES).
        routes = _json_obj(table, "routes table", limit=4 * 1024 * 1024)
        return await self._run(self._publish_routes_sync, routes)

    def _publish_routes_sync(self, routes: dict[str, Any]) -> int:
        t = routes_table
        digest = hashlib.sha256(_canonical(routes)).hexdigest()
        with self._tx() as conn:
            if self._is_pg:
                # Serialise publishers to commit order = revision order, and make "same as the
                # latest" race-free (SQLite: BEGIN IMMEDIATE already serialises).
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": _ROUTES_LOCK_ID})
            latest = conn.execute(
                sa.select(t.c.revision, t.c.digest).order_by(t.c.revision.desc()).limit(1)
            ).first()
            if latest is not None and latest.digest == digest:
                return int(latest.revision)
            result = conn.execute(
                t.insert().values(digest=digest, routes=routes, created_at=utc_now()).returning(t.c.revision)
            )
            revision = int(result.scalar_one())
            conn.execute(t.delete().where(t.c.revision <= revision - ROUTES_KEPT))
        return revision

    async def latest_routes(self) -> tuple[int, dict[str, Any]] | None:
        return await self._run(self._latest_routes_sync)

    def _latest_routes_sync(self) -> tuple[int, dict[str, Any]] | None:
        t = routes_table
        with self._engine.connect() as conn:
            row = conn.execute(
                sa.select(t.c.revision, t.c.routes).order_by(t.c.revision.desc()).limit(1)
            ).first()
        return None if row is None else (int(row.revision), dict(row.routes))

    # -- desired counts and controller values ---------------------------------------------

    async def set_desired(self, deployment_id: str, region: str, replicas: int) -> None:
        _int(replicas, "replicas", 0, 10_000)
        _text(region, "region", 128)
        await self._run(
            self._upsert,
            desired_table,
            {"deployment_id": deployment_id, "region": region},
            {"replicas": replicas},
        )

    async def get_desired(self, deployment_id: str) -> dict[str, int]:
        """Region -> desired replicas (regions never set are absent: the deployment's default)."""
        t = desired_table

        def read() -> dict[str, int]:
            with self._engine.connect() as conn:
                rows = conn.execute(
                    sa.select(t.c.region, t.c.replicas).where(t.c.deployment_id == deployment_id)
                ).all()
            return {r.region: int(r.replicas) for r in rows}

        return await self._run(read)

    async def set_kv(self, key: str, value: Any) -> None:
        _text(key, "key", 128)
        await self._run(self._upsert, kv_table, {"key": key}, {"value": value})

    async def get_kv(self, key: str) -> Any:
        t = kv_table

        def read() -> Any:
            with self._engine.connect() as conn:
                row = conn.execute(sa.select(t.c.value).where(t.c.key == key)).first()
            return None if row is None else row.value

        return await self._run(read)

    def _upsert(self, table: sa.Table, keys: dict[str, Any], values: dict[str, Any]) -> None:
        with self._tx() as conn:
            where = sa.and_(*(table.c[k] == v for k, v in keys.items()))
            if conn.execute(table.update().where(where).values(**values)).rowcount == 0:
                conn.execute(table.insert().values(**keys, **values))


__all__ = [
    "ControlStore",
    "RolloutRecord",
    "audit_to_dict",
    "deployment_to_dict",
    "engine_for",
    "new_replica_id",
    "replica_to_dict",
    "rollout_to_dict",
    "spec_from_dict",
    "spec_to_dict",
    "validate_autoscale",
    "validate_replica",
    "validate_spec",
]

"""A/B experiments on a model alias: arms (model version, prompt template, sampling overrides)
with weights, sticky assignment, per-arm metrics, user feedback, and results with 95% intervals.

The request path (wired by the proxy) is: `registry.running_for(tenant, alias)` -> `assign(exp,
unit_key(exp, ...))` -> serve the arm (pin `alias@arm.version`, render `arm.template`, overlay
`arm.params`) -> `recorder.record(...)` once the answer is over. Admin routes manage experiments
(`experiments_router`); callers rate answers through `POST /v1/feedback` (`feedback_router`).

Invariants callers rely on:
- `assign` is a pure function of the experiment's salt, its arms' weights and the unit key:
  every replica, and every restart, puts one user (or key) on the same arm. Experiments are
  never edited (stop one and create another), so an assignment never moves mid-experiment.
  Each experiment has its own random salt, so two experiments split users independently.
- At most one experiment runs per model alias: a unique column holds the alias while the
  experiment runs (NULL once stopped), so two replicas creating at once cannot both win (409).
- `running_for` reads the database at most once per `cache_s` per replica (concurrent callers
  share one read); every other call is a dict lookup. A read that fails keeps the last snapshot
  serving (retried after `cache_s`), so an outage of the state store never fails a request
  because of experiments (the callers that arrive while a read runs do wait for it).
- `record` never blocks, never raises for a bad sample and never touches the database: it adds
  to in-memory per-arm accumulators (count and Welford mean/M2 per metric) and remembers the
  request id for feedback. Memory is bounded: at most `max_pending` request ids between flushes
  (beyond that the request still counts in the aggregates but cannot be rated; `dropped` counts
  it, a warning is logged) and one accumulator per (experiment, arm) pair.
- Flushes are additive: one transaction per flush updates each arm's row with `n = n + :n` and
  the parallel (Chan et al.) merge of mean and M2 in the same statement, so replicas sharing one
  PostgreSQL may flush in any order and the totals equal those of one replica that saw all
  requests. M2 only ever grows by non-negative terms, so a variance is never negative. A flush
  that fails puts its data back into the pending accumulators for the next one.
- Latency and token metrics count successful requests only (a fast failure would otherwise look
  like a fast arm); errors count in `requests` and `errors`.
- Feedback: one rating per (tenant, request id), for a request recorded (flushed or still
  pending on this replica) within `request_ttl_s`; another tenant's request answers exactly like
  an unknown one (404); a second rating is 409. A request recorded on another replica becomes
  ratable once that replica flushes (a miss is looked up again after one flush interval, at
  most MAX_FEEDBACK_GRACE_S).
- `results` flushes this replica first, so it includes everything recorded here.
- Once bound to the gateway's routes and template registry (`bind`, done by the Orchestrator),
  `create` refuses an experiment on an alias the routes in force do not have (400, param
  "model"), an arm version no backend of that alias serves (400, "arms[i].version") and an arm
  template the registry does not have (404 template_not_found, "arms[i].template", as a tenant's
  default_template). Routes may change later: an arm whose version has since left the routes is
  not applied (the orchestrator serves the request as if no experiment ran, and counts it).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import logging
import math
import re
import secrets
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import lru_cache
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Protocol

import sqlalchemy as sa
from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictStr
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError

from paved.gateway.access.admin_api import _admin_route_class
from paved.gateway.access.auth import AdminAuth, Authenticator
from paved.gateway.access.state import TENANT_NAME_RE, GatewayStore
from paved.gateway.errors import GatewayError
from paved.sql import utc, utc_now

if TYPE_CHECKING:
    from paved.gateway.routing.routes import ModelRoute

logger = logging.getLogger("paved.gateway.experiments")


class TemplateLookup(Protocol):
    """What an arm's template is checked against: orchestration's TemplateRegistry, known here
    by shape only, since the orchestrator (above this layer) is what assigns arms."""

    async def get(self, ref: str) -> Any: ...


SAMPLING_PARAMS = frozenset(
    {
        "temperature",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "stop",
    }
)
UNITS = ("user", "key")
MIN_ARMS = 2
MAX_ARMS = 16
MAX_TENANTS = 1000
MAX_RUNNING = 1000  # running experiments (every replica holds them all in memory)
MAX_LISTED = 1000  # experiments a listing returns (newest first)
MAX_WEIGHT = 1e9
MAX_STOP_SEQUENCES = 4  # as OpenAI's API
MAX_STOP_LEN = 256
MAX_TOKENS_LIMIT = 2**31 - 1
# The longest a feedback miss waits before its second look (for another replica's flush).
MAX_FEEDBACK_GRACE_S = 2.0
# Accumulators between flushes: far above 16 arms x the running experiments of one alias set.
MAX_PENDING_ARMS = 20_000

# The same shapes as the routes table's (paved.gateway.routing.routes): an experiment names the alias,
# versions and templates a route would.
NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
ARM_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
ALIAS_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+-]{0,255}")
VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
TEMPLATE_REF_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}(@[1-9][0-9]{0,8})?")
# As the proxy's x-request-id (paved.gateway.forwarding.proxy): what a recorded request id can look like.
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")

Z95 = 1.959963984540054  # the standard normal's 0.975 quantile
# Expired feedback rows are deleted at most this often (each flush would be wasteful).
_CLEANUP_EVERY_S = 60.0
_INSERT_CHUNK = 2000

metadata = sa.MetaData()

experiments_table = sa.Table(
    "gateway_experiments",
    metadata,
    sa.Column("name", sa.String(63), primary_key=True),
    sa.Column("model", sa.String(256), nullable=False),
    sa.Column("unit", sa.String(8), nullable=False),
    sa.Column("tenants", sa.JSON, nullable=False),
    sa.Column("arms", sa.JSON, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("salt", sa.String(64), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("stopped_at", sa.DateTime(timezone=True), nullable=True),
    # The alias while running, NULL once stopped: the unique index is the one-running-per-alias
    # rule, enforced by the database across replicas (NULLs never collide, in both backends).
    sa.Column("running_model", sa.String(256), nullable=True, unique=True),
)

_METRICS = ("latency", "prompt", "completion", "rating")


def _moment_columns(prefix: str) -> list[sa.Column[Any]]:
    return [
        sa.Column(f"{prefix}_n", sa.BigInteger, nullable=False, default=0),
        sa.Column(f"{prefix}_mean", sa.Double, nullable=False, default=0.0),
        sa.Column(f"{prefix}_m2", sa.Double, nullable=False, default=0.0),
    ]


experiment_arms_table = sa.Table(
    "gateway_experiment_arms",
    metadata,
    sa.Column("experiment", sa.String(63), sa.ForeignKey("gateway_experiments.name"), primary_key=True),
    sa.Column("arm", sa.String(63), primary_key=True),
    sa.Column("position", sa.Integer, nullable=False),
    sa.Column("requests", sa.BigInteger, nullable=False, default=0),
    sa.Column("errors", sa.BigInteger, nullable=False, default=0),
    *(col for prefix in _METRICS for col in _moment_columns(prefix)),
)

experiment_requests_table = sa.Table(
    "gateway_experiment_requests",
    metadata,
    # Request ids may come from the client (x-request-id), so they are unique per tenant only.
    sa.Column("tenant", sa.String(63), primary_key=True),
    sa.Column("request_id", sa.String(128), primary_key=True),
    sa.Column("experiment", sa.String(63), nullable=False),
    sa.Column("arm", sa.String(63), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False, index=True),
    sa.Column("rating", sa.Double, nullable=True),
    sa.Column("rated_at", sa.DateTime(timezone=True), nullable=True),
)


def _bad(message: str, param: str) -> GatewayError:
    return GatewayError(400, message, code="invalid_request", param=param)


def _not_found(name: str) -> GatewayError:
    return GatewayError(404, f"no experiment named '{name}'", code="experiment_not_found", param="name")


def _is_number(v: object) -> bool:
    # bool is an int subclass; a weight of True is a bug, not 1.
    return isinstance(v, int | float) and not isinstance(v, bool)


# -- the model ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    name: str
    weight: float
    # The version of the experiment's alias this arm is served by (None: the alias's current).
    version: str | None = None
    # A template reference, "name" or "name@N" (None: the request's or the route's own).
    template: str | None = None
    # Sampling overrides laid over the request's own (keys in SAMPLING_PARAMS).
    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "weight": self.weight,
            "version": self.version,
            "template": self.template,
            "params": {k: list(v) if isinstance(v, tuple) else v for k, v in self.params.items()},
        }


@dataclass(frozen=True)
class Experiment:
    name: str
    model: str  # the alias it applies to
    arms: tuple[Arm, ...]
    unit: Literal["user", "key"]
    tenants: tuple[str, ...]  # ("*",): every tenant
    status: Literal["running", "stopped"]
    salt: str
    created_at: datetime
    stopped_at: datetime | None = None
    # Precomputed for the hot path: cumulative weights and the tenant set.
    _cumulative: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _tenant_set: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        total = 0.0
        cumulative = []
        for arm in self.arms:
            total += arm.weight
            cumulative.append(total)
        object.__setattr__(self, "_cumulative", tuple(cumulative))
        object.__setattr__(self, "_tenant_set", frozenset(self.tenants))

    @property
    def control(self) -> Arm:
        """The first arm: what the others are compared with."""
        return self.arms[0]

    def applies_to(self, tenant: str) -> bool:
        return "*" in self._tenant_set or tenant in self._tenant_set

    def arm(self, name: str) -> Arm | None:
        return next((a for a in self.arms if a.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "object": "experiment",
            "name": self.name,
            "model": self.model,
            "unit": self.unit,
            "tenants": list(self.tenants),
            "status": self.status,
            "salt": self.salt,
            "created_at": self.created_at.isoformat(),
            "stopped_at": self.stopped_at.isoformat() if self.stopped_at else None,
            "arms": [a.to_dict() for a in self.arms],
        }


def assign(experiment: Experiment, unit_key: str) -> Arm:
    """The arm of `unit_key`: sha256(salt + "\\0" + unit_key) read as a uniform number in [0, 1),
    placed on the arms' cumulative weights."""
    digest = hashlib.sha256(f"{experiment.salt}\0{unit_key}".encode("utf-8", "surrogatepass")).digest()
    # 53 bits: exactly representable, so u < 1 always (64 bits / 2**64 can round up to 1.0).
    u = (int.from_bytes(digest[:8], "big") >> 11) / float(1 << 53)
    cumulative = experiment._cumulative
    target = u * cumulative[-1]
    for arm, edge in zip(experiment.arms, cumulative, strict=True):
        if target < edge:
            return arm
    return experiment.arms[-1]  # only reachable through rounding at the very top


def unit_key(experiment: Experiment, *, tenant: str, key_id: str, user: str | None = None) -> str:
    """What `assign` hashes for a request: the request's `user` field (falling back to the key id)
    for unit "user", the key id for unit "key"; qualified by tenant, since users are per tenant."""
    if experiment.unit == "user" and isinstance(user, str) and user:
        return f"{tenant}\0user\0{user}"
    return f"{tenant}\0key\0{key_id}"


# -- validation -----------------------------------------------------------------------------------


def _validate_name(name: object) -> str:
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise _bad(f"name must match {NAME_RE.pattern}", "name")
    return name


def _validate_model(model: object) -> str:
    if not isinstance(model, str) or ALIAS_RE.fullmatch(model) is None:
        raise _bad(f"model must be a model alias matching {ALIAS_RE.pattern} (no '@version')", "model")
    return model


def _number(value: object, param: str, lo: float, hi: float, *, lo_open: bool = False) -> float | int:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise _bad(f"{param} must be a finite number", param)
    if value < lo or value > hi or (lo_open and value == lo):
        bounds = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise _bad(f"{param} must be in {bounds}", param)
    return value


def _integer(value: object, param: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise _bad(f"{param} must be an integer between {lo} and {hi}", param)
    return value


def _validate_params(params: object, path: str) -> Mapping[str, Any]:
    if params is None:
        return MappingProxyType({})
    if not isinstance(params, Mapping):
        raise _bad(f"{path} must be an object of sampling parameters", path)
    out: dict[str, Any] = {}
    for key, value in params.items():
        param = f"{path}.{key}"
        if key not in SAMPLING_PARAMS:
            allowed = ", ".join(sorted(SAMPLING_PARAMS))
            raise _bad(f"{param} is not a sampling parameter an arm may set (one of: {allowed})", param)
        if key == "temperature":
            out[key] = _number(value, param, 0.0, 2.0)
        elif key == "top_p":
            out[key] = _number(value, param, 0.0, 1.0, lo_open=True)
        elif key in ("presence_penalty", "frequency_penalty"):
            out[key] = _number(value, param, -2.0, 2.0)
        elif key in ("max_tokens", "max_completion_tokens"):
            out[key] = _integer(value, param, 1, MAX_TOKENS_LIMIT)
        elif key == "seed":
            out[key] = _integer(value, param, -(2**63), 2**63 - 1)
        else:  # stop
            out[key] = _validate_stop(value, param)
    return MappingProxyType(out)


def _validate_stop(value: object, param: str) -> str | tuple[str, ...]:
    message = (
        f"{param} must be a string or a list of 1 to {MAX_STOP_SEQUENCES} strings, "
        f"each 1 to {MAX_STOP_LEN} characters"
    )
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not 1 <= len(items) <= MAX_STOP_SEQUENCES:
        raise _bad(message, param)
    for s in items:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_LEN:
            raise _bad(message, param)
    return value if isinstance(value, str) else tuple(items)


_ARM_KEYS = frozenset({"name", "weight", "version", "template", "params"})


def _validate_arms(arms: object) -> tuple[Arm, ...]:
    if not isinstance(arms, list | tuple) or not MIN_ARMS <= len(arms) <= MAX_ARMS:
        raise _bad(f"arms must be a list of {MIN_ARMS} to {MAX_ARMS} arms", "arms")
    out: list[Arm] = []
    seen: set[str] = set()
    for i, raw in enumerate(arms):
        path = f"arms[{i}]"
        if not isinstance(raw, Mapping):
            raise _bad(f"{path} must be an object", path)
        unknown = sorted(str(k) for k in raw if k not in _ARM_KEYS)
        if unknown:
            raise _bad(f"{path}.{unknown[0]} is not an arm field ({', '.join(sorted(_ARM_KEYS))})", path)
        name = raw.get("name")
        if not isinstance(name, str) or ARM_NAME_RE.fullmatch(name) is None:
            raise _bad(f"{path}.name must match {ARM_NAME_RE.pattern}", f"{path}.name")
        if name in seen:
            raise _bad(f"{path}.name '{name}' is used by another arm", f"{path}.name")
        seen.add(name)
        weight = raw.get("weight", 1)
        if (
            not isinstance(weight, int | float)
            or isinstance(weight, bool)
            or not math.isfinite(weight)
            or not 0 < weight <= MAX_WEIGHT
        ):
            raise _bad(f"{path}.weight must be a finite number > 0 and <= {MAX_WEIGHT:g}", f"{path}.weight")
        version = raw.get("version")
        if version is not None and (not isinstance(version, str) or VERSION_RE.fullmatch(version) is None):
            raise _bad(f"{path}.version must match {VERSION_RE.pattern}", f"{path}.version")
        template = raw.get("template")
        if template is not None and (
            not isinstance(template, str) or TEMPLATE_REF_RE.fullmatch(template) is None
        ):
            raise _bad(f"{path}.template must be 'name' or 'name@N'", f"{path}.template")
        params = _validate_params(raw.get("params"), f"{path}.params")
        out.append(Arm(name=name, weight=float(weight), version=version, template=template, params=params))
    return tuple(out)


def _validate_unit(unit: object) -> Literal["user", "key"]:
    if unit == "user":
        return "user"
    if unit == "key":
        return "key"
    raise _bad("unit must be 'user' or 'key'", "unit")


def _validate_tenants(tenants: object) -> tuple[str, ...]:
    if isinstance(tenants, str) or not isinstance(tenants, list | tuple):
        raise _bad("tenants must be a list of tenant names, or ['*'] for every tenant", "tenants")
    if not 1 <= len(tenants) <= MAX_TENANTS:
        raise _bad(f"tenants must list 1 to {MAX_TENANTS} tenants", "tenants")
    for t in tenants:
        if t != "*" and (not isinstance(t, str) or TENANT_NAME_RE.fullmatch(t) is None):
            raise _bad("each entry of tenants must be a tenant name or '*'", "tenants")
    out = tuple(dict.fromkeys(tenants))
    return ("*",) if "*" in out else out


def _experiment_from_row(row: Any) -> Experiment:
    arms = tuple(
        Arm(
            name=a["name"],
            weight=float(a["weight"]),
            version=a.get("version"),
            template=a.get("template"),
            params=MappingProxyType(
                {k: tuple(v) if isinstance(v, list) else v for k, v in (a.get("params") or {}).items()}
            ),
        )
        for a in row.arms
    )
    return Experiment(
        name=row.name,
        model=row.model,
        arms=arms,
        unit="key" if row.unit == "key" else "user",
        tenants=tuple(row.tenants),
        status="running" if row.status == "running" else "stopped",
        salt=row.salt,
        created_at=utc(row.created_at) or utc_now(),  # NOT NULL column: the fallback never runs
        stopped_at=utc(row.stopped_at),
    )


# -- the registry ---------------------------------------------------------------------------------


class ExperimentRegistry:
    """Experiments in the gateway's store, and a per-replica snapshot of the running ones."""

    def __init__(
        self, store: GatewayStore, *, cache_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ):
        if not 0 <= cache_s <= 60:
            raise ValueError("cache_s must be between 0 and 60 seconds")
        self._store = store
        self._clock = clock
        self._cache_s = cache_s
        self._running: dict[str, Experiment] = {}  # alias -> its running experiment
        self._fresh_until = 0.0  # monotonic
        self._refreshing: asyncio.Future[None] | None = None
        # Bumped by this replica's own changes: a read that began before one must not undo it.
        self._generation = 0
        self.db_reads = 0  # snapshot reads (tests and metrics: the cache's effect is observable)
        # Unbound (a bare library registry) nothing outside the experiment itself is checked.
        self._route_of: Callable[[str], ModelRoute | None] | None = None
        self._templates: TemplateLookup | None = None

    def bind(self, route_of: Callable[[str], ModelRoute | None], templates: TemplateLookup | None) -> None:
        """Check what `create` names against the gateway: `route_of(alias)` is the alias's route
        in force (None: no such alias); `templates` None means the gateway renders no templates,
        so an arm naming one is refused."""
        self._route_of = route_of
        self._templates = templates

    async def start(self) -> None:
        await self._store.create_tables(metadata)
        await self._refresh()

    # -- hot path --

    async def running_for(self, tenant: str, alias: str) -> Experiment | None:
        """The experiment running on `alias` (a bare alias) that applies to `tenant`, or None."""
        if self._clock() >= self._fresh_until:
            await self._refresh_shared()
        exp = self._running.get(alias)
        if exp is None or not exp.applies_to(tenant):
            return None
        return exp

    async def _refresh_shared(self) -> None:
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._refresh_tolerant())
            self._refreshing.add_done_callback(self._refresh_done)
        # Shielded: one caller going away must not cancel the read the others wait on.
        await asyncio.shield(self._refreshing)

    def _refresh_done(self, future: asyncio.Future[None]) -> None:
        self._refreshing = None
        if not future.cancelled():
            future.exception()  # seen, even when every waiter has gone

    async def _refresh_tolerant(self) -> None:
        try:
            await self._refresh()
        except Exception as exc:  # noqa: BLE001 - an unreachable store must not fail requests
            logger.warning("could not read running experiments (%s); keeping the last snapshot", exc)
            self._fresh_until = self._clock() + self._cache_s

    async def _refresh(self) -> None:
        generation = self._generation
        started = self._clock()
        self.db_reads += 1
        running = await self._store.run(self._running_sync)
        if generation != self._generation:
            # A local create/stop landed meanwhile; this read may predate it: read again soon.
            self._fresh_until = 0.0
            return
        self._running = {e.model: e for e in running}
        # Counted from before the read, so the snapshot is never older than cache_s.
        self._fresh_until = started + self._cache_s

    def _running_sync(self) -> list[Experiment]:
        t = experiments_table
        with self._store.engine.connect() as conn:
            rows = conn.execute(sa.select(t).where(t.c.status == "running").limit(MAX_RUNNING)).all()
        return [_experiment_from_row(r) for r in rows]

    def _apply_local(self, exp: Experiment) -> None:
        self._generation += 1
        if exp.status == "running":
            self._running[exp.model] = exp
        elif (current := self._running.get(exp.model)) is not None and current.name == exp.name:
            del self._running[exp.model]

    # -- admin --

    async def create(
        self,
        name: str,
        model: str,
        arms: list[dict[str, Any]],
        *,
        unit: str = "user",
        tenants: list[str] | tuple[str, ...] = ("*",),
    ) -> Experiment:
        exp = Experiment(
            name=_validate_name(name),
            model=_validate_model(model),
            arms=_validate_arms(arms),
            unit=_validate_unit(unit),
            tenants=_validate_tenants(tenants),
            status="running",
            salt=secrets.token_hex(16),
            created_at=utc_now(),
        )
        await self._check_targets(exp)
        await self._store.run(self._create_sync, exp)
        self._apply_local(exp)
        return exp

    async def _check_targets(self, exp: Experiment) -> None:
        """What the arms would serve must exist now: an experiment created on a typo would
        otherwise answer its share of real users with 404s."""
        if self._route_of is None:
            return
        route = self._route_of(exp.model)
        if route is None:
            raise _bad(f"model '{exp.model}' is not in the gateway's routes", "model")
        for i, arm in enumerate(exp.arms):
            if arm.version is not None and arm.version not in route.versions:
                served = ", ".join(route.versions) or "none"
                raise _bad(
                    f"arms[{i}].version '{arm.version}' is not served for '{exp.model}' "
                    f"(versions in the gateway's routes: {served})",
                    f"arms[{i}].version",
                )
            if arm.template is None:
                continue
            param = f"arms[{i}].template"
            if self._templates is None:
                raise _bad("this gateway has no template registry", param)
            try:
                await self._templates.get(arm.template)
            except GatewayError as exc:
                if exc.status == 404:
                    raise GatewayError(
                        404, f"no prompt template '{arm.template}'", code="template_not_found", param=param
                    ) from None
                raise

    def _create_sync(self, exp: Experiment) -> None:
        t = experiments_table
        try:
            with self._store.engine.begin() as conn:
                running = conn.execute(
                    sa.select(sa.func.count()).select_from(t).where(t.c.status == "running")
                ).scalar_one()
                if running >= MAX_RUNNING:
                    raise GatewayError(
                        409,
                        f"{MAX_RUNNING} experiments are running already; stop one first",
                        code="too_many_experiments",
                    )
                conn.execute(
                    t.insert().values(
                        name=exp.name,
                        model=exp.model,
                        unit=exp.unit,
                        tenants=list(exp.tenants),
                        arms=[a.to_dict() for a in exp.arms],
                        status="running",
                        salt=exp.salt,
                        created_at=exp.created_at,
                        stopped_at=None,
                        running_model=exp.model,
                    )
                )
                conn.execute(
                    experiment_arms_table.insert(),
                    [_zero_arm_row(exp.name, arm.name, i) for i, arm in enumerate(exp.arms)],
                )
        except IntegrityError:
            raise self._conflict(exp) from None

    def _conflict(self, exp: Experiment) -> GatewayError:
        t = experiments_table
        with self._store.engine.connect() as conn:
            if conn.execute(sa.select(t.c.name).where(t.c.name == exp.name)).first() is not None:
                return GatewayError(
                    409,
                    f"an experiment named '{exp.name}' already exists",
                    code="experiment_exists",
                    param="name",
                )
            other = conn.execute(sa.select(t.c.name).where(t.c.running_model == exp.model)).scalar()
        return GatewayError(
            409,
            f"experiment '{other}' is already running on model '{exp.model}'; stop it first",
            code="experiment_running",
            param="model",
        )

    async def get(self, name: str) -> Experiment:
        if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
            raise _not_found(str(name)[:64])
        found = await self._store.run(self._get_sync, name)
        if found is None:
            raise _not_found(name)
        return found

    def _get_sync(self, name: str) -> Experiment | None:
        t = experiments_table
        with self._store.engine.connect() as conn:
            row = conn.execute(sa.select(t).where(t.c.name == name)).first()
        return None if row is None else _experiment_from_row(row)

    async def list(self) -> builtins.list[Experiment]:
        """Experiments, newest first (at most MAX_LISTED)."""
        return await self._store.run(self._list_sync)

    def _list_sync(self) -> builtins.list[Experiment]:
        t = experiments_table
        with self._store.engine.connect() as conn:
            rows = conn.execute(
                sa.select(t).order_by(t.c.created_at.desc(), t.c.name).limit(MAX_LISTED)
            ).all()
        return [_experiment_from_row(r) for r in rows]

    async def stop(self, name: str) -> Experiment:
        """Stop an experiment (idempotent: stopping again keeps the first stop time). Its data and
        results stay; its alias is free for another experiment."""
        if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
            raise _not_found(str(name)[:64])
        exp = await self._store.run(self._stop_sync, name)
        self._apply_local(exp)
        return exp

    def _stop_sync(self, name: str) -> Experiment:
        t = experiments_table
        with self._store.engine.begin() as conn:
            conn.execute(
                t.update()
                .where(t.c.name == name, t.c.status == "running")
                .values(status="stopped", stopped_at=utc_now(), running_model=None)
            )
            row = conn.execute(sa.select(t).where(t.c.name == name)).first()
        if row is None:
            raise _not_found(name)
        return _experiment_from_row(row)


def _zero_arm_row(experiment: str, arm: str, position: int) -> dict[str, Any]:
    row: dict[str, Any] = {
        "experiment": experiment,
        "arm": arm,
        "position": position,
        "requests": 0,
        "errors": 0,
    }
    for prefix in _METRICS:
        row.update({f"{prefix}_n": 0, f"{prefix}_mean": 0.0, f"{prefix}_m2": 0.0})
    return row


# -- statistics -----------------------------------------------------------------------------------


@dataclass
class Moments:
    """Count, mean and M2 (sum of squared deviations) of a sample, by Welford's update; two
    samples merge by Chan et al.'s parallel formula (what a flush does in SQL)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    def merge(self, other: Moments) -> None:
        if other.n == 0:
            return
        total = self.n + other.n
        delta = other.mean - self.mean
        self.mean += delta * other.n / total
        self.m2 += other.m2 + delta * delta * self.n * other.n / total
        self.n = total

    @property
    def variance(self) -> float | None:
        """The sample variance (n - 1), never negative; None below two observations."""
        return max(self.m2, 0.0) / (self.n - 1) if self.n >= 2 else None


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson's score interval for a proportion (None when n is 0)."""
    if n <= 0:
        return None
    p = successes / n
    z2 = z * z
    denom = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(max(p * (1 - p) / n + z2 / (4 * n * n), 0.0)) / denom
    lo = 0.0 if successes <= 0 else max(0.0, center - half)
    hi = 1.0 if successes >= n else min(1.0, center + half)
    return lo, hi


def newcombe_interval(
    x1: int, n1: int, x2: int, n2: int, z: float = Z95
) -> tuple[float, float, float] | None:
    """(p1 - p2, lo, hi): Newcombe's hybrid score interval (his method 10) for a difference of
    two independent proportions, from each one's Wilson interval. None if either n is 0."""
    w1, w2 = wilson_interval(x1, n1, z), wilson_interval(x2, n2, z)
    if w1 is None or w2 is None:
        return None
    p1, p2 = x1 / n1, x2 / n2
    d = p1 - p2
    lo = d - math.sqrt((p1 - w1[0]) ** 2 + (w2[1] - p2) ** 2)
    hi = d + math.sqrt((w1[1] - p1) ** 2 + (p2 - w2[0]) ** 2)
    return d, max(-1.0, lo), min(1.0, hi)


def _betacf(a: float, b: float, x: float) -> float:
    # The continued fraction of the regularized incomplete beta function (modified Lentz).
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student's t distribution function (df > 0, not necessarily an integer)."""
    if df > 1e7:  # the beta function's lgamma terms lose digits; the normal is exact enough here
        return 0.5 * math.erfc(-t / math.sqrt(2))
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


@lru_cache(maxsize=4096)
def t_quantile(p: float, df: float) -> float:
    """Student's t quantile for 0.5 <= p < 1 and df >= 1 (real df, as Welch's): Newton's method on
    `t_cdf` from the normal quantile, kept inside a bisection bracket."""
    if not 0.5 <= p < 1 or not df >= 1:
        raise ValueError("t_quantile needs 0.5 <= p < 1 and df >= 1")
    if p == 0.5:
        return 0.0
    if df > 1e5:
        # Cornish-Fisher expansion around the normal: its error, O(df^-4), is far below rounding.
        z = _normal_quantile(p)
        return (
            z
            + (z**3 + z) / (4 * df)
            + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
        )
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    x = min(max(_normal_quantile(p), lo), hi)
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    for _ in range(100):
        f = t_cdf(x, df) - p
        if abs(f) < 1e-14:
            break
        if f < 0:
            lo = x
        else:
            hi = x
        pdf = math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))
        step = x - f / pdf if pdf > 0 else (lo + hi) / 2
        x = step if lo < step < hi else (lo + hi) / 2
        if hi - lo < 1e-13 * max(1.0, x):
            break
    return x


def _normal_quantile(p: float) -> float:
    # Only p = 0.975 is used by the intervals; other p come from a few bisection steps.
    if p == 0.975:
        return Z95
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(-mid / math.sqrt(2)) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def mean_interval(m: Moments) -> tuple[float, float] | None:
    """The t-based 95% interval of the mean (None below two observations)."""
    var = m.variance
    if var is None:
        return None
    half = t_quantile(0.975, m.n - 1) * math.sqrt(var / m.n)
    return m.mean - half, m.mean + half


def welch_interval(a: Moments, b: Moments) -> tuple[float, float, float] | None:
    """(mean(a) - mean(b), lo, hi): Welch's 95% interval for a difference of means, with the
    Welch-Satterthwaite degrees of freedom. None unless both samples have two observations."""
    va, vb = a.variance, b.variance
    if va is None or vb is None:
        return None
    d = a.mean - b.mean
    sa2, sb2 = va / a.n, vb / b.n
    se2 = sa2 + sb2
    if se2 <= 0.0:
        return d, d, d
    df = se2 * se2 / (sa2 * sa2 / (a.n - 1) + sb2 * sb2 / (b.n - 1))
    # df lies between min(n) - 1 and n_a + n_b - 2; the clamp guards against float rounding.
    df = min(max(df, 1.0), float(a.n + b.n - 2))
    half = t_quantile(0.975, df) * math.sqrt(se2)
    return d, d - half, d + half


# -- the recorder ---------------------------------------------------------------------------------


@dataclass
class _ArmAcc:
    requests: int = 0
    errors: int = 0
    latency: Moments = field(default_factory=Moments)
    prompt: Moments = field(default_factory=Moments)
    completion: Moments = field(default_factory=Moments)

    def merge(self, other: _ArmAcc) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.latency.merge(other.latency)
        self.prompt.merge(other.prompt)
        self.completion.merge(other.completion)


# (experiment, arm, recorded at: epoch seconds)
_PendingRequest = tuple[str, str, float]


def _merge_values(prefix: str, m: Moments) -> dict[Any, Any]:
    """SET clauses adding `m` to a stored (n, mean, M2): the right-hand sides read the row's old
    values (SQL semantics in SQLite and PostgreSQL), so the statement is one atomic merge."""
    t = experiment_arms_table
    n, mean, m2 = t.c[f"{prefix}_n"], t.c[f"{prefix}_mean"], t.c[f"{prefix}_m2"]
    bn = sa.literal(float(m.n), sa.Double)
    total = n + bn
    delta = sa.literal(m.mean, sa.Double) - mean
    return {
        n: n + sa.literal(m.n, sa.BigInteger),
        mean: mean + delta * bn / total,
        m2: m2 + sa.literal(m.m2, sa.Double) + delta * delta * n * bn / total,
    }


def _insert_ignoring_duplicates(dialect: str) -> Any:
    t = experiment_requests_table
    # A client reusing an x-request-id: the first recorded request keeps the id.
    if dialect == "postgresql":
        return postgresql.insert(t).on_conflict_do_nothing()
    return sqlite.insert(t).on_conflict_do_nothing()


class ExperimentRecorder:
    """Per-arm metrics aggregated in memory and flushed additively; feedback and results."""

    def __init__(
        self,
        store: GatewayStore,
        *,
        flush_s: float = 1.0,
        request_ttl_s: float = 7 * 86400,
        max_pending: int = 100_000,
    ):
        if not 0 < flush_s <= 3600:
            raise ValueError("flush_s must be in (0, 3600] seconds")
        if not 0 < request_ttl_s <= 366 * 86400:
            raise ValueError("request_ttl_s must be in (0, 366 days]")
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self._store = store
        self._flush_s = flush_s
        self._ttl_s = request_ttl_s
        self._max_pending = max_pending
        self._stats: dict[tuple[str, str], _ArmAcc] = {}
        self._requests: dict[tuple[str, str], _PendingRequest] = {}
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._last_cleanup = 0.0
        self._dropped_unlogged = 0
        # Observable counters (for metrics and tests).
        self.dropped = 0  # requests that counted in the aggregates but could not be kept for feedback
        self.flushes = 0
        self.flush_failures = 0

    async def start(self) -> None:
        await self._store.create_tables(metadata)
        if self._task is None:
            self._stopping.clear()
            self._task = asyncio.create_task(self._loop(), name="experiment-recorder-flush")

    async def stop(self) -> None:
        """Stop the flush task and flush what is pending (logged, not raised, if that fails)."""
        if self._task is not None:
            # Not cancelled: a flush cut short could not tell whether its transaction committed.
            self._stopping.set()
            await self._task
            self._task = None
        if not self._stats and not self._requests:
            return
        try:
            await self.flush()
        except Exception as exc:  # noqa: BLE001 - shutting down: log what is lost, do not raise
            logger.error("experiment metrics not flushed at shutdown (%s): %s", exc, self._pending_summary())

    async def _loop(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._flush_s)
            try:
                await self.flush()
            except Exception as exc:  # noqa: BLE001 - kept pending; the next flush retries
                logger.warning("experiment metrics flush failed (%s); retrying in %.1f s", exc, self._flush_s)

    def _pending_summary(self) -> str:
        return f"{sum(a.requests for a in self._stats.values())} requests, {len(self._requests)} request ids"

    # -- hot path --

    def record(
        self,
        experiment: Experiment,
        arm: Arm,
        *,
        tenant: str,
        request_id: str,
        latency_s: float,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        error: bool,
    ) -> None:
        """Count one answered request of `arm` (call on the event loop once the answer is over)."""
        key = (experiment.name, arm.name)
        acc = self._stats.get(key)
        if acc is None:
            if len(self._stats) >= MAX_PENDING_ARMS:
                self._drop()
                return
            acc = self._stats[key] = _ArmAcc()
        acc.requests += 1
        if error:
            acc.errors += 1
        else:
            if _is_number(latency_s) and math.isfinite(latency_s) and latency_s >= 0:
                acc.latency.add(float(latency_s))
            if isinstance(prompt_tokens, int) and not isinstance(prompt_tokens, bool) and prompt_tokens >= 0:
                acc.prompt.add(float(prompt_tokens))
            if (
                isinstance(completion_tokens, int)
                and not isinstance(completion_tokens, bool)
                and completion_tokens >= 0
            ):
                acc.completion.add(float(completion_tokens))
        # Only ids the proxy could have issued, of a real tenant name, are kept: one value the
        # columns cannot hold would fail every later flush of its batch.
        if not isinstance(request_id, str) or REQUEST_ID_RE.fullmatch(request_id) is None:
            return
        if not isinstance(tenant, str) or TENANT_NAME_RE.fullmatch(tenant) is None:
            return
        rkey = (tenant, request_id)
        if rkey in self._requests:
            return
        if len(self._requests) >= self._max_pending:
            self._drop()
            return
        self._requests[rkey] = (experiment.name, arm.name, time.time())

    def _drop(self) -> None:
        self.dropped += 1
        self._dropped_unlogged += 1

    # -- flushing --

    async def flush(self) -> None:
        """Write what is pending (one transaction); on failure it stays pending and this raises."""
        async with self._lock:
            if self._dropped_unlogged:
                logger.warning(
                    "experiment recorder full: %d requests since the last flush were counted but "
                    "cannot be rated (max_pending=%d)",
                    self._dropped_unlogged,
                    self._max_pending,
                )
                self._dropped_unlogged = 0
            stats, self._stats = self._stats, {}
            requests, self._requests = self._requests, {}
            cleanup = time.monotonic() - self._last_cleanup >= _CLEANUP_EVERY_S
            if not stats and not requests and not cleanup:
                return
            write = asyncio.ensure_future(self._store.run(self._flush_sync, stats, requests, cleanup))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                # The write goes on in its thread; only its outcome says whether to put the
                # batch back (restoring a batch that committed would count it twice).
                write.add_done_callback(lambda f: self._settle(f, stats, requests))
                raise
            except Exception:
                self.flush_failures += 1
                self._restore(stats, requests)
                raise
            self.flushes += 1
            if cleanup:
                self._last_cleanup = time.monotonic()

    def _settle(
        self,
        write: asyncio.Future[None],
        stats: dict[tuple[str, str], _ArmAcc],
        requests: dict[tuple[str, str], _PendingRequest],
    ) -> None:
        if write.cancelled() or write.exception() is not None:
            self.flush_failures += 1
            self._restore(stats, requests)
        else:
            self.flushes += 1

    def _restore(
        self, stats: dict[tuple[str, str], _ArmAcc], requests: dict[tuple[str, str], _PendingRequest]
    ) -> None:
        # What arrived meanwhile is newer: merge the failed batch under it, within the bounds.
        for key, acc in stats.items():
            current = self._stats.get(key)
            if current is not None:
                current.merge(acc)
            elif len(self._stats) < MAX_PENDING_ARMS:
                self._stats[key] = acc
            else:
                self.dropped += acc.requests
        for rkey, value in requests.items():
            if rkey in self._requests:
                continue
            if len(self._requests) >= self._max_pending:
                self.dropped += 1
                continue
            self._requests[rkey] = value

    def _flush_sync(
        self,
        stats: dict[tuple[str, str], _ArmAcc],
        requests: dict[tuple[str, str], _PendingRequest],
        cleanup: bool,
    ) -> None:
        t = experiment_arms_table
        now = utc_now()
        ttl = timedelta(seconds=self._ttl_s)
        with self._store.engine.begin() as conn:
            # Sorted: every replica locks arm rows in one order, so concurrent flushes on
            # PostgreSQL wait for each other instead of deadlocking.
            for (exp_name, arm_name), acc in sorted(stats.items()):
                values: dict[Any, Any] = {
                    t.c.requests: t.c.requests + sa.literal(acc.requests, sa.BigInteger),
                    t.c.errors: t.c.errors + sa.literal(acc.errors, sa.BigInteger),
                }
                for prefix, moments in (
                    ("latency", acc.latency),
                    ("prompt", acc.prompt),
                    ("completion", acc.completion),
                ):
                    if moments.n > 0:  # n = 0 would divide 0 by 0 in the merge
                        values.update(_merge_values(prefix, moments))
                conn.execute(t.update().where(t.c.experiment == exp_name, t.c.arm == arm_name).values(values))
            if requests:
                rows = []
                for (tenant, request_id), (exp_name, arm_name, at) in sorted(requests.items()):
                    created = datetime.fromtimestamp(at, tz=now.tzinfo)
                    rows.append(
                        {
                            "tenant": tenant,
                            "request_id": request_id,
                            "experiment": exp_name,
                            "arm": arm_name,
                            "created_at": created,
                            "expires_at": created + ttl,
                            "rating": None,
                            "rated_at": None,
                        }
                    )
                stmt = _insert_ignoring_duplicates(self._store.dialect)
                for i in range(0, len(rows), _INSERT_CHUNK):
                    conn.execute(stmt, rows[i : i + _INSERT_CHUNK])
            if cleanup:
                r = experiment_requests_table
                conn.execute(r.delete().where(r.c.expires_at < now))

    # -- feedback --

    async def feedback(self, tenant: str, request_id: str, rating: float) -> dict[str, Any]:
        """Rate a recorded request of `tenant`: 0 (bad) to 1 (good); thumbs up/down are 1/0."""
        if not _is_number(rating) or not math.isfinite(rating) or not 0 <= rating <= 1:
            raise _bad("rating must be a number between 0 and 1 (thumbs up = 1, down = 0)", "rating")
        if not isinstance(request_id, str) or REQUEST_ID_RE.fullmatch(request_id) is None:
            raise _bad(f"request_id must match {REQUEST_ID_RE.pattern}", "request_id")
        if (tenant, request_id) in self._requests:
            await self.flush()
        elif self._lock.locked():
            # A flush under way may be writing this very request: wait for it to commit.
            async with self._lock:
                pass
        found = await self._store.run(self._rate_sync, tenant, request_id, float(rating))
        if found is None:
            # Recorded by another replica that has not flushed yet: look once more after one of
            # its flush intervals (the replicas share the configuration), capped.
            await asyncio.sleep(min(self._flush_s, MAX_FEEDBACK_GRACE_S))
            found = await self._store.run(self._rate_sync, tenant, request_id, float(rating))
        if found is None:
            raise GatewayError(
                404,
                f"no recorded experiment request with id '{request_id}'",
                code="request_not_found",
                param="request_id",
            )
        exp_name, arm_name = found
        return {"request_id": request_id, "experiment": exp_name, "arm": arm_name, "rating": float(rating)}

    def _rate_sync(self, tenant: str, request_id: str, rating: float) -> tuple[str, str] | None:
        r = experiment_requests_table
        now = utc_now()
        where = (r.c.tenant == tenant, r.c.request_id == request_id)
        with self._store.engine.begin() as conn:
            row = conn.execute(sa.select(r).where(*where)).first()
            if row is None or (utc(row.expires_at) or now) <= now:
                return None
            conflict = GatewayError(
                409,
                f"request '{request_id}' has been rated already",
                code="already_rated",
                param="request_id",
            )
            if row.rating is not None:
                raise conflict
            # Conditional: of two concurrent raters (any replicas) exactly one updates the row.
            done = conn.execute(
                r.update().where(*where, r.c.rating.is_(None)).values(rating=rating, rated_at=now)
            )
            if done.rowcount != 1:
                raise conflict
            a = experiment_arms_table
            conn.execute(
                a.update()
                .where(a.c.experiment == row.experiment, a.c.arm == row.arm)
                .values(_merge_values("rating", Moments(1, rating, 0.0)))
            )
        return row.experiment, row.arm

    # -- results --

    async def results(self, name: str) -> dict[str, Any]:
        """Per-arm counts, means and 95% intervals, and each arm against the first (control)."""
        if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
            raise _not_found(str(name)[:64])
        await self.flush()
        found = await self._store.run(self._results_sync, name)
        if found is None:
            raise _not_found(name)
        exp, rows = found
        return compute_results(exp, rows)

    def _results_sync(self, name: str) -> tuple[Experiment, list[Any]] | None:
        t, a = experiments_table, experiment_arms_table
        with self._store.engine.connect() as conn:
            row = conn.execute(sa.select(t).where(t.c.name == name)).first()
            if row is None:
                return None
            rows = conn.execute(sa.select(a).where(a.c.experiment == name).order_by(a.c.position)).all()
        return _experiment_from_row(row), list(rows)


@dataclass
class ArmStats:
    requests: int
    errors: int
    latency: Moments  # seconds
    prompt: Moments
    completion: Moments
    rating: Moments


def _arm_stats(row: Any) -> ArmStats:
    def m(prefix: str) -> Moments:
        return Moments(
            int(getattr(row, f"{prefix}_n")),
            float(getattr(row, f"{prefix}_mean")),
            float(getattr(row, f"{prefix}_m2")),
        )

    return ArmStats(
        int(row.requests), int(row.errors), m("latency"), m("prompt"), m("completion"), m("rating")
    )


def _scaled(m: Moments, k: float) -> Moments:
    return Moments(m.n, m.mean * k, m.m2 * k * k)


def _summary(m: Moments, *, ci: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"n": m.n, "mean": m.mean if m.n else None}
    if ci:
        interval = mean_interval(m)
        out["ci95"] = list(interval) if interval else None
    return out


def _difference(result: tuple[float, float, float] | None) -> dict[str, Any]:
    if result is None:
        return {"difference": None, "ci95": None}
    d, lo, hi = result
    return {"difference": d, "ci95": [lo, hi]}


def compute_results(exp: Experiment, rows: list[Any]) -> dict[str, Any]:
    """The results document from an experiment and its arm rows (`results` without the I/O)."""
    by_name = {r.arm: _arm_stats(r) for r in rows}
    empty = ArmStats(0, 0, Moments(), Moments(), Moments(), Moments())
    stats = [(arm, by_name.get(arm.name, empty)) for arm in exp.arms]
    control_arm, control = stats[0]
    arms_out = []
    for i, (arm, s) in enumerate(stats):
        wilson = wilson_interval(s.errors, s.requests)
        latency_ms = _scaled(s.latency, 1000.0)
        entry: dict[str, Any] = {
            **arm.to_dict(),
            "control": i == 0,
            "requests": s.requests,
            "errors": s.errors,
            "error_rate": {
                "value": s.errors / s.requests if s.requests else None,
                "ci95": list(wilson) if wilson else None,
            },
            "latency_ms": _summary(latency_ms),
            "completion_tokens": _summary(s.completion),
            "prompt_tokens": _summary(s.prompt, ci=False),
            "rating": _summary(s.rating),
        }
        if i > 0:
            entry["comparison"] = {
                "control": control_arm.name,
                "error_rate": _difference(
                    newcombe_interval(s.errors, s.requests, control.errors, control.requests)
                ),
                "latency_ms": _difference(welch_interval(latency_ms, _scaled(control.latency, 1000.0))),
                "completion_tokens": _difference(welch_interval(s.completion, control.completion)),
                "prompt_tokens": _difference(welch_interval(s.prompt, control.prompt)),
                "rating": _difference(welch_interval(s.rating, control.rating)),
            }
        arms_out.append(entry)
    return {
        "object": "experiment.results",
        "experiment": exp.to_dict(),
        "control": control_arm.name,
        "confidence": 0.95,
        "arms": arms_out,
    }


# -- HTTP -----------------------------------------------------------------------------------------


class ExperimentCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Shapes and bounds are checked by ExperimentRegistry.create (the body itself is bounded by
    # the app's body limit), so the library and the API answer with the same messages.
    name: StrictStr
    model: StrictStr
    arms: list[Any]
    unit: StrictStr = "user"
    tenants: list[StrictStr] = Field(default_factory=lambda: ["*"])


class FeedbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: StrictStr
    rating: StrictFloat  # an integer (thumbs: 0 or 1) is accepted; a bool or a string is not


def experiments_router(
    registry: ExperimentRegistry, recorder: ExperimentRecorder, admin: AdminAuth
) -> APIRouter:
    """The admin routes (every one checks the admin key before reading the body):
    POST /admin/v1/experiments {name, model, arms, unit?, tenants?} -> 201 experiment;
    GET /admin/v1/experiments; GET /admin/v1/experiments/{name};
    POST /admin/v1/experiments/{name}/stop; GET /admin/v1/experiments/{name}/results."""
    router = APIRouter(prefix="/admin/v1", route_class=_admin_route_class(admin))

    @router.post("/experiments", status_code=201)
    async def create(body: ExperimentCreate) -> dict[str, Any]:
        exp = await registry.create(body.name, body.model, body.arms, unit=body.unit, tenants=body.tenants)
        return exp.to_dict()

    @router.get("/experiments")
    async def list_experiments() -> dict[str, Any]:
        return {"object": "list", "data": [e.to_dict() for e in await registry.list()]}

    @router.get("/experiments/{name}")
    async def get(name: str) -> dict[str, Any]:
        return (await registry.get(name)).to_dict()

    @router.post("/experiments/{name}/stop")
    async def stop(name: str) -> dict[str, Any]:
        return (await registry.stop(name)).to_dict()

    @router.get("/experiments/{name}/results")
    async def results(name: str) -> dict[str, Any]:
        return await recorder.results(name)

    return router


def _tenant_route_class(authenticator: Authenticator) -> type[APIRoute]:
    class TenantRoute(APIRoute):
        """Authenticates the API key before FastAPI reads the body or runs the endpoint."""

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def checked(request: Request) -> Response:
                principal = await authenticator.authenticate(request.headers.get("authorization"))
                request.state.principal = principal
                return await handler(request)

            return checked

    return TenantRoute


def feedback_router(recorder: ExperimentRecorder, authenticator: Authenticator) -> APIRouter:
    """POST /v1/feedback {request_id, rating} with the tenant's API key: rates one of the tenant's
    own recorded requests -> {"request_id", "experiment", "arm", "rating"}."""
    router = APIRouter(route_class=_tenant_route_class(authenticator))

    @router.post("/v1/feedback")
    async def feedback(request: Request, body: FeedbackBody) -> dict[str, Any]:
        principal = request.state.principal
        return await recorder.feedback(principal.tenant.name, body.request_id, body.rating)

    return router

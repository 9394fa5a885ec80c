"""The control plane's REST API (FastAPI; the OpenAPI document is served at /openapi.json).

Every route but /health/* needs the admin key (`Authorization: Bearer ...`). Under /v1/ the key
is checked before anything reads the request body, so a caller without it gets 401 whatever it
sends (no validation errors, no body read); a body over `max_body_bytes` (1 MiB by default) is
then a 413 before it is parsed. Errors are `{"error": {"message", "type", "param", "code"}}` with
the status of the `ControlError` raised (400 bad input, 401 no key, 404 unknown, 409 conflict,
413 body too large, 503 store down).

    POST   /v1/deployments                      register (model_id, version) -> package
    GET    /v1/deployments[?model_id=]          list (fingerprint, state, desired per region)
    GET    /v1/deployments/{model}/{version}
    PATCH  /v1/deployments/{model}/{version}    replicas, bounds, autoscale, no_gc
    DELETE /v1/deployments/{model}/{version}    mark deleted; 409 while it is current, mid-rollout,
                                                or still has desired or live replicas (PATCH
                                                replicas 0 first and wait for them to drain)
    PUT    /v1/models/{model}/current           versioned: the version the bare alias follows
    POST   /v1/models/{model}/wake              demand for a model scaled to zero (gateways call
                                                it while they hold its requests): 0 -> N now;
                                                idempotent
    POST   /v1/rollouts                         start: first deploy, red_black or versioned
    GET    /v1/rollouts[?model_id=&status=]     list; GET /v1/rollouts/{id}
    POST   /v1/rollouts/{id}/abort              roll back (at the next step)
    GET    /v1/replicas[?model_id=]             what runs, with health
    GET    /v1/audit[?model_id=&rollout_id=&after_id=]  model_id: also the fleet-wide events
    POST   /v1/gc                               garbage-collect inactive versioned deployments
    GET    /v1/routes?after=N                   the routes the gateway follows (long-poll)
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from paved.control_plane import gc as gc_mod
from paved.control_plane import rollout as rollout_mod
from paved.control_plane.controller import Controller
from paved.control_plane.errors import BadRequest, Conflict, ControlError, NotFound
from paved.control_plane.fingerprint import fingerprint_package
from paved.control_plane.routes_feed import RoutesFeed, routes_api
from paved.control_plane.store import ControlStore
from paved.control_plane.types import AutoscalePolicy, Deployment, DeploymentSpec
from paved.engine.sim_config import SimConfig
from paved.gateway.errors import GatewayError
from paved.http.body_limit import BodyLimitMiddleware
from paved.http.errors import error_body, validation_message
from paved.launcher.storage import Downloader, TransferConfig, make_s3_client

_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# A rollout id as the store makes them ("ro_" + hex). Checked before any query: PostgreSQL
# refuses a NUL in a text parameter (a DataError, so a 500), which a path or query may carry.
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# Admin bodies are small JSON documents (a deployment spec, a patch, rollout params); 1 MiB is
# far above any real one and keeps a client from making the control plane hold a huge upload.
DEFAULT_MAX_BODY_BYTES = 1024 * 1024


class _AdminGate:
    """Checks the admin key of every /v1/ request before the body limit or FastAPI reads the
    body: an unauthenticated caller learns nothing from its body (not whether it is valid, nor
    too large), and a large one is answered without being read. The routes check it again
    (they are also mounted where this gate is not, in tests)."""

    def __init__(self, app: ASGIApp, check_admin: Any):
        self.app = app
        self.check_admin = check_admin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            authorization = None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    authorization = value.decode("latin-1")
                    break
            try:
                self.check_admin(authorization)
            except GatewayError as e:
                response = JSONResponse(
                    error_body(e.status, e.message, None, e.code), e.status, headers=e.headers or None
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class AutoscaleBody(_Model):
    enabled: bool = False
    target_waiting: float = Field(2.0, gt=0)
    target_kv_usage: float = Field(0.8, gt=0, le=1)
    target_in_flight: float = Field(8.0, gt=0)
    stable_window_s: float = Field(60.0, gt=0, le=3600)
    panic_window_s: float = Field(6.0, gt=0, le=600)
    panic_threshold: float = Field(2.0, ge=1)
    scale_down_delay_s: float = Field(30.0, gt=0, le=3600)
    interval_s: float = Field(2.0, gt=0, le=60)
    # Scale to zero after this long without demand (needs enabled and min_replicas 0).
    scale_to_zero_after_s: float | None = Field(None, gt=0, le=7 * 86400)


class DeploymentBody(_Model):
    model_id: str = Field(pattern=_NAME)
    version: str = Field(pattern=_NAME)
    package_uri: str = Field(min_length=1, max_length=2048)
    strategy: Literal["red_black", "versioned"] = "red_black"
    replicas: int = Field(1, ge=0, le=256)
    min_replicas: int = Field(1, ge=0, le=256)
    max_replicas: int = Field(4, ge=1, le=256)
    regions: list[str] = Field(default_factory=lambda: ["local"], min_length=1, max_length=32)
    engine: str = Field("package", max_length=1024)
    autoscale: AutoscaleBody = Field(default_factory=lambda: AutoscaleBody.model_validate({}))
    no_gc: bool = False
    # Gateway route options for the alias (store.ROUTE_OPTIONS), e.g. {"cache": {"exact": true}}.
    route: dict[str, Any] = Field(default_factory=dict)
    # Cluster drivers: {"node_selector": {...}, "tolerations": [...]} (store.validate_placement).
    placement: dict[str, Any] = Field(default_factory=dict)


class DeploymentPatch(_Model):
    replicas: int | None = Field(None, ge=0, le=256)
    min_replicas: int | None = Field(None, ge=0, le=256)
    max_replicas: int | None = Field(None, ge=1, le=256)
    autoscale: AutoscaleBody | None = None
    no_gc: bool | None = None
    route: dict[str, Any] | None = None  # replaces the route options whole ({}: none)


class CurrentBody(_Model):
    version: str = Field(pattern=_NAME)


class RolloutBody(_Model):
    model_id: str = Field(pattern=_NAME)
    version: str = Field(pattern=_NAME)
    params: dict[str, Any] = Field(default_factory=dict)


class GcBody(_Model):
    retain_s_since_created: float | None = Field(None, ge=0)
    retain_s_since_traffic: float | None = Field(None, ge=0)
    min_kept: int = Field(2, ge=1, le=1000)
    dry_run: bool = False


def deployment_view(d: Deployment, desired: dict[str, int] | None = None) -> dict[str, Any]:
    spec = d.spec
    return {
        "id": d.id,
        "model_id": spec.model_id,
        "version": spec.version,
        "package_uri": spec.package_uri,
        "strategy": spec.strategy,
        "replicas": spec.replicas,
        "min_replicas": spec.min_replicas,
        "max_replicas": spec.max_replicas,
        "regions": list(spec.regions),
        "engine": spec.engine,
        "autoscale": vars(spec.autoscale),
        "no_gc": spec.no_gc,
        "route": spec.route,
        "placement": spec.placement,
        "state": d.state,
        "current": d.current,
        "fingerprint": d.fingerprint,
        "created_at": d.created_at.isoformat(),
        "last_traffic_at": d.last_traffic_at.isoformat() if d.last_traffic_at else None,
        "desired": desired or {},
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def rollout_view(record: Any) -> dict[str, Any]:
    return _jsonable({k: getattr(record, k) for k in record.__dataclass_fields__})


def _package_reader(s3_endpoint_url: str | None) -> Downloader:
    if s3_endpoint_url is None:
        return Downloader()
    config = TransferConfig()
    return Downloader(config, lambda: make_s3_client(s3_endpoint_url, config=config))


def create_app(
    store: ControlStore,
    controller: Controller,
    feed: RoutesFeed,
    check_admin: Any,
    *,
    leader: Any = None,
    extra_routers: list[APIRouter] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    s3_endpoint_url: str | None = None,
) -> FastAPI:
    """`s3_endpoint_url`: where s3:// packages are read from when deployments are registered
    (the control plane's --s3-endpoint-url, as its replicas read them; else boto3's
    environment)."""
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError("max_body_bytes must be a positive integer")
    app = FastAPI(title="paved control plane", version="1")
    # Added last is outermost: the key check runs before the size check reads anything.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(_AdminGate, check_admin=check_admin)
    api = APIRouter(prefix="/v1")

    def auth(request: Request) -> None:
        try:
            check_admin(request.headers.get("authorization"))
        except GatewayError as e:  # the gateway's AdminAuth: the same 401 here
            raise ControlError(e.status, e.message, code=e.code, headers=e.headers) from None

    async def _rollout(rollout_id: str) -> Any:
        record = await store.get_rollout(rollout_id) if _ROLLOUT_ID.fullmatch(rollout_id) else None
        if record is None:
            raise NotFound(f"no rollout {rollout_id[:80]!r}", code="rollout_not_found")
        return record

    async def _deployment(model: str, version: str) -> Deployment:
        d = await store.get_deployment(model, version)
        if d is None or d.state == "deleted":
            raise NotFound(f"no deployment {model}@{version}", code="deployment_not_found")
        return d

    @api.post("/deployments", status_code=201)
    async def create_deployment(body: DeploymentBody, request: Request) -> dict[str, Any]:
        auth(request)
        if not body.min_replicas <= body.replicas <= body.max_replicas:
            raise BadRequest("replicas must be within [min_replicas, max_replicas]")
        unknown = [r for r in body.regions if r not in controller.drivers]
        if unknown:
            raise BadRequest(
                f"unknown region(s) {unknown}; this control plane has {sorted(controller.drivers)}"
            )
        for field, value, code in (
            ("package_uri", body.package_uri, "bad_package"),
            ("engine", body.engine, "bad_engine"),
        ):
            # Both reach a replica's command line (a NUL cannot be in an argument: the driver
            # failed every reconcile pass on it) and its logs: a URI has no control characters.
            if not value.isprintable():
                raise BadRequest(f"{field} must not contain control characters", code=code)
        if body.engine != "package" and not body.engine.startswith("sim://"):
            raise BadRequest("engine must be 'package' or a sim:// URI (the simulated engine)")
        if body.engine != "package":
            # The whole URI is checked here, not when a replica starts: a bad option used to pass
            # and fail every replica of the first rollout. (Only here: rows stored before keep
            # loading.) Replicas may run elsewhere, so a tokenizer directory is not looked for.
            try:
                SimConfig.from_uri(body.engine, model=body.model_id, check_files=False)
            except ValueError as e:
                raise BadRequest(f"engine: {e}", code="bad_engine") from None
        try:
            fingerprint = await _to_thread(
                lambda: fingerprint_package(body.package_uri, downloader=_package_reader(s3_endpoint_url))
            )
        except (OSError, ValueError) as e:
            raise BadRequest(
                f"package {body.package_uri!r} cannot be read: {e}", code="bad_package"
            ) from None
        if fingerprint.get("kind") == "kserve" and body.engine != "package":
            raise BadRequest(
                "a kserve package (a classic model) is served by paved.kserve, not an LLM engine: "
                "engine must be 'package'"
            )
        spec = DeploymentSpec(
            model_id=body.model_id,
            version=body.version,
            package_uri=body.package_uri,
            strategy=body.strategy,
            min_replicas=body.min_replicas,
            max_replicas=body.max_replicas,
            replicas=body.replicas,
            regions=tuple(body.regions),
            engine=body.engine,
            autoscale=AutoscalePolicy(**body.autoscale.model_dump()),
            no_gc=body.no_gc,
            route=body.route,
            placement=body.placement,
        )
        # Registered, not running: a rollout (or the first deploy) starts it. Inserted inactive
        # in one write: created active and then updated, a failed or interrupted update left it
        # active, and the controller started its replicas with no rollout or health gate.
        d = await store.create_deployment(spec, fingerprint, state="inactive")
        await store.audit(
            "deployment.created",
            f"registered {spec.model_id}@{spec.version} ({spec.strategy}) from {spec.package_uri}",
            model_id=spec.model_id,
            version=spec.version,
            data={"fingerprint": fingerprint},
        )
        d = await _deployment(spec.model_id, spec.version)
        return deployment_view(d)

    @api.get("/deployments")
    async def list_deployments(request: Request, model_id: str | None = None) -> dict[str, Any]:
        auth(request)
        data = []
        for d in await store.list_deployments(model_id=model_id):
            data.append(deployment_view(d, await store.get_desired(d.id)))
        return {"object": "list", "data": data}

    @api.get("/deployments/{model}/{version}")
    async def get_deployment(model: str, version: str, request: Request) -> dict[str, Any]:
        auth(request)
        d = await _deployment(model, version)
        return deployment_view(d, await store.get_desired(d.id))

    @api.patch("/deployments/{model}/{version}")
    async def patch_deployment(
        model: str, version: str, body: DeploymentPatch, request: Request
    ) -> dict[str, Any]:
        auth(request)
        d = await _deployment(model, version)
        if body.replicas is not None:
            # A rollout sets both versions' counts phase by phase (and restores them on abort):
            # a count set beside it would disagree with its weights (traffic weighted to a version
            # scaled to 0), as the autoscaler also stays out while one runs.
            running = await store.list_rollouts(model_id=model, status="running")
            if running:
                raise Conflict(
                    f"{model} has a running rollout ({running[0].id}); scale it once the rollout ends",
                    code="rollout_running",
                )
        autoscale = AutoscalePolicy(**body.autoscale.model_dump()) if body.autoscale is not None else None
        d = await store.update_deployment(
            d.id,
            replicas=body.replicas,
            min_replicas=body.min_replicas,
            max_replicas=body.max_replicas,
            autoscale=autoscale,
            no_gc=body.no_gc,
            route=body.route,
        )
        if body.replicas is not None and d.state == "active":
            for region in d.spec.regions:
                await controller.scale(d.id, region, body.replicas)
            await store.audit(
                "scale",
                f"{model}@{version} scaled to {body.replicas} replicas per region by the API",
                model_id=model,
                version=version,
            )
        controller.poke()
        return deployment_view(d, await store.get_desired(d.id))

    @api.delete("/deployments/{model}/{version}")
    async def delete_deployment(model: str, version: str, request: Request) -> dict[str, Any]:
        auth(request)
        d = await _deployment(model, version)
        if d.current:
            raise Conflict(f"{model}@{version} is the current version; move current first")
        running = await store.list_rollouts(model_id=model, status="running")
        if running:
            raise Conflict(f"{model} has a running rollout ({running[0].id})")
        # Deleting a deployment that still serves would take its model away from every caller
        # at once: the user scales it to 0 first (which drains, out of the routes first), as GC
        # only ever deletes deployments that are no longer active.
        desired, live = await controller.replicas_of(d)
        if any(desired.values()) or live:
            raise Conflict(
                f"{model}@{version} still has replicas (desired per region {desired}, "
                f"{len(live)} running); scale it to 0 first "
                f'(PATCH /v1/deployments/{model}/{version} {{"min_replicas": 0, "replicas": 0}}), '
                "then delete it once they have drained",
                code="deployment_has_replicas",
            )
        await controller.deactivate(d.id)
        await store.delete_deployment(d.id)
        await store.audit("deployment.deleted", f"deleted {model}@{version}", model_id=model, version=version)
        # A replica started between the check and the delete is drained by the next pass.
        controller.poke()
        return {"deleted": d.id}

    @api.put("/models/{model}/current")
    async def set_current(model: str, body: CurrentBody, request: Request) -> dict[str, Any]:
        auth(request)
        d = await _deployment(model, body.version)
        if d.spec.strategy != "versioned":
            raise BadRequest(
                f"{model}@{body.version} is red_black: its alias follows its rollouts, not 'current'"
            )
        if d.state != "active":
            raise Conflict(f"{model}@{body.version} is not serving (state {d.state}); roll it out first")
        await store.set_current(model, body.version)
        await store.audit(
            "current", f"{model} now follows version {body.version}", model_id=model, version=body.version
        )
        if leader is None or (leader.is_leader and controller.running):
            await controller.publish_routes()
        # A follower's controller (or a leader's not started yet) holds no rollout weights: it
        # would publish a table without them; the leader's next pass publishes the new current.
        return deployment_view(await _deployment(model, body.version))

    @api.post("/models/{model}/wake")
    async def wake(model: str, request: Request) -> dict[str, Any]:
        """A gateway holds requests for `model`: scale its deployments that sleep at zero to
        max(1, min_replicas) now (Controller.wake). Idempotent; 404 for an unknown model."""
        auth(request)
        if not re.fullmatch(_NAME, model):
            raise BadRequest(f"model must match {_NAME}", code="invalid_model")
        return await controller.wake(model)

    @api.post("/rollouts", status_code=201)
    async def start_rollout(body: RolloutBody, request: Request) -> dict[str, Any]:
        auth(request)
        target = await _deployment(body.model_id, body.version)
        try:
            params = rollout_mod.RolloutParams.from_dict(body.params)
        except ControlError:
            raise
        except (TypeError, ValueError) as e:
            raise BadRequest(f"params: {e}") from None
        active = [
            d
            for d in await store.list_deployments(model_id=body.model_id)
            if d.state == "active" and d.id != target.id
        ]
        if target.state == "active":
            raise Conflict(f"{body.model_id}@{body.version} is already serving")
        source = None
        if target.spec.strategy == "red_black" and active:
            source = max(active, key=lambda d: d.created_at)
            rollout_mod.check_fingerprint(source.fingerprint, target.fingerprint, params.force)
            if params.waves:
                mismatch = rollout_mod.waves_mismatch(params.waves, target.spec.regions)
                if mismatch is not None:
                    raise BadRequest(mismatch)
        record = await store.create_rollout(
            body.model_id,
            source.spec.version if source is not None else None,
            body.version,
            target.spec.strategy,
            params.to_dict(),
        )
        await store.audit(
            "rollout.created",
            f"rollout {record.id}: {body.model_id} "
            f"{source.spec.version if source else '(none)'} -> {body.version} ({target.spec.strategy})",
            model_id=body.model_id,
            version=body.version,
            rollout_id=record.id,
            data={"params": params.to_dict()},
        )
        controller.poke()
        return rollout_view(record)

    @api.get("/rollouts")
    async def list_rollouts(
        request: Request,
        model_id: str | None = None,
        status: str | None = None,
        after: str | None = None,
        limit: int = 1000,
    ) -> dict[str, Any]:
        """Oldest first, a page at a time: `after` the last id of the page before (has_more)."""
        auth(request)
        if not 1 <= limit <= 1000:
            raise BadRequest("limit must be 1..1000")
        if after is not None and not _ROLLOUT_ID.fullmatch(after):
            raise BadRequest(f"after must match {_ROLLOUT_ID.pattern}", code="invalid_rollout_id")
        page = await store.list_rollouts(model_id=model_id, status=status, after=after, limit=limit + 1)
        data = [rollout_view(r) for r in page[:limit]]
        return {
            "object": "list", "data": data, "has_more": len(page) > limit,
            "last_id": data[-1]["id"] if data else None,
        }  # fmt: skip

    @api.get("/rollouts/{rollout_id}")
    async def get_rollout(rollout_id: str, request: Request) -> dict[str, Any]:
        auth(request)
        record = await _rollout(rollout_id)
        return rollout_view(record)

    @api.post("/rollouts/{rollout_id}/abort")
    async def abort_rollout(rollout_id: str, request: Request) -> dict[str, Any]:
        auth(request)
        record = await _rollout(rollout_id)
        record = await rollout_mod.request_abort(store, record, reason="aborted through the API")
        controller.poke()
        return rollout_view(record)

    @api.get("/replicas")
    async def list_replicas(request: Request, model_id: str | None = None) -> dict[str, Any]:
        auth(request)
        deployments = {d.id: d for d in await store.list_deployments(include_deleted=True)}
        data = []
        for r in await store.list_replicas():
            d = deployments.get(r.deployment_id)
            if d is None or (model_id and d.spec.model_id != model_id):
                continue
            data.append(
                {
                    "id": r.id,
                    "model_id": d.spec.model_id,
                    "version": d.spec.version,
                    "region": r.region,
                    "state": r.state,
                    "url": r.url,
                    "admin_url": r.admin_url,
                    "kserve_grpc": r.kserve_grpc,
                    "kserve_http": r.kserve_http,
                    "metrics_url": r.metrics_url,
                    "reason": r.reason,
                }
            )
        return {"object": "list", "data": data}

    @api.get("/audit")
    async def audit(
        request: Request,
        model_id: str | None = None,
        rollout_id: str | None = None,
        after_id: int | None = None,
        limit: int = 200,
    ) -> dict[str, Any]:
        auth(request)
        if not 1 <= limit <= 1000:
            raise BadRequest("limit must be 1..1000")
        if rollout_id is not None and not _ROLLOUT_ID.fullmatch(rollout_id):
            raise BadRequest(f"rollout_id must match {_ROLLOUT_ID.pattern}", code="invalid_rollout_id")
        events = await store.list_audit(
            model_id=model_id, rollout_id=rollout_id, after_id=after_id, limit=limit
        )
        return {"object": "list", "data": [_jsonable(vars(e)) for e in events]}

    @api.post("/gc")
    async def gc(body: GcBody, request: Request) -> dict[str, Any]:
        auth(request)
        if body.retain_s_since_traffic is not None and not controller.analyzer.configured:
            # Traffic is never recorded without the gateways' metrics: every deployment would
            # read as idle since its creation, and versions serving pinned traffic would go.
            raise BadRequest(
                "retain_s_since_traffic needs the gateways' metrics (--gateway-metrics or "
                "--metrics-source): without them no deployment's traffic is known",
                code="traffic_unknown",
            )
        policy = gc_mod.GcPolicy(
            retain_s_since_created=body.retain_s_since_created,
            retain_s_since_traffic=body.retain_s_since_traffic,
            min_kept=body.min_kept,
        )
        protected = set()
        for r in await store.list_rollouts(status="running"):
            for version in (r.from_version, r.to_version):
                d = await store.get_deployment(r.model_id, version) if version else None
                if d is not None:
                    protected.add(d.id)
        candidates = gc_mod.gc_candidates(
            await store.list_deployments(), policy, datetime.now(UTC), protected=protected
        )
        removed = []
        for d, reason in candidates:
            removed.append({"model_id": d.spec.model_id, "version": d.spec.version, "reason": reason})
            if not body.dry_run:
                await controller.deactivate(d.id)
                await store.delete_deployment(d.id)
                await store.audit(
                    "gc", f"garbage-collected {d.spec.model_id}@{d.spec.version}: {reason}",
                    model_id=d.spec.model_id, version=d.spec.version,
                )  # fmt: skip
        return {"dry_run": body.dry_run, "removed": removed}

    @app.get("/health/live")
    async def live() -> dict[str, str]:
        return {"status": "live"}

    @app.get("/health/ready")
    async def ready(request: Request) -> JSONResponse:
        is_leader = True if leader is None else leader.is_leader
        body: dict[str, Any] = {
            "status": "ready", "leader": is_leader, "controller_ok": controller.last_error is None
        }  # fmt: skip
        # Probes read this without a key; the controller's error names deployments, engine URIs
        # and database hosts, so only the admin sees it (as on the dashboard).
        try:
            check_admin(request.headers.get("authorization"))
        except (GatewayError, ControlError):
            return JSONResponse(body)
        return JSONResponse({**body, "last_error": controller.last_error})

    app.include_router(api)
    app.include_router(routes_api(feed, check_admin))
    for router in extra_routers or ():
        app.include_router(router)

    @app.exception_handler(ControlError)
    async def _control(_: Request, exc: ControlError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.status, exc.message, None, exc.code), exc.status, headers=exc.headers or None
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return JSONResponse(error_body(400, message, param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code)

    return app


async def _to_thread(fn: Any, *args: Any) -> Any:
    import asyncio

    return await asyncio.to_thread(fn, *args)

"""The control plane's dashboard: a static page at /dashboard and the one JSON summary it polls.

    GET /dashboard                      the HTML shell (no data in it, so no key needed)
    GET /dashboard/static/{name}        its CSS and JS (a fixed list of files; nothing else)
    GET /dashboard/api/summary          everything the page shows, behind the admin key

Invariants:
- Every byte of fleet data is behind the admin key: the shell and its assets are the same for
  everyone; the summary answers 401 without `Authorization: Bearer <admin key>`. Actions are the
  page calling the existing /v1 endpoints with the same key (no second way to change the fleet).
- The page is self-contained: no CDN, no external URL, no inline script (the CSP says
  `default-src 'self'`), charts drawn by its own JS.
- A summary is bounded work: at most one scrape per ready replica and per gateway, each with a
  deadline, shared by concurrent polls for `GAUGE_TTL_S`; the audit is read incrementally (new
  ids only, a bounded number of pages per call) into a fixed-size tail.
- A replica or gateway that cannot be read is reported with its error, never a failed summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from pathlib import Path
from typing import Any

import aiohttp
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse
from prometheus_client.parser import text_string_to_metric_families

from paved.control_plane.api import _jsonable, deployment_view, rollout_view
from paved.control_plane.controller import Controller
from paved.control_plane.errors import ControlError
from paved.control_plane.prometheus import graph_url
from paved.control_plane.store import ControlStore
from paved.gateway.errors import GatewayError
from paved.metrics.gauges import MAX_METRICS_BYTES, ScrapeError, scrape

ASSETS = Path(__file__).resolve().parent / "dashboard"
# name -> media type: the only files served (a closed list, so no path ever reaches the disk).
STATIC = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
AUDIT_TAIL = 300  # events kept for the page
AUDIT_PAGE = 1000  # the store's page limit
AUDIT_PAGES_PER_CALL = 20  # a huge backlog is read over several polls, not in one
ROLLOUTS_SHOWN = 20
GAUGE_TTL_S = 1.0  # polls within this share one scrape of each replica
SCRAPE_TIMEOUT_S = 1.5
_CACHE_HITS = ("exact", "semantic")


class _AuditTail:
    """The newest AUDIT_TAIL events, read forward from the last id seen."""

    def __init__(self) -> None:
        self.events: deque[dict[str, Any]] = deque(maxlen=AUDIT_TAIL)
        self.last_id: int | None = None
        self.lock = asyncio.Lock()

    async def refresh(self, store: ControlStore) -> list[dict[str, Any]]:
        async with self.lock:
            for _ in range(AUDIT_PAGES_PER_CALL):
                page = await store.list_audit(after_id=self.last_id, limit=AUDIT_PAGE)
                for e in page:
                    self.events.append(_jsonable(vars(e)))
                if page:
                    self.last_id = page[-1].id
                if len(page) < AUDIT_PAGE:
                    break
            return list(self.events)


def parse_gateway_usage(text: str) -> dict[str, Any]:
    """Per-tenant answers (by status class), cache lookups by result, the flow-control queue per
    model and tenant (waiting now; total wait and dispatches) and the requests held per model
    at zero from one gateway's Prometheus text."""
    tenants: dict[str, dict[str, float]] = {}
    cache: dict[str, float] = {}
    queue: dict[str, dict[str, dict[str, float]]] = {}
    held: dict[str, float] = {}

    def queued(s: Any) -> dict[str, float]:
        by_tenant = queue.setdefault(s.labels.get("model", ""), {})
        return by_tenant.setdefault(s.labels.get("tenant", ""), {"waiting": 0.0, "wait_s": 0.0, "waits": 0.0})

    for family in text_string_to_metric_families(text):
        if family.name == "paved_gateway_requests":
            for s in family.samples:
                if s.name.endswith("_total"):
                    t = tenants.setdefault(s.labels.get("tenant", ""), {"requests": 0.0, "errors": 0.0})
                    t["requests"] += s.value
                    if s.labels.get("status", "").startswith("5"):
                        t["errors"] += s.value
        elif family.name == "paved_gateway_cache_lookups":
            for s in family.samples:
                if s.name.endswith("_total"):
                    result = s.labels.get("result", "")
                    cache[result] = cache.get(result, 0.0) + s.value
        elif family.name == "paved_gateway_queue_depth":
            for s in family.samples:
                queued(s)["waiting"] += s.value
        elif family.name == "paved_gateway_held_requests":
            for s in family.samples:
                model = s.labels.get("model", "")
                held[model] = held.get(model, 0.0) + s.value
        elif family.name == "paved_gateway_queue_wait_seconds":
            for s in family.samples:
                if s.name.endswith("_sum"):
                    queued(s)["wait_s"] += s.value
                elif s.name.endswith("_count"):
                    queued(s)["waits"] += s.value
    return {"tenants": tenants, "cache": cache, "queue": queue, "held": held}


def _merge_usage(parts: list[dict[str, Any]]) -> dict[str, Any]:
    tenants: dict[str, dict[str, float]] = {}
    cache: dict[str, float] = {}
    queue: dict[tuple[str, str], dict[str, float]] = {}
    held: dict[str, float] = {}
    for part in parts:
        for model, n in part.get("held", {}).items():
            held[model] = held.get(model, 0.0) + n
        for name, t in part["tenants"].items():
            into = tenants.setdefault(name, {"requests": 0.0, "errors": 0.0})
            into["requests"] += t["requests"]
            into["errors"] += t["errors"]
        for result, n in part["cache"].items():
            cache[result] = cache.get(result, 0.0) + n
        for model, by_tenant in part.get("queue", {}).items():
            for tenant, q in by_tenant.items():
                into_q = queue.setdefault((model, tenant), {"waiting": 0.0, "wait_s": 0.0, "waits": 0.0})
                for k, v in q.items():
                    into_q[k] += v
    hits = sum(cache.get(r, 0.0) for r in _CACHE_HITS)
    looked = hits + cache.get("miss", 0.0)  # bypassed requests never asked the cache
    return {
        "tenants": [{"tenant": k, **v} for k, v in sorted(tenants.items())],
        "cache": dict(sorted(cache.items())),
        "cache_hit_rate": hits / looked if looked else None,
        # Every gateway replica holds its own queue: waiting is their sum; the mean wait is over
        # every dispatch since the gateways started (0 for those that went straight through).
        "queue": [
            {
                "model": model,
                "tenant": tenant,
                "waiting": q["waiting"],
                "mean_wait_s": q["wait_s"] / q["waits"] if q["waits"] else None,
            }
            for (model, tenant), q in sorted(queue.items())
        ],
        # Requests every gateway holds for a model scaled to zero while it wakes.
        "held": dict(sorted(held.items())),
    }


def traffic_split(routes: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per alias and region: each version's backends, weight and share of the region's traffic
    (the gateway picks backends in proportion to their weights while a rollout splits); a model
    scaled to zero is one row with no versions and `zero` ("scaled_to_zero" or "waking")."""
    out = []
    for m in (routes or {}).get("models", []):
        if m.get("scaled_to_zero"):
            # No backend: one row saying so ("waking" once replicas were asked for).
            out.append(
                {
                    "alias": m["alias"],
                    "region": "",
                    "strategy": m.get("strategy"),
                    "current": None,
                    "versions": [],
                    "zero": "waking" if m.get("waking") else "scaled_to_zero",
                }
            )
            continue
        regions: dict[str, dict[str, dict[str, Any]]] = {}
        for b in m.get("backends", []):
            versions = regions.setdefault(b.get("region") or "", {})
            v = versions.setdefault(b["version"], {"version": b["version"], "backends": 0, "weight": 0.0})
            v["backends"] += 1
            v["weight"] += float(b.get("weight", 0.0))
        for region, versions in sorted(regions.items()):
            total = sum(v["weight"] for v in versions.values())
            rows = []
            for v in sorted(versions.values(), key=lambda v: v["version"]):
                rows.append({**v, "share": v["weight"] / total if total > 0 else 0.0})
            out.append(
                {
                    "alias": m["alias"],
                    "region": region,
                    "strategy": m.get("strategy"),
                    "current": m.get("current"),
                    "versions": rows,
                }
            )
    return out


def _graphs(prometheus_url: str | None, models: set[str]) -> dict[str, Any]:
    """{"url": Prometheus, "graphs": {model: its /graph link}}; {"url": None} without one."""
    if not prometheus_url:
        return {"url": None, "graphs": {}}
    graphs = {}
    for model in sorted(models):
        with contextlib.suppress(ValueError):  # ids are validated at registration; never here
            graphs[model] = graph_url(prometheus_url, model)
    return {"url": prometheus_url.rstrip("/"), "graphs": graphs}


def dashboard_router(
    store: ControlStore,
    controller: Controller,
    check_admin: Any,
    *,
    gateway_metrics: list[str] | tuple[str, ...] = (),
    prometheus_url: str | None = None,
) -> APIRouter:
    """`prometheus_url`: where paved's recorded series are (the control plane's
    --prometheus-url); the summary then carries a graphs link per model."""
    router = APIRouter()
    audit_tail = _AuditTail()
    gauges: dict[str, tuple[float, dict[str, Any]]] = {}  # replica id -> (at, gauges or error)
    gateways: dict[str, Any] = {"at": 0.0, "value": None}
    scrape_lock = asyncio.Lock()
    urls = list(gateway_metrics)

    def auth(request: Request) -> None:
        try:
            check_admin(request.headers.get("authorization"))
        except GatewayError as e:  # the gateway's AdminAuth: the same 401 as the /v1 API
            raise ControlError(e.status, e.message, code=e.code, headers=e.headers) from None

    def asset(name: str, media: str) -> FileResponse:
        return FileResponse(ASSETS / name, media_type=media, headers={**HEADERS})

    @router.get("/dashboard", include_in_schema=False)
    async def index() -> FileResponse:
        return asset("index.html", "text/html; charset=utf-8")

    @router.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str) -> FileResponse:
        if name not in STATIC:
            raise ControlError(404, f"no dashboard asset {name!r}", code="not_found")
        return asset(name, STATIC[name])

    async def replica_gauges(replica: Any, model_id: str, now: float) -> dict[str, Any]:
        cached = gauges.get(replica.id)
        if cached is not None and now - cached[0] < GAUGE_TTL_S:
            return cached[1]
        try:
            m = await scrape(replica.metrics_url, model_id=model_id, timeout_s=SCRAPE_TIMEOUT_S)
            value: dict[str, Any] = {"waiting": m.waiting, "running": m.running, "kv_usage": m.kv_usage}
        except (ScrapeError, ValueError) as e:
            value = {"error": str(e)[:300]}
        gauges[replica.id] = (now, value)
        return value

    async def one_gateway(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
        try:
            async with session.get(url) as response:
                if response.status != 200:
                    return {"url": url, "error": f"HTTP {response.status}"}
                body = await response.content.read(MAX_METRICS_BYTES + 1)
            if len(body) > MAX_METRICS_BYTES:
                return {"url": url, "error": "metrics too large"}
            return {"url": url, **parse_gateway_usage(body.decode("utf-8", errors="replace"))}
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            return {"url": url, "error": f"{type(e).__name__}: {e}"[:300]}

    async def gateway_usage(now: float) -> dict[str, Any]:
        if not urls:
            return {"configured": False, "message": "no gateway metrics configured (--gateway-metrics)"}
        if gateways["value"] is not None and now - gateways["at"] < GAUGE_TTL_S:
            return gateways["value"]
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            parts = await asyncio.gather(*(one_gateway(session, u) for u in urls))
        ok = [p for p in parts if "error" not in p]
        value = {
            "configured": True,
            "urls": urls,
            "errors": [{"url": p["url"], "error": p["error"]} for p in parts if "error" in p],
            **_merge_usage(ok),
        }
        gateways.update(at=now, value=value)
        return value

    @router.get("/dashboard/api/summary", include_in_schema=False)
    async def summary(request: Request) -> JSONResponse:
        auth(request)
        now = time.monotonic()
        deployments = await store.list_deployments()
        by_id = {d.id: d for d in await store.list_deployments(include_deleted=True)}
        replicas = await store.list_replicas()
        async with scrape_lock:  # concurrent polls share one scrape of each replica
            ready = [r for r in replicas if r.state == "ready" and r.metrics_url and r.deployment_id in by_id]
            read = await asyncio.gather(
                *(replica_gauges(r, by_id[r.deployment_id].spec.model_id, now) for r in ready)
            )
            usage = await gateway_usage(now)
        live = {r.id for r in replicas}
        for stale in set(gauges) - live:
            del gauges[stale]
        read_by_id = {r.id: g for r, g in zip(ready, read, strict=True)}
        replica_rows = []
        for r in replicas:
            d = by_id.get(r.deployment_id)
            if d is None or r.state == "stopped":
                continue
            replica_rows.append(
                {
                    "id": r.id,
                    "model_id": d.spec.model_id,
                    "version": d.spec.version,
                    "region": r.region,
                    "state": r.state,
                    "url": r.url,
                    "reason": r.reason,
                    "gauges": read_by_id.get(r.id),
                }
            )
        rollouts = sorted(await store.list_rollouts(), key=lambda r: r.created_at, reverse=True)
        latest = await store.latest_routes()
        audit = await audit_tail.refresh(store)
        body = {
            "regions": sorted(controller.drivers),
            "controller_error": controller.last_error,
            "deployments": [deployment_view(d, await store.get_desired(d.id)) for d in deployments],
            "replicas": replica_rows,
            "rollouts": [rollout_view(r) for r in rollouts[:ROLLOUTS_SHOWN]],
            "routes_revision": latest[0] if latest else None,
            "traffic": traffic_split(latest[1] if latest else None),
            "audit": audit,
            "autoscale": [e for e in audit if e["kind"] == "autoscale"][-20:],
            "gateway": usage,
            "prometheus": _graphs(prometheus_url, {d.spec.model_id for d in deployments}),
        }
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    return router

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
- Batches come from each gateway's read-only `GET /admin/v1/batches` (paved.gateway.batches.admin),
  called with the gateways' admin key, which is sent nowhere else and never logged nor shown
  (an error names the URL and the HTTP status only). At most BATCHES_SHOWN per gateway, a bounded
  body, one call per gateway per BATCHES_TTL_S; gateways sharing one database list the same
  batches, which the summary shows once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import urllib.parse
from collections import deque
from pathlib import Path
from typing import Any

import aiohttp
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse
from prometheus_client.parser import text_string_to_metric_families

from paved.bodies import read_at_most
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
BATCHES_SHOWN = 50  # per gateway and in the summary, newest first
BATCHES_TTL_S = 2.0  # polls within this share one listing per gateway (each is a few SQL queries)
MAX_BATCHES_BYTES = 1 << 20  # a listing of BATCHES_SHOWN rows is a few tens of KiB


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


def gateway_origin(url: str) -> str:
    """`scheme://host[:port]` of a gateway URL (its admin API is at that origin's /admin/v1;
    a path or query, as a --gateway-metrics URL has, is dropped); ValueError unless `url` is
    http(s)://HOST[:PORT][...]."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"gateway URL {url!r:.200}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"gateway URL {url!r:.200}: expected http(s)://HOST:PORT")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a request count must be a non-negative integer, not {value!r:.40}")
    return value


def _seconds(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"a time must be a number, not {value!r:.40}")
    return float(value)


def _text(value: Any, most: int = 256) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, not {value!r:.40}")
    return value[:most]


def parse_gateway_batches(body: Any) -> list[dict[str, Any]]:
    """The rows of one gateway's `GET /admin/v1/batches` answer, each with its progress:
    `done` = (completed + failed) / total (1.0 for an empty batch), `completed_share` and
    `failed_share` the two parts of it (what the page's bar draws). ValueError on any other shape
    (the gateway is then reported with that error)."""
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise ValueError("not a list of batches")
    rows = []
    for b in body["data"][:BATCHES_SHOWN]:
        if not isinstance(b, dict) or not isinstance(b.get("request_counts"), dict):
            raise ValueError("a batch without request_counts")
        counts = b["request_counts"]
        total, completed, failed = (_count(counts.get(k)) for k in ("total", "completed", "failed"))
        settled = min(total, completed + failed)
        rows.append(
            {
                "id": _text(b.get("id"), 64),
                "tenant": _text(b.get("tenant"), 63),
                "model": _text(b.get("model")),
                "endpoint": _text(b.get("endpoint"), 64),
                "status": _text(b.get("status"), 16),
                "total": total,
                "completed": completed,
                "failed": failed,
                "done": settled / total if total else 1.0,
                "completed_share": min(completed, total) / total if total else 0.0,
                "failed_share": (settled - min(completed, total)) / total if total else 0.0,
                "created_at": _seconds(b.get("created_at")),
                "finished_at": _seconds(b.get("finished_at")),
                "age_s": _seconds(b.get("age_s")),
            }
        )
    return rows


def merge_batches(parts: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every gateway's batches once (gateways sharing a database list the same ones: the row
    read with the most lines settled is kept), newest first, at most BATCHES_SHOWN."""
    by_id: dict[str, dict[str, Any]] = {}
    for rows in parts:
        for r in rows:
            seen = by_id.get(r["id"])
            if seen is None or r["completed"] + r["failed"] > seen["completed"] + seen["failed"]:
                by_id[r["id"]] = r
    newest = sorted(by_id.values(), key=lambda r: (r["created_at"] or 0.0, r["id"]), reverse=True)
    return newest[:BATCHES_SHOWN]


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
    gateway_admin: list[str] | tuple[str, ...] = (),
    gateway_admin_key: str | None = None,
) -> APIRouter:
    """`prometheus_url`: where paved's recorded series are (the control plane's
    --prometheus-url); the summary then carries a graphs link per model. `gateway_admin`: the
    gateways' origins (gateway_origin) whose batches the summary lists, read with
    `gateway_admin_key`; no batches without both."""
    router = APIRouter()
    audit_tail = _AuditTail()
    gauges: dict[str, tuple[float, dict[str, Any]]] = {}  # replica id -> (at, gauges or error)
    gateways: dict[str, Any] = {"at": 0.0, "value": None}
    scrape_lock = asyncio.Lock()
    urls = list(gateway_metrics)
    admin_urls = [gateway_origin(u) for u in gateway_admin] if gateway_admin_key else []
    listed: dict[str, Any] = {"at": 0.0, "value": None}

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
                body = await read_at_most(response.content, MAX_METRICS_BYTES + 1)
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

    async def one_listing(session: aiohttp.ClientSession, origin: str) -> dict[str, Any]:
        url = f"{origin}/admin/v1/batches"
        try:
            async with session.get(
                url,
                params={"limit": str(BATCHES_SHOWN)},
                headers={"Authorization": f"Bearer {gateway_admin_key}"},
                allow_redirects=False,  # the key goes to the named gateway, nowhere it points
            ) as response:
                if response.status != 200:
                    # Only the status: the body of a refusal is the gateway's, never the key.
                    return {"url": url, "error": f"HTTP {response.status}"}
                body = await read_at_most(response.content, MAX_BATCHES_BYTES + 1)
            if len(body) > MAX_BATCHES_BYTES:
                return {"url": url, "error": "batch listing too large"}
            return {"url": url, "batches": parse_gateway_batches(json.loads(body))}
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:  # JSONDecodeError is a ValueError
            return {"url": url, "error": f"{type(e).__name__}: {e}"[:300]}

    async def gateway_batches(now: float) -> dict[str, Any]:
        if not admin_urls:
            return {
                "configured": False,
                "message": "no gateway admin API configured (--gateway-admin or --gateway-metrics)",
            }
        if listed["value"] is not None and now - listed["at"] < BATCHES_TTL_S:
            return listed["value"]
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            parts = await asyncio.gather(*(one_listing(session, u) for u in admin_urls))
        value = {
            "configured": True,
            "urls": [p["url"] for p in parts],
            "errors": [{"url": p["url"], "error": p["error"]} for p in parts if "error" in p],
            "batches": merge_batches([p["batches"] for p in parts if "batches" in p]),
        }
        listed.update(at=now, value=value)
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
            usage, batch_list = await asyncio.gather(gateway_usage(now), gateway_batches(now))
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
        rollouts = await store.newest_rollouts(ROLLOUTS_SHOWN)
        latest = await store.latest_routes()
        audit = await audit_tail.refresh(store)
        body = {
            "regions": sorted(controller.drivers),
            "controller_error": controller.last_error,
            "deployments": [deployment_view(d, await store.get_desired(d.id)) for d in deployments],
            "replicas": replica_rows,
            "rollouts": [rollout_view(r) for r in rollouts],
            "routes_revision": latest[0] if latest else None,
            "traffic": traffic_split(latest[1] if latest else None),
            "audit": audit,
            "autoscale": [e for e in audit if e["kind"] == "autoscale"][-20:],
            "gateway": usage,
            "batches": batch_list,
            "prometheus": _graphs(prometheus_url, {d.spec.model_id for d in deployments}),
        }
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    return router

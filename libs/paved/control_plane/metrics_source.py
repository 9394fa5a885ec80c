"""Where the control plane reads the metrics its decisions take: the gateways' counters (rollout
analysis, traffic for GC) and the replicas' load gauges (the autoscaler).

Two sources behind one small protocol, `MetricsSource`:

  * `ScrapeSource`: the control plane scrapes every gateway's `/metrics` and every ready
    replica's metrics endpoint itself (the default);
  * `PrometheusSource` (`--metrics-source prometheus=URL`): the same series read with PromQL
    instant queries from a Prometheus (or Thanos, Mimir: anything serving `/api/v1/query`) that
    scrapes the fleet with paved's service discovery, so the replicas are not scraped twice.

Invariants callers rely on:
- Both sources return the same values for the same exported series: the Prometheus source asks
  for the raw series (a `{__name__=~...}` selector, no PromQL arithmetic) and folds them with the
  very functions the scrape source parses text with (`fold_gateway_series`;
  `paved.metrics.gauges.parse_metrics` through `gauges_from_series`), so the decision code
  downstream (GatewayAnalyzer, Autoscaler) cannot tell them apart.
- Gateway counters are summed over gateways (instances); a replica's gauges follow
  `paved.metrics.gauges.parse_metrics` (counts summed over the model's series, kv_usage their
  mean; a replica missing an engine gauge is left out, as a failed scrape is).
- Every remote call has a deadline and a body bound; failures raise `MetricsSourceError`
  (gateways) or drop the replica (gauges), never hang.
- Prometheus answers as of its last scrape (up to one scrape interval old) and forgets a target
  within its staleness period after it goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from paved.bodies import read_at_most
from paved.metrics.gauges import (
    KV_USAGE,
    MAX_METRICS_BYTES,
    MAX_QUEUED,
    QUEUED,
    RUNNING,
    WAITING,
    ReplicaMetrics,
    ScrapeError,
    parse_metrics,
    scrape,
)

__all__ = [
    "GATEWAY_FAMILIES",
    "GatewayCounters",
    "MetricsSource",
    "MetricsSourceError",
    "PrometheusSource",
    "ScrapeSource",
    "fold_gateway_series",
    "parse_gateway_metrics",
    "parse_metrics_source",
]

REQUESTS = "paved_gateway_requests_total"
RETRIES = "paved_gateway_retries_total"
PUSHBACK = "paved_gateway_pushback_total"
FIRST_BYTE_BUCKET = "paved_gateway_upstream_first_byte_seconds_bucket"
GATEWAY_FAMILIES = (REQUESTS, RETRIES, PUSHBACK, FIRST_BYTE_BUCKET)
GAUGE_FAMILIES = (WAITING, RUNNING, KV_USAGE, QUEUED, MAX_QUEUED)
# The labels the control plane's service discovery puts on every target (prometheus.py).
DEFAULT_GATEWAY_SELECTOR = 'paved_role="gateway"'
# Replica scrapes in flight at once (each has its own deadline).
SCRAPE_CONCURRENCY = 16
QUERY_TIMEOUT_S = 5.0
MAX_ANSWER_BYTES = 64 << 20
_MATCHER = r'\s*[A-Za-z_][A-Za-z0-9_]*\s*(?:=|!=|=~|!~)\s*"(?:[^"\\]|\\.)*"\s*'
_LABEL_MATCHERS = re.compile(rf"{_MATCHER}(?:,{_MATCHER})*,?\s*")


class MetricsSourceError(Exception):
    """The source could not be read (HTTP error, timeout, an answer that is not PromQL's)."""


@dataclass
class GatewayCounters:
    """The gateways' cumulative counters at `at` (wall time), by backend (a replica's URL)."""

    at: float
    # backend -> tries answered or failed: answered + retried - pushed back
    requests: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)  # backend -> 5xx + retried - pushed back
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # backend -> le -> count

    def only(self, backends: set[str]) -> dict[str, Any]:
        """These backends' counters as JSON (the histogram bounds as strings: JSON keys)."""
        return {
            "at": self.at,
            "requests": {b: v for b, v in self.requests.items() if b in backends},
            "errors": {b: v for b, v in self.errors.items() if b in backends},
            "buckets": {
                b: {repr(le): v for le, v in bs.items()} for b, bs in self.buckets.items() if b in backends
            },
        }

    @classmethod
    def parse(cls, data: Any) -> GatewayCounters | None:
        """The inverse of `only`; None for anything else (a baseline from an older version)."""
        try:
            return cls(
                float(data["at"]),
                {str(b): float(v) for b, v in data["requests"].items()},
                {str(b): float(v) for b, v in data["errors"].items()},
                {str(b): {float(le): float(v) for le, v in bs.items()} for b, bs in data["buckets"].items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def add(self, other: GatewayCounters) -> None:
        """Adds another gateway's counters (same instant) into these."""
        for name in ("requests", "errors"):
            mine, theirs = getattr(self, name), getattr(other, name)
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0.0) + v
        for b, buckets in other.buckets.items():
            into = self.buckets.setdefault(b, {})
            for le, v in buckets.items():
                into[le] = into.get(le, 0.0) + v


def fold_gateway_series(into: GatewayCounters, name: str, labels: dict[str, str], value: float) -> None:
    """One sample of a gateway family (its full name, `_total` / `_bucket` included) into the
    counters. Errors are 5xx answers plus retried attempts (a failing backend whose requests the
    gateway saved by retrying is still failing); a retried attempt is a request too. A backend's
    push-back (a 503 `overloaded`: its queue is full; the gateway holds and retries such a
    request) is neither: the gateway counts each one in `paved_gateway_pushback_total` and in
    exactly one of the retries or the 503 answers, so subtracting it from both leaves the
    answers and the failures alone, whatever the retries' `reason` label (a gateway older than
    the push-back series: every 503 is an error, as before). A saturated version thus neither
    fails its analysis nor dilutes its error rate with tries that were never served. 4xx and 499
    are the caller's; answers without a backend (the gateway's own refusals) are no backend's.
    Other names are ignored."""
    backend = labels.get("backend", "")
    if name == REQUESTS:
        if not backend:
            return
        into.requests[backend] = into.requests.get(backend, 0.0) + value
        if labels.get("status", "").startswith("5"):
            into.errors[backend] = into.errors.get(backend, 0.0) + value
    elif name == RETRIES:
        into.errors[backend] = into.errors.get(backend, 0.0) + value
        into.requests[backend] = into.requests.get(backend, 0.0) + value
    elif name == PUSHBACK:
        # Folded series by series, a backend's counts may read negative until its 5xx and
        # retries are in; over a whole sample they are >= 0.
        into.errors[backend] = into.errors.get(backend, 0.0) - value
        into.requests[backend] = into.requests.get(backend, 0.0) - value
    elif name == FIRST_BYTE_BUCKET and "le" in labels:
        le = float(labels["le"])
        buckets = into.buckets.setdefault(backend, {})
        # Prometheus hands one series per gateway: they add up, as merged scrapes do.
        buckets[le] = buckets.get(le, 0.0) + value


def parse_gateway_metrics(text: str, at: float) -> GatewayCounters:
    """One gateway's counters from its Prometheus text `/metrics`."""
    counters = GatewayCounters(at)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            fold_gateway_series(counters, s.name, s.labels, s.value)
    return counters


def gauges_from_series(
    series: Iterable[tuple[str, dict[str, str], float]], model_id: str | None, source: str = "prometheus"
) -> ReplicaMetrics:
    """One replica's gauges from (name, labels, value) samples: written back as Prometheus text
    and read by `paved.metrics.gauges.parse_metrics`, the scrape's own reader, so both sources
    fold series alike (ScrapeError when an engine gauge is missing)."""
    lines = []
    for name, labels, value in series:
        text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
        lines.append(f"{name}{{{text}}} {value!r}")
    return parse_metrics("\n".join(lines) + "\n", model_id=model_id, source=source)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ReplicaRef(Protocol):
    """What a source needs of a replica (paved.control_plane.types.Replica has it)."""

    @property
    def id(self) -> str: ...

    @property
    def metrics_url(self) -> str | None: ...


class MetricsSource(Protocol):
    """Where the gateways' counters and the replicas' gauges are read."""

    name: str  # "scrape" | "prometheus"

    @property
    def configured(self) -> bool:
        """Whether gateway counters can be read at all (a scrape source with no gateway URL
        cannot: analysis then sees no traffic)."""
        ...

    async def gateway_counters(self) -> GatewayCounters:
        """Every gateway's counters now, summed; MetricsSourceError when one cannot be read."""
        ...

    async def replica_gauges(self, replicas: Sequence[ReplicaRef], model_id: str) -> list[ReplicaMetrics]:
        """One ReplicaMetrics per replica whose gauges could be read (the others left out)."""
        ...


class ScrapeSource:
    """The control plane reads the gateways' and replicas' `/metrics` itself."""

    name = "scrape"

    def __init__(self, gateway_urls: Iterable[str] = (), *, timeout_s: float = 1.0):
        self.urls = list(gateway_urls)
        self.timeout_s = timeout_s

    @property
    def configured(self) -> bool:
        return bool(self.urls)

    async def gateway_counters(self) -> GatewayCounters:
        merged = GatewayCounters(time.time())
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.timeout_s))
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                for url in self.urls:
                    async with session.get(url) as r:
                        if r.status != 200:
                            raise MetricsSourceError(f"{url}: HTTP {r.status}")
                        body = await read_at_most(r.content, MAX_METRICS_BYTES + 1)
                    if len(body) > MAX_METRICS_BYTES:
                        raise MetricsSourceError(f"{url}: metrics larger than {MAX_METRICS_BYTES} bytes")
                    merged.add(parse_gateway_metrics(body.decode("utf-8", errors="replace"), merged.at))
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            raise MetricsSourceError(f"{type(e).__name__}: {e}") from e
        return merged

    async def replica_gauges(self, replicas: Sequence[ReplicaRef], model_id: str) -> list[ReplicaMetrics]:
        """The gauges of every replica that answered (all at once: one after another, replicas
        that hang each cost their whole deadline and held the controller's pass)."""
        gate = asyncio.Semaphore(SCRAPE_CONCURRENCY)

        async def one(url: str) -> ReplicaMetrics | None:
            async with gate:
                try:
                    return await scrape(url, model_id=model_id)
                except (ScrapeError, ValueError):
                    return None

        read = await asyncio.gather(*(one(r.metrics_url) for r in replicas if r.metrics_url))
        return [m for m in read if m is not None]


class PrometheusSource:
    """PromQL instant queries against `url` (its `/api/v1/query`). `gateway_selector`: label
    matchers picking the gateways' series (default: the role paved's discovery gives them);
    the replicas' series are picked by `paved_replica`, the replica id discovery labels them
    with."""

    name = "prometheus"

    def __init__(
        self,
        url: str,
        *,
        gateway_selector: str = DEFAULT_GATEWAY_SELECTOR,
        timeout_s: float = QUERY_TIMEOUT_S,
        max_bytes: int = MAX_ANSWER_BYTES,
    ):
        self.url = check_prometheus_url(url)
        if not _LABEL_MATCHERS.fullmatch(gateway_selector):
            raise ValueError(
                f'gateway selector {gateway_selector!r:.200}: label matchers such as paved_role="gateway"'
            )
        if not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        self.gateway_selector = gateway_selector.strip().rstrip(",")
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes

    @property
    def configured(self) -> bool:
        return True

    async def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """The `result` of an instant vector query (MetricsSourceError otherwise)."""
        params = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(self.url + "/api/v1/query", params=params, allow_redirects=False) as r,
            ):
                body = await read_at_most(r.content, self.max_bytes + 1)
                status = r.status
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise MetricsSourceError(f"{self.url}: {type(e).__name__}: {e}") from e
        if len(body) > self.max_bytes:
            raise MetricsSourceError(f"{self.url}: answer larger than {self.max_bytes} bytes")
        try:
            answer = json.loads(body)
        except ValueError:
            raise MetricsSourceError(f"{self.url}: HTTP {status}, not JSON: {body[:200]!r}") from None
        if not isinstance(answer, dict) or answer.get("status") != "success":
            error = answer.get("error") if isinstance(answer, dict) else None
            raise MetricsSourceError(f"{self.url}: HTTP {status}: {error or body[:200]!r}")
        data = answer.get("data")
        if (
            not isinstance(data, dict)
            or data.get("resultType") != "vector"
            or not isinstance(data.get("result"), list)
        ):
            raise MetricsSourceError(f"{self.url}: not an instant vector")
        return data["result"]

    async def _series(self, names: Sequence[str], matchers: str) -> list[tuple[str, dict[str, str], float]]:
        selector = f'{{__name__=~"{_regex(names)}"{f", {matchers}" if matchers else ""}}}'
        out = []
        for item in await self.query(selector):
            try:
                labels = {str(k): str(v) for k, v in item["metric"].items()}
                value = float(item["value"][1])
            except (KeyError, TypeError, ValueError, IndexError, AttributeError):
                raise MetricsSourceError(f"{self.url}: a malformed sample in the answer") from None
            if math.isfinite(value):
                out.append((labels.pop("__name__", ""), labels, value))
        return out

    async def gateway_counters(self) -> GatewayCounters:
        at = time.time()
        counters = GatewayCounters(at)
        for name, labels, value in await self._series(GATEWAY_FAMILIES, self.gateway_selector):
            fold_gateway_series(counters, name, labels, value)
        return counters

    async def replica_gauges(self, replicas: Sequence[ReplicaRef], model_id: str) -> list[ReplicaMetrics]:
        ids = [r.id for r in replicas]
        if not ids:
            return []
        try:
            series = await self._series(
                GAUGE_FAMILIES,
                f'paved_replica=~"{_regex(ids)}"',
            )
        except MetricsSourceError:
            return []  # as every scrape failing: the controller holds (no reading is not idle)
        by_replica: dict[str, list[tuple[str, dict[str, str], float]]] = {}
        for name, labels, value in series:
            by_replica.setdefault(labels.get("paved_replica", ""), []).append((name, labels, value))
        out = []
        for replica_id in ids:
            with contextlib.suppress(ScrapeError):
                out.append(gauges_from_series(by_replica.get(replica_id, []), model_id))
        return out


def _regex(values: Iterable[str]) -> str:
    """An alternation matching exactly `values`, as the body of a PromQL double-quoted string
    (regex-escaped, then string-escaped: PromQL strings take Go's escapes, not `\\-`)."""
    return "|".join(re.escape(v) for v in values).replace("\\", "\\\\").replace('"', '\\"')


def check_prometheus_url(url: str) -> str:
    """`url` without a trailing slash; ValueError unless http(s)://HOST[:PORT][/PATH] on loopback
    or any host (a Prometheus is often remote), without query or fragment."""
    parts = urllib.parse.urlsplit(url.strip())
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValueError(f"Prometheus URL {url!r:.200}: a bad port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"Prometheus URL {url!r:.200}: expected http(s)://HOST:PORT[/PATH]")
    return url.strip().rstrip("/")


def parse_metrics_source(value: str, gateway_urls: Sequence[str] = ()) -> MetricsSource:
    """`scrape` or `prometheus=URL` (the control plane's --metrics-source); ValueError naming
    what is wrong."""
    if value == "scrape":
        return ScrapeSource(gateway_urls)
    kind, sep, url = value.partition("=")
    if kind != "prometheus" or not sep:
        raise ValueError(f"{value!r:.200}: scrape or prometheus=URL")
    return PrometheusSource(url)

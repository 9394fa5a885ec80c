"""A replica's load gauges, read from its Prometheus text `/metrics`: what the control plane's
autoscaler and dashboard and the gateway's router and flow control read about an engine.

From vLLM's families (paved's frontends export them for every engine, simulated ones included):
`waiting` (vllm:num_requests_waiting), `running` (vllm:num_requests_running) and `kv_usage`
(vllm:kv_cache_usage_perc, a 0..1 fraction). From a paved frontend's admission, when present:
`queued` (paved_queued_sequences, sequences admitted and not finished) and `max_queued`
(paved_max_queued_sequences, the bound beyond which the frontend answers 503 `overloaded`).

Invariants:
- A ReplicaMetrics holds finite numbers >= 0, kv_usage <= 1; the admission pair is both
  present or both None.
- `full` is True only when the admission pair is present and the frontend would refuse a
  one-sequence request now; a replica without it (not a paved frontend) is never full.
- Reading is bounded: `timeout_s` overall and `max_bytes` of body; only the lines of the
  families read here reach the Prometheus parser (a vLLM /metrics is mostly histograms).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from paved.bodies import read_at_most

__all__ = [
    "KV_USAGE",
    "MAX_METRICS_BYTES",
    "MAX_QUEUED",
    "QUEUED",
    "RUNNING",
    "WAITING",
    "ReplicaMetrics",
    "ScrapeError",
    "parse_metrics",
    "scrape",
]

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
QUEUED = "paved_queued_sequences"
MAX_QUEUED = "paved_max_queued_sequences"
# vLLM's families label the model `model_name`, paved's admission families `model`.
_MODEL_LABEL = {
    WAITING: "model_name",
    RUNNING: "model_name",
    KV_USAGE: "model_name",
    QUEUED: "model",
    MAX_QUEUED: "model",
}
_ENGINE = (WAITING, RUNNING, KV_USAGE)
_ADMISSION = (QUEUED, MAX_QUEUED)
# A replica's /metrics is a few KiB; a bound keeps a misbehaving endpoint from filling memory.
MAX_METRICS_BYTES = 8 << 20
# Float sums such as 3 x (1/3) land a hair above 1.
_EPS = 1e-9


@dataclass(frozen=True)
class ReplicaMetrics:
    """One replica's gauges at one scrape (kv_usage is the 0..1 fraction; `queued` and
    `max_queued` are the paved frontend's admission count and bound, None when not exported)."""

    waiting: float
    running: float
    kv_usage: float
    queued: float | None = None
    max_queued: float | None = None

    def __post_init__(self) -> None:
        for name in ("waiting", "running", "kv_usage", "queued", "max_queued"):
            value = getattr(self, name)
            if value is None and name in ("queued", "max_queued"):
                continue
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < math.inf:
                raise ValueError(f"ReplicaMetrics.{name} must be a finite number >= 0, got {value!r}")
        if self.kv_usage > 1.0 + _EPS:
            raise ValueError(f"ReplicaMetrics.kv_usage is a fraction in [0, 1], got {self.kv_usage!r}")
        if (self.queued is None) != (self.max_queued is None):
            raise ValueError("ReplicaMetrics.queued and max_queued go together")

    @property
    def full(self) -> bool:
        """The frontend's admission is at its bound: the next request would get 503 `overloaded`."""
        return self.queued is not None and self.max_queued is not None and self.queued >= self.max_queued


class ScrapeError(Exception):
    """A replica's metrics could not be read (HTTP error, timeout, missing or bad gauges)."""


async def scrape(
    metrics_url: str,
    *,
    model_id: str | None = None,
    timeout_s: float = 2.0,
    max_bytes: int = MAX_METRICS_BYTES,
    session: aiohttp.ClientSession | None = None,
) -> ReplicaMetrics:
    """One replica's gauges from its Prometheus text `/metrics` (see `parse_metrics`). ScrapeError
    on anything else than a 200 with the three engine gauges, within `timeout_s` overall and
    `max_bytes` of body. `session`: a pooled session to use (else one is opened for this read)."""
    if not isinstance(metrics_url, str) or not metrics_url.startswith(("http://", "https://")):
        raise ValueError(f"metrics_url must be an http(s) URL, got {metrics_url!r}")
    if not isinstance(timeout_s, int | float) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be an integer >= 1, got {max_bytes!r}")
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        if session is None:
            async with aiohttp.ClientSession(timeout=timeout) as own:
                body = await _read(own, metrics_url, timeout, max_bytes)
        else:
            body = await _read(session, metrics_url, timeout, max_bytes)
    except (TimeoutError, aiohttp.ClientError) as e:
        raise ScrapeError(f"{metrics_url}: {type(e).__name__}: {e}") from e
    return parse_metrics(body.decode("utf-8", errors="replace"), model_id=model_id, source=metrics_url)


async def _read(
    session: aiohttp.ClientSession, url: str, limits: aiohttp.ClientTimeout, max_bytes: int
) -> bytes:
    async with session.get(url, timeout=limits, allow_redirects=False) as response:
        if response.status != 200:
            raise ScrapeError(f"{url}: HTTP {response.status}")
        body = await read_at_most(response.content, max_bytes + 1)
    if len(body) > max_bytes:
        raise ScrapeError(f"{url}: metrics larger than {max_bytes} bytes")
    return body


def _wanted(line: str) -> bool:
    """A line of one of the families read here (a sample, or its # HELP / # TYPE)."""
    if line.startswith("#"):
        parts = line.split(None, 3)
        name = parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
    else:
        name = line
    return name.startswith(("vllm:num_requests_", KV_USAGE, QUEUED, MAX_QUEUED))


def parse_metrics(text: str, *, model_id: str | None = None, source: str = "metrics") -> ReplicaMetrics:
    """The gauges from Prometheus text. Series are filtered by the model label (`model_name`
    on vLLM's families, `model` on paved's) when `model_id` is given; counts are summed over
    the remaining series (one per engine), kv_usage is their mean. The three engine gauges
    are required (ScrapeError naming the missing ones); the admission pair is read when both
    are there."""
    values: dict[str, list[float]] = {name: [] for name in _MODEL_LABEL}
    # Only the families read here go through the parser: it is pure Python, and a vLLM
    # /metrics is mostly histograms the gateway would parse every round for nothing.
    kept = "\n".join(line for line in text.splitlines() if _wanted(line))
    try:
        for family in text_string_to_metric_families(kept + "\n"):
            for sample in family.samples:
                label = _MODEL_LABEL.get(sample.name)
                if label is None:
                    continue
                if model_id is not None and sample.labels.get(label) != model_id:
                    continue
                values[sample.name].append(float(sample.value))
    except ValueError as e:
        raise ScrapeError(f"{source}: unparsable Prometheus text: {e}") from e
    missing = [name for name in _ENGINE if not values[name]]
    if missing:
        which = f" for model_name={model_id!r}" if model_id is not None else ""
        raise ScrapeError(f"{source}: no {', '.join(missing)} series{which}")
    admission = all(values[name] for name in _ADMISSION)
    try:
        return ReplicaMetrics(
            waiting=sum(values[WAITING]),
            running=sum(values[RUNNING]),
            kv_usage=min(1.0, sum(values[KV_USAGE]) / len(values[KV_USAGE])),
            queued=sum(values[QUEUED]) if admission else None,
            max_queued=sum(values[MAX_QUEUED]) if admission else None,
        )
    except ValueError as e:
        raise ScrapeError(f"{source}: {e}") from e

"""The gateway's routes table: which model aliases exist, which backends (paved frontends) serve
each alias and version, and how requests spread over them.

File format (JSON, or TOML with `[[models]]` and `[[models.backends]]`)::

    {"models": [{"alias": "tiny", "strategy": "prefix_affinity", "bounded_load": 1.5,
                 "split": {"v1": 0.9, "v2": 0.1}, "current": null,
                 "backends": [{"url": "http://127.0.0.1:8001", "version": "v1", "weight": 1}]}]}

Invariants of a `RoutesTable` built by `parse_routes` (the router relies on them):
- aliases are unique and contain no '@' (that separates a version pin: "alias@version");
- within a model backend ids are unique; one id names one server everywhere (the same id in two
  models has the same urls), so per-backend state (load, ejection, readiness) is keyed by id;
- weights are finite and >= 0 (0 = drained: routed to by nothing);
- `split` and `current` name only versions some backend of the model serves;
- a model has backends unless it is `scaled_to_zero` (its deployment scaled to zero replicas
  while idle: the alias stays known, requests for it are held while it wakes), and a model
  scaled to zero has none; `waking` (replicas were asked for) only marks a model at zero;
- `versions` (file key) only lists, for a model at zero, the versions it serves once woken
  (distinct, each a valid version): `ModelRoute.versions` is the backends' versions, or these
  at zero, so a pin `alias@version` is known (held) at zero exactly when it is listed;
- `revision` is a hash of the normalised content: equal tables have equal revisions whatever
  the file's format, key order or whitespace.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import math
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol
from urllib.parse import SplitResult, urlsplit

MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_BACKENDS = 10_000
MAX_WEIGHT = 1_000_000.0
MAX_AFFINITY_PREFIX_TOKENS = 65_536
MAX_BOUNDED_LOAD = 100.0
MAX_BOUNDED_LOAD_SLACK = 100_000

STRATEGIES = ("least_outstanding", "weighted", "prefix_affinity")
KINDS = ("generate", "embed", "kserve")

# Model names in the wild look like "meta-llama/Llama-3.1-8B" or "org:model+lora"; '@' is
# reserved for version pins and whitespace/control characters would make logs ambiguous.
_ALIAS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+-]{0,255}")
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
_ID = re.compile(r"[\x21-\x7e]{1,512}")
_TEMPLATE_REF = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}(@[1-9][0-9]{0,8})?")
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")

_MODEL_KEYS = frozenset(
    {
        "alias",
        "backends",
        "strategy",
        "split",
        "current",
        "tokenizer",
        "affinity_prefix_tokens",
        "kind",
        "bounded_load",
        "bounded_load_slack",
        "template",
        "max_model_len",
        "summarizer",
        "summarizer_temperature",
        "cache",
        "scaled_to_zero",
        "waking",
        "versions",
    }
)
_CACHE_KEYS = frozenset({"exact", "semantic", "ttl_s", "threshold", "embedding_model"})
MAX_MODEL_LEN_LIMIT = 10_000_000
MAX_CACHE_TTL_S = 7 * 86400.0
_BACKEND_KEYS = frozenset(
    {
        "id",
        "url",
        "version",
        "weight",
        "upstream_model",
        "kserve_grpc",
        "kserve_http",
        "region",
        "metrics_url",
    }
)


class RoutesError(ValueError):
    """A routes table that cannot be used; the message starts with the offending field's path
    (e.g. "models[0].backends[1].url: ...")."""


@dataclass(frozen=True)
class Backend:
    """One paved frontend serving one version of a model.

    `url` is the OpenAI base (it serves /v1/... and /health/ready); `kserve_grpc` is
    "host:port", `kserve_http` a base URL; `metrics_url` the full URL of the Prometheus text
    carrying its engine's `vllm:` gauges (None: the frontend's own `url + "/metrics"`, see
    `metrics_endpoint`). An empty `id` becomes `url`; an empty `upstream_model` becomes the
    route's alias (see `ModelRoute`)."""

    id: str
    url: str
    version: str
    weight: float = 1.0
    upstream_model: str = ""
    kserve_grpc: str | None = None
    kserve_http: str | None = None
    region: str | None = None
    metrics_url: str | None = None

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", self.url)

    @property
    def metrics_endpoint(self) -> str:
        """Where the gateway reads this backend's load gauges."""
        return self.metrics_url if self.metrics_url is not None else self.url + "/metrics"


@dataclass(frozen=True)
class CachePolicy:
    """A route's caches: `exact` (hash of the canonical request) and `semantic` (nearest
    earlier question by `embedding_model`'s embeddings, cosine >= `threshold`), both kept for
    `ttl_s`. Either applies only to deterministic requests (see paved.gateway.caching.cache)."""

    exact: bool = True
    semantic: bool = False
    ttl_s: float = 3600.0
    threshold: float = 0.92
    embedding_model: str | None = None


@dataclass(frozen=True)
class ModelRoute:
    """An alias and its backends. `current` is the version the bare alias follows (None: every
    version, by `split` shares when set, else by weight); `split` maps version -> share for
    sticky A/B (a caller's key always lands on the same version while the split is unchanged).
    `current` takes precedence over `split` so a split can be staged before it takes effect."""

    alias: str
    backends: tuple[Backend, ...]
    strategy: str = "least_outstanding"
    split: Mapping[str, float] | None = None
    current: str | None = None
    tokenizer: str | None = None
    affinity_prefix_tokens: int = 256
    kind: str = "generate"
    # prefix_affinity's request bound: a backend takes a request of its prefixes while it has
    # fewer than max(ceil(c * fair), ceil(fair) + slack) in flight; None: the router's default.
    bounded_load: float | None = None
    bounded_load_slack: int | None = None
    # The orchestration layer: the template a request naming none renders with ("name" or
    # "name@N"), the context window conversations are fitted to (None: asked of the backend),
    # the alias that summarizes older turns, and the caches.
    template: str | None = None
    max_model_len: int | None = None
    summarizer: str | None = None
    cache: CachePolicy | None = None
    # The summarizer's sampling temperature (None: 0, greedy).
    summarizer_temperature: float | None = None
    # At zero replicas (no backends): requests are held while the control plane wakes it;
    # `waking` once it has asked for replicas.
    scaled_to_zero: bool = False
    waking: bool = False
    # At zero: the versions its woken replicas will serve (file key `versions`), so pins to
    # them are held like the bare alias rather than answered 404.
    zero_versions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        backends = tuple(
            b if b.upstream_model else dataclasses.replace(b, upstream_model=self.alias)
            for b in self.backends
        )
        object.__setattr__(self, "backends", backends)
        if self.split is not None:
            object.__setattr__(self, "split", MappingProxyType(dict(self.split)))
        object.__setattr__(self, "zero_versions", tuple(self.zero_versions))

    @property
    def versions(self) -> tuple[str, ...]:
        """The versions the backends serve, in first-seen order; at zero (no backends), the
        versions it will serve once woken (`zero_versions`)."""
        if not self.backends:
            return self.zero_versions
        return tuple(dict.fromkeys(b.version for b in self.backends))


@dataclass(frozen=True)
class RoutesTable:
    models: Mapping[str, ModelRoute]
    revision: str

    @classmethod
    def of(cls, routes: Iterable[ModelRoute]) -> RoutesTable:
        """A validated table of already-built routes (the revision is computed): what a
        control-plane source or a test builds without going through a file."""
        routes = tuple(routes)
        return parse_routes({"models": [_route_to_obj(r) for r in routes]})

    def to_obj(self) -> dict[str, Any]:
        """The table in file form (JSON-serialisable); parse_routes(t.to_obj()) == t."""
        return {"models": [_route_to_obj(r) for r in self.models.values()]}


class RoutesSource(Protocol):
    """Where the live table comes from (a file today, a control-plane watch next). `start`
    installs the first table into the router or raises RoutesError; afterwards a bad update
    keeps the last good table and is reported in `last_error` (None once an update applies)."""

    @property
    def revision(self) -> str | None: ...

    @property
    def last_error(self) -> str | None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def _route_to_obj(r: ModelRoute) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "alias": r.alias,
        "strategy": r.strategy,
        "kind": r.kind,
        "affinity_prefix_tokens": r.affinity_prefix_tokens,
        "backends": [{k: v for k, v in dataclasses.asdict(b).items() if v is not None} for b in r.backends],
    }
    if r.split is not None:
        obj["split"] = dict(r.split)
    if r.current is not None:
        obj["current"] = r.current
    if r.tokenizer is not None:
        obj["tokenizer"] = r.tokenizer
    if r.bounded_load is not None:
        obj["bounded_load"] = r.bounded_load
    if r.bounded_load_slack is not None:
        obj["bounded_load_slack"] = r.bounded_load_slack
    for name in ("template", "max_model_len", "summarizer", "summarizer_temperature"):
        if getattr(r, name) is not None:
            obj[name] = getattr(r, name)
    if r.cache is not None:
        obj["cache"] = {k: v for k, v in dataclasses.asdict(r.cache).items() if v is not None}
    # Only when set: a table without models at zero keeps its revision.
    if r.scaled_to_zero:
        obj["scaled_to_zero"] = True
    if r.waking:
        obj["waking"] = True
    if r.zero_versions:
        obj["versions"] = list(r.zero_versions)
    return obj


# -- parsing ------------------------------------------------------------------------------------


def _fail(path: str, message: str) -> RoutesError:
    return RoutesError(f"{path}: {message}")


def _check_keys(obj: Any, allowed: frozenset[str], path: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise _fail(path, f"must be an object, got {type(obj).__name__}")
    unknown = sorted(str(k) for k in obj if k not in allowed)
    if unknown:
        raise _fail(f"{path}.{unknown[0]}", f"unknown key (allowed: {', '.join(sorted(allowed))})")
    return obj


def _string(obj: dict[str, Any], key: str, path: str, *, required: bool = False) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise _fail(f"{path}.{key}", "is required")
        return None
    if not isinstance(value, str):
        raise _fail(f"{path}.{key}", f"must be a string, got {type(value).__name__}")
    return value


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(path, f"must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise _fail(path, "must be finite")
    if number < 0:
        raise _fail(path, f"must be >= 0, got {value}")
    if number > MAX_WEIGHT:
        raise _fail(path, f"must be <= {MAX_WEIGHT:g}, got {value}")
    return number


def _host(host: str | None, path: str) -> str:
    """A loopback IP literal or a DNS hostname; only the shape is checked (nothing resolves)."""
    if not host:
        raise _fail(path, "has no host")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None:
        if not ip.is_loopback:
            raise _fail(path, f"an IP host must be loopback, got {host}; name other hosts by hostname")
        return host
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in host.split(".")):
        raise _fail(path, f"host {host!r} is not a valid hostname")
    return host


def _http_parts(value: str, path: str) -> SplitResult:
    """`value` split as an http:// URL with a valid host and port and no credentials."""
    if len(value) > 2048:
        raise _fail(path, "is longer than 2048 characters")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as e:
        raise _fail(path, f"{value!r} is not a valid URL ({e})") from None
    if parts.scheme != "http":
        raise _fail(path, f"must be an http:// URL, got {value!r}")
    if parts.username is not None or parts.password is not None:
        raise _fail(path, "must not carry credentials")
    _host(parts.hostname, path)
    if port == 0:
        raise _fail(path, "port must be 1-65535")
    return parts


def _http_url(value: str, path: str) -> str:
    """An http:// base URL (scheme, host, optional port; no path, query, fragment or user)."""
    parts = _http_parts(value, path)
    if parts.query or parts.fragment or parts.path not in ("", "/"):
        raise _fail(path, f"must be a base URL (scheme://host[:port]) without path or query, got {value!r}")
    return value.rstrip("/")


def _metrics_url(value: str, path: str) -> str:
    """An http:// URL with a path (e.g. a metrics proxy's http://host:port/metrics); no query,
    fragment or user."""
    parts = _http_parts(value, path)
    if parts.query or parts.fragment or "?" in value or "#" in value:
        raise _fail(path, f"must be a URL without query or fragment, got {value!r}")
    if not parts.path.startswith("/") or any(c.isspace() or not c.isprintable() for c in parts.path):
        raise _fail(path, f"must name a path (e.g. http://host:port/metrics), got {value!r}")
    return value


def _host_port(value: str, path: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise _fail(path, f"must be host:port, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    _host(host, path)
    return value


def _backend(obj: Any, path: str, alias: str, kind: str) -> Backend:
    obj = _check_keys(obj, _BACKEND_KEYS, path)
    url = _http_url(_string(obj, "url", path, required=True) or "", f"{path}.url")
    version = _string(obj, "version", path, required=True) or ""
    if "@" in version:
        raise _fail(f"{path}.version", "must not contain '@'")
    if not _VERSION.fullmatch(version):
        raise _fail(f"{path}.version", f"{version!r} must match {_VERSION.pattern}")
    backend_id = _string(obj, "id", path) or url
    if not _ID.fullmatch(backend_id):
        raise _fail(f"{path}.id", "must be 1-512 printable ASCII characters without spaces")
    weight = _number(obj.get("weight", 1.0), f"{path}.weight")
    upstream = _string(obj, "upstream_model", path) or alias
    if len(upstream) > 512:
        raise _fail(f"{path}.upstream_model", "is longer than 512 characters")
    grpc = _string(obj, "kserve_grpc", path)
    if grpc is not None:
        _host_port(grpc, f"{path}.kserve_grpc")
    khttp = _string(obj, "kserve_http", path)
    if khttp is not None:
        khttp = _http_url(khttp, f"{path}.kserve_http")
    if kind == "kserve" and grpc is None and khttp is None:
        raise _fail(path, "a kserve model's backend needs kserve_grpc or kserve_http")
    region = _string(obj, "region", path)
    if region is not None and not _ID.fullmatch(region):
        raise _fail(f"{path}.region", "must be 1-512 printable ASCII characters without spaces")
    metrics = _string(obj, "metrics_url", path)
    if metrics is not None:
        metrics = _metrics_url(metrics, f"{path}.metrics_url")
    return Backend(backend_id, url, version, weight, upstream, grpc, khttp, region, metrics)


def _model(obj: Any, path: str, budget: list[int]) -> ModelRoute:
    obj = _check_keys(obj, _MODEL_KEYS, path)
    alias = _string(obj, "alias", path, required=True) or ""
    if "@" in alias:
        raise _fail(
            f"{path}.alias", f"{alias!r} contains '@', which is reserved for version pins (alias@version)"
        )
    if not _ALIAS.fullmatch(alias):
        raise _fail(f"{path}.alias", f"{alias!r} must match {_ALIAS.pattern}")
    strategy = _string(obj, "strategy", path) or "least_outstanding"
    if strategy not in STRATEGIES:
        raise _fail(f"{path}.strategy", f"must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    kind = _string(obj, "kind", path) or "generate"
    if kind not in KINDS:
        raise _fail(f"{path}.kind", f"must be one of {', '.join(KINDS)}, got {kind!r}")
    tokenizer = _string(obj, "tokenizer", path)
    if tokenizer is not None and not tokenizer:
        raise _fail(f"{path}.tokenizer", "must not be empty")
    apt = obj.get("affinity_prefix_tokens", 256)
    if isinstance(apt, bool) or not isinstance(apt, int) or not 1 <= apt <= MAX_AFFINITY_PREFIX_TOKENS:
        raise _fail(
            f"{path}.affinity_prefix_tokens", f"must be an integer in 1..{MAX_AFFINITY_PREFIX_TOKENS}"
        )
    bounded_load = obj.get("bounded_load")
    if bounded_load is not None:
        if (
            isinstance(bounded_load, bool)
            or not isinstance(bounded_load, int | float)
            or not 1 <= bounded_load <= MAX_BOUNDED_LOAD  # NaN fails this too
        ):
            raise _fail(f"{path}.bounded_load", f"must be a number in 1..{MAX_BOUNDED_LOAD:g}")
        if strategy != "prefix_affinity":
            raise _fail(f"{path}.bounded_load", "applies only to strategy prefix_affinity")
        bounded_load = float(bounded_load)
    slack = obj.get("bounded_load_slack")
    if slack is not None:
        if isinstance(slack, bool) or not isinstance(slack, int) or not 0 <= slack <= MAX_BOUNDED_LOAD_SLACK:
            raise _fail(f"{path}.bounded_load_slack", f"must be an integer in 0..{MAX_BOUNDED_LOAD_SLACK}")
        if strategy != "prefix_affinity":
            raise _fail(f"{path}.bounded_load_slack", "applies only to strategy prefix_affinity")

    at_zero = obj.get("scaled_to_zero", False)
    waking = obj.get("waking", False)
    for name, flag in (("scaled_to_zero", at_zero), ("waking", waking)):
        if not isinstance(flag, bool):
            raise _fail(f"{path}.{name}", "must be true or false")
    if waking and not at_zero:
        raise _fail(f"{path}.waking", "marks only a model that is scaled_to_zero")
    raw_backends = obj.get("backends")
    if at_zero:
        if raw_backends not in (None, []):
            raise _fail(f"{path}.backends", "must be empty for a model that is scaled_to_zero")
        raw_backends = []
    elif not isinstance(raw_backends, list) or not raw_backends:
        raise _fail(f"{path}.backends", "must be a non-empty list (unless the model is scaled_to_zero)")
    budget[0] -= len(raw_backends)
    if budget[0] < 0:
        raise _fail(f"{path}.backends", f"the table has more than {MAX_BACKENDS} backends")
    backends: list[Backend] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_backends):
        b = _backend(raw, f"{path}.backends[{i}]", alias, kind)
        if b.id in seen:
            raise _fail(f"{path}.backends[{i}].id", f"duplicate backend id {b.id!r}")
        seen.add(b.id)
        backends.append(b)
    zero_versions = _zero_versions(obj.get("versions"), f"{path}.versions", at_zero)
    versions = dict.fromkeys(b.version for b in backends) if backends else dict.fromkeys(zero_versions)

    current = _string(obj, "current", path)
    if current is not None and current not in versions:
        raise _fail(
            f"{path}.current", f"names version {current!r}, which no backend serves ({', '.join(versions)})"
        )
    split = obj.get("split")
    if split is not None:
        if not isinstance(split, dict) or not split:
            raise _fail(f"{path}.split", "must be a non-empty object of version -> share")
        for version, share in split.items():
            if version not in versions:
                raise _fail(
                    f"{path}.split.{version}", f"names a version no backend serves ({', '.join(versions)})"
                )
            _number(share, f"{path}.split.{version}")
        if sum(float(s) for s in split.values()) <= 0:
            raise _fail(f"{path}.split", "shares must not all be 0")
        split = {str(v): float(s) for v, s in split.items()}
    template = _string(obj, "template", path)
    if template is not None and not _TEMPLATE_REF.fullmatch(template):
        raise _fail(f"{path}.template", f"must be a template name or name@version, got {template!r}")
    max_model_len = obj.get("max_model_len")
    if max_model_len is not None and (
        isinstance(max_model_len, bool)
        or not isinstance(max_model_len, int)
        or not 1 <= max_model_len <= MAX_MODEL_LEN_LIMIT
    ):
        raise _fail(f"{path}.max_model_len", f"must be an integer in 1..{MAX_MODEL_LEN_LIMIT}")
    summarizer = _string(obj, "summarizer", path)
    if summarizer is not None and not _ALIAS.fullmatch(summarizer.partition("@")[0]):
        raise _fail(f"{path}.summarizer", f"must be a model alias, got {summarizer!r}")
    summarizer_temperature = obj.get("summarizer_temperature")
    if summarizer_temperature is not None:
        summarizer_temperature = _number(summarizer_temperature, f"{path}.summarizer_temperature")
        if summarizer_temperature > 2:
            raise _fail(f"{path}.summarizer_temperature", "must be in 0..2")
        if summarizer is None:
            raise _fail(f"{path}.summarizer_temperature", "needs a summarizer")
    cache = _cache_policy(obj.get("cache"), f"{path}.cache") if "cache" in obj else None
    return ModelRoute(
        alias, tuple(backends), strategy, split, current, tokenizer, apt, kind, bounded_load, slack,
        template, max_model_len, summarizer, cache, summarizer_temperature, at_zero, waking,
        zero_versions,
    )  # fmt: skip


def _zero_versions(value: Any, path: str, at_zero: bool) -> tuple[str, ...]:
    """The versions a model at zero will serve (absent: none known; pins to it are 404)."""
    if value is None:
        return ()
    if not at_zero:
        raise _fail(path, "lists versions only for a model that is scaled_to_zero (else its backends do)")
    if not isinstance(value, list) or len(value) > MAX_BACKENDS:
        raise _fail(path, f"must be a list of at most {MAX_BACKENDS} versions")
    for i, version in enumerate(value):
        if not isinstance(version, str) or not _VERSION.fullmatch(version):
            raise _fail(f"{path}[{i}]", f"{version!r} must be a version matching {_VERSION.pattern}")
    if len(set(value)) != len(value):
        raise _fail(path, "lists a version twice")
    return tuple(value)


def _cache_policy(obj: Any, path: str) -> CachePolicy:
    obj = _check_keys(obj, _CACHE_KEYS, path)
    flags = {}
    for name in ("exact", "semantic"):
        value = obj.get(name, name == "exact")
        if not isinstance(value, bool):
            raise _fail(f"{path}.{name}", "must be true or false")
        flags[name] = value
    ttl = _number(obj.get("ttl_s", 3600.0), f"{path}.ttl_s")
    if not 0 < ttl <= MAX_CACHE_TTL_S:
        raise _fail(f"{path}.ttl_s", f"must be in (0, {MAX_CACHE_TTL_S:g}] seconds")
    threshold = _number(obj.get("threshold", 0.92), f"{path}.threshold")
    if not 0 < threshold <= 1:
        raise _fail(f"{path}.threshold", "must be a cosine similarity in (0, 1]")
    embedding = _string(obj, "embedding_model", path)
    if embedding is not None and not _ALIAS.fullmatch(embedding.partition("@")[0]):
        raise _fail(f"{path}.embedding_model", f"must be a model alias, got {embedding!r}")
    if flags["semantic"] and embedding is None:
        raise _fail(f"{path}.embedding_model", "is required when semantic is true")
    return CachePolicy(flags["exact"], flags["semantic"], float(ttl), float(threshold), embedding)


def parse_routes(obj: Any) -> RoutesTable:
    """Validate a routes object (the parsed file) into a table; RoutesError names the field."""
    obj = _check_keys(obj, frozenset({"models"}), "routes")
    raw_models = obj.get("models")
    if not isinstance(raw_models, list):
        raise _fail("models", "must be a list")
    budget = [MAX_BACKENDS]
    models: dict[str, ModelRoute] = {}
    urls_by_id: dict[str, tuple[str, str | None, str | None, str | None]] = {}
    for i, raw in enumerate(raw_models):
        route = _model(raw, f"models[{i}]", budget)
        if route.alias in models:
            raise _fail(f"models[{i}].alias", f"duplicate alias {route.alias!r}")
        for j, b in enumerate(route.backends):
            endpoints = (b.url, b.kserve_grpc, b.kserve_http, b.metrics_url)
            if urls_by_id.setdefault(b.id, endpoints) != endpoints:
                raise _fail(
                    f"models[{i}].backends[{j}].id",
                    f"backend id {b.id!r} is used by another model for different urls",
                )
        models[route.alias] = route
    canonical = json.dumps([_route_to_obj(r) for r in models.values()], sort_keys=True, separators=(",", ":"))
    revision = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    return RoutesTable(MappingProxyType(models), revision)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def parse_routes_bytes(data: bytes, fmt: str, *, source: str = "routes") -> RoutesTable:
    """Parse file content of format "json" or "toml" (bounded by MAX_FILE_BYTES)."""
    if len(data) > MAX_FILE_BYTES:
        raise RoutesError(f"{source}: larger than {MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RoutesError(f"{source}: not UTF-8 ({e})") from None
    try:
        if fmt == "json":
            obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
        elif fmt == "toml":
            obj = tomllib.loads(text)
        else:
            raise RoutesError(f"{source}: unknown format {fmt!r} (json or toml)")
    except (ValueError, RecursionError) as e:
        if isinstance(e, RoutesError):
            raise
        raise RoutesError(f"{source}: invalid {fmt.upper()}: {e}") from None
    return parse_routes(obj)


def routes_format(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        return "json"
    if suffix == ".toml":
        return "toml"
    raise RoutesError(f"{path}: routes file must end in .json or .toml")


def load_routes_file(path: str | Path) -> RoutesTable:
    """Read and parse a .json or .toml routes file (at most MAX_FILE_BYTES). Blocking: call it
    from a thread in async code."""
    fmt = routes_format(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise RoutesError(f"{path}: cannot read ({e.strerror or e})") from None
    return parse_routes_bytes(data, fmt, source=str(path))

"""Choosing a backend for a request: version (pin, current, sticky split), health (readiness,
passive ejection) and load balancing (weighted, least outstanding, prefix affinity scored by
prefix match and load, with bounded load on distinct prefixes and on requests).

Concurrency: a Router belongs to one event loop and is called only from it; every method is
synchronous and completes without awaiting, so no locks are needed and `set_table` is atomic
with respect to `pick`/`begin`/`end`. Do not share a Router between threads.

Invariants:
- `pick` returns only a backend of the table in force with weight > 0, not marked unready by
  the health checker, not ejected and not in `exclude`; otherwise it raises NoBackendError.
- Per-backend state (outstanding, ejection, readiness) is keyed by backend id and survives a
  `set_table` for the ids that stay; a removed backend's state lives on only until its
  in-flight requests end, so `end` after a swap never fails and nothing leaks.
- Passive ejection never leaves more than `max_ejection_percent` of a model's backends
  ejected (so with one backend, never); active readiness failures remove backends regardless.
- Engine gauges (`observe_load`, from the health checker's scrapes) count only while younger
  than `load_gauge_ttl_s`: a stale or missing gauge never marks a backend full or loaded. A
  backend whose fresh gauges say its frontend admits nothing more (`full`) is picked only when
  every candidate is; `saturated` says when that is so (flow control then holds the request).
- Prefix affinity: a prefix seen before goes to the candidate below its load cap with the
  best score (prefix match + load); with equal loads that is the backend the prefix was
  assigned. Load is work, not requests: each in-flight request counts its `Pick.cost` (1 for a
  cache miss, `hit_cost` where its prefix is cached), so callers pass the Pick's cost to both
  `begin` and `end`; a backend's `work` is 0 whenever nothing of ours is in flight there.
  The prefix table holds at most `max_affinity_keys` entries per (alias, versions), each with
  at most `MAX_HOLDERS` other backends that served it, and forgets a prefix idle for
  `affinity_key_ttl_s`.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

from paved.gateway.errors import GatewayError, NoBackendError
from paved.gateway.routing.routes import Backend, ModelRoute, RoutesTable

logger = logging.getLogger(__name__)

# 160 points per unit of weight (ketama's count): each backend's share of the ring is within
# a few percent of its weight's share.
VNODES_PER_WEIGHT = 160
MAX_VNODES_PER_BACKEND = 1024
MAX_RING_POINTS = 262_144
# A backend takes a new prefix while it holds fewer than ceil(f) + floor((PREFIX_BOUND - 1) * f)
# of the live ones, f its fair share: exact balance for a few prefixes (where hashing's spread is
# widest relative to the count), 10 % of room for many (so placement stays the hash's and does
# not hinge on arrival order: two replicas seeing 2000 prefixes in opposite orders agree on ~96 %).
PREFIX_BOUND = 1.1
# Prefix match scores: the backend a prefix is assigned to holds it in its cache (1); one that
# served it when load moved a request off the owner probably still holds it, but may have
# evicted it since, and keeping the owner ahead keeps each prefix cached mostly in one place
# (every prefix cached everywhere would cut each cache's room to its share, as round robin does).
PREFIX_MATCH_OWNER = 1.0
PREFIX_MATCH_HOLDER = 0.5
MAX_HOLDERS = 4
# A holder counts for this many requests begun on it after it served the prefix: a spilled
# prefix sits in the other cache's free blocks and goes at the next evictions (in the bench's
# 169-block caches, after ~8 requests); a bigger cache keeps it longer, and forgetting it early
# only costs a spill at the owner's margin instead of the holder's.
HOLDER_FRESH_REQUESTS = 8
# Two scores this close are a tie (float sums of the same terms in another order).
_SCORE_EPS = 1e-9


@dataclass(frozen=True)
class Pick:
    backend: Backend
    alias: str
    version: str
    # The request's expected work at `backend` relative to a cache miss (1): pass it to `begin`
    # and `end` so the backend's load counts work, not requests (prefix affinity: a request
    # whose prefix the backend holds costs `hit_cost`).
    cost: float = 1.0


@dataclass
class _State:
    url: str
    outstanding: int = 0
    consecutive_failures: int = 0
    ejected_until: float | None = None
    times_ejected: int = 0
    returned_at: float | None = None
    # Back from an ejection and not yet succeeded: one failure re-ejects it.
    probation: bool = False
    # None: not checked yet, served as ready (a fresh gateway serves at once; passive ejection
    # catches a dead backend before the first health round does).
    ready: bool | None = None
    # In the table in force; False for a removed backend kept until its requests end.
    routed: bool = True
    # The engine's own gauges (vllm:num_requests_waiting, vllm:kv_cache_usage_perc) as last
    # observed, and when (router clock); None: never observed.
    waiting: float = 0.0
    # The part of `waiting` that is not ours: the queue beyond our requests in flight there at
    # the scrape (other gateways' load). Ours already count in `work`; counting them twice, and
    # up to a scrape interval late, moved requests off an owner that had caught up (spills).
    foreign: float = 0.0
    kv_usage: float | None = None
    gauges_at: float | None = None
    # The frontend's admission at that scrape (paved_queued_sequences and its bound), and the
    # requests this router began and ended there since: its estimate moves with our own traffic
    # between scrapes, so a request of ours ending frees room at once.
    queued: float | None = None
    max_queued: float | None = None
    begun_since: int = 0
    ended_since: int = 0
    # Requests begun here, ever: a clock for how long a spilled prefix stays in its cache.
    started: int = 0
    # The in-flight requests' summed Pick.cost: what prefix affinity weighs as load.
    work: float = 0.0


class _Ring:
    """A consistent-hash ring over backends, `VNODES_PER_WEIGHT` points per unit of weight."""

    def __init__(self, backends: list[Backend]):
        counts = [min(MAX_VNODES_PER_BACKEND, max(1, round(VNODES_PER_WEIGHT * b.weight))) for b in backends]
        total = sum(counts)
        if total > MAX_RING_POINTS:
            counts = [max(1, c * MAX_RING_POINTS // total) for c in counts]
        points: list[tuple[int, int]] = []
        for index, (b, n) in enumerate(zip(backends, counts, strict=True)):
            for v in range(n):
                points.append((_hash64(f"{b.id}#{v}".encode()), index))
        points.sort()
        self.hashes = [h for h, _ in points]
        self.owners = [i for _, i in points]
        self.backends = backends
        self.ids = frozenset(b.id for b in backends)


class _Prefixes:
    """Which backend each recently seen prefix (its 64-bit hash) was assigned, which others
    served it since (holders, at most MAX_HOLDERS: id -> that backend's `started` count when it
    last did), and how many live prefixes each backend is assigned. LRU order: the first entry
    is the least recently seen."""

    def __init__(self) -> None:
        self.owner: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self.holders: dict[int, dict[str, int]] = {}
        self.count: dict[str, int] = {}

    def drop(self, key: int) -> None:
        backend_id, _ = self.owner.pop(key)
        self.holders.pop(key, None)
        left = self.count[backend_id] - 1
        if left:
            self.count[backend_id] = left
        else:
            del self.count[backend_id]

    def expire(self, now: float, ttl: float, limit: int) -> None:
        while self.owner:
            key, (_, seen) = next(iter(self.owner.items()))
            if now - seen < ttl and len(self.owner) <= limit:
                return
            self.drop(key)

    def assign(self, key: int, backend_id: str, now: float) -> None:
        entry = self.owner.get(key)
        if entry is not None and entry[0] == backend_id:
            self.owner[key] = (backend_id, now)
            self.owner.move_to_end(key)
            return
        if entry is not None:
            self.drop(key)
        self.owner[key] = (backend_id, now)
        self.count[backend_id] = self.count.get(backend_id, 0) + 1

    def hold(self, key: int, backend_id: str, started: int) -> None:
        """`backend_id`, not the owner, serves `key` (its cache will hold the prefix for a while)."""
        held = self.holders.setdefault(key, {})
        held.pop(backend_id, None)
        held[backend_id] = started
        if len(held) > MAX_HOLDERS:
            del held[next(iter(held))]  # insertion order: the least recently served


def _prefix_cap(fair: float) -> int:
    return math.ceil(fair) + math.floor((PREFIX_BOUND - 1) * fair)


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def not_found(model: str) -> GatewayError:
    """Worded exactly like errors.ModelNotAllowedError so the two cannot be told apart."""
    return GatewayError(
        404,
        f"The model '{model}' does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


class Router:
    def __init__(
        self,
        table: RoutesTable,
        *,
        eject_after_failures: int = 3,
        eject_base_s: float = 5.0,
        eject_max_s: float = 60.0,
        max_ejection_percent: float = 50.0,
        bounded_load: float = 1.25,
        bounded_load_slack: int = 8,
        affinity_key_ttl_s: float = 600.0,
        max_affinity_keys: int = 65_536,
        prefix_weight: float = 1.0,
        load_weight: float = 4.0,
        kv_weight: float = 1.0,
        load_smoothing: float = 12.0,
        hit_cost: float = 0.2,
        load_gauge_ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        region: str | None = None,
    ):
        # The gateway's own region: its backends are preferred; the others serve only when
        # none of them can (regional failover). Backends without a region count as local.
        self.region = region
        if eject_after_failures < 1:
            raise ValueError("eject_after_failures must be >= 1")
        if not (0 < eject_base_s <= eject_max_s):
            raise ValueError("need 0 < eject_base_s <= eject_max_s")
        if not 0 <= max_ejection_percent <= 100:
            raise ValueError("max_ejection_percent must be in 0..100")
        if not (bounded_load >= 1.0 and math.isfinite(bounded_load)):
            # Below 1 the capacities sum to less than the load and no backend may qualify.
            raise ValueError("bounded_load must be >= 1")
        if (
            isinstance(bounded_load_slack, bool)
            or not isinstance(bounded_load_slack, int)
            or bounded_load_slack < 0
        ):
            raise ValueError("bounded_load_slack must be an integer >= 0")
        if not (affinity_key_ttl_s > 0 and math.isfinite(affinity_key_ttl_s)):
            raise ValueError("affinity_key_ttl_s must be > 0")
        if max_affinity_keys < 1:
            raise ValueError("max_affinity_keys must be >= 1")
        for name, value in (
            ("prefix_weight", prefix_weight),
            ("load_weight", load_weight),
            ("kv_weight", kv_weight),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0")
        if not (load_smoothing > 0 and math.isfinite(load_smoothing)):
            raise ValueError("load_smoothing must be > 0")
        if isinstance(hit_cost, bool) or not isinstance(hit_cost, int | float) or not 0 < hit_cost <= 1:
            raise ValueError("hit_cost must be in (0, 1]")
        if not (load_gauge_ttl_s > 0 and math.isfinite(load_gauge_ttl_s)):
            raise ValueError("load_gauge_ttl_s must be > 0")
        self._eject_after = eject_after_failures
        self._eject_base = eject_base_s
        self._eject_max = eject_max_s
        self._max_eject_pct = max_ejection_percent
        self._bounded_load = bounded_load
        self._slack = bounded_load_slack
        self._key_ttl = affinity_key_ttl_s
        self._max_keys = max_affinity_keys
        self._prefix_weight = float(prefix_weight)
        self._load_weight = float(load_weight)
        self._kv_weight = float(kv_weight)
        self._smoothing = float(load_smoothing)
        self._hit_cost = float(hit_cost)
        self._gauge_ttl = load_gauge_ttl_s
        self._clock = clock
        self._rng = rng or random.Random()  # noqa: S311 (load spreading, not security)
        self._states: dict[str, _State] = {}
        self._table = table
        self._aliases_of: dict[str, tuple[str, ...]] = {}
        self._rings: dict[tuple[str, tuple[str, ...]], _Ring] = {}
        self._prefixes: dict[tuple[str, tuple[str, ...]], _Prefixes] = {}
        self._listeners: list[Callable[[RoutesTable], None]] = []
        self.set_table(table)

    # -- table ------------------------------------------------------------------------------

    @property
    def table(self) -> RoutesTable:
        return self._table

    def set_table(self, table: RoutesTable) -> None:
        """Swap the table. State of surviving ids is kept (readiness is reset when the id's
        url changed: it is a different server); removed ids drop once idle."""
        if not isinstance(table, RoutesTable):
            raise TypeError("set_table needs a RoutesTable")
        aliases_of: dict[str, list[str]] = {}
        urls: dict[str, str] = {}
        for route in table.models.values():
            for b in route.backends:
                aliases_of.setdefault(b.id, []).append(route.alias)
                urls[b.id] = b.url
        for backend_id, state in list(self._states.items()):
            if backend_id in urls:
                continue
            if state.outstanding > 0:
                state.routed = False
            else:
                del self._states[backend_id]
        for backend_id, url in urls.items():
            kept = self._states.get(backend_id)
            if kept is None:
                self._states[backend_id] = _State(url=url)
                continue
            kept.routed = True
            if kept.url != url:
                kept.url = url
                kept.ready = None
                kept.gauges_at = None
        self._aliases_of = {k: tuple(v) for k, v in aliases_of.items()}
        self._rings = {}
        # Prefix assignments survive a swap (a kept backend keeps its prefixes; one that left
        # is reassigned on its prefixes' next request); a removed alias's table goes.
        self._prefixes = {k: v for k, v in self._prefixes.items() if k[0] in table.models}
        self._table = table
        for listener in self._listeners:
            try:
                listener(table)
            except Exception:  # a listener's bug must not keep the table from serving
                logger.exception("routes table listener failed")

    def add_listener(self, listener: Callable[[RoutesTable], None]) -> None:
        """Call `listener(table)` after every `set_table` (synchronously, before any request
        can see the new table), and once now with the table in force."""
        self._listeners.append(listener)
        listener(self._table)

    def aliases(self) -> list[str]:
        return list(self._table.models)

    def models(self) -> list[ModelRoute]:
        """The routes of the table in force, in table order."""
        return list(self._table.models.values())

    @staticmethod
    def split_model(model: str) -> tuple[str, str | None]:
        """ "alias@version" -> (alias, version); "alias" -> (alias, None)."""
        alias, sep, version = model.partition("@")
        return alias, (version if sep else None)

    def route(self, model: str) -> ModelRoute:
        """The route of `model` ("alias" or "alias@version"); 404 for an unknown alias or a
        version no backend of it serves."""
        if not isinstance(model, str):
            raise not_found(str(model))
        alias, version = self.split_model(model)
        route = self._table.models.get(alias)
        if route is None or (version is not None and version not in route.versions):
            raise not_found(model)
        return route

    # -- picking ----------------------------------------------------------------------------

    def _sticky_version(self, route: ModelRoute, sticky_key: str) -> str:
        shares = sorted((v, s) for v, s in (route.split or {}).items() if s > 0)
        total = sum(s for _, s in shares)
        # Uniform in [0, 1), identical on every replica for the same key and alias.
        u = _hash64(f"{route.alias}\x00{sticky_key}".encode()) / 2**64
        acc = 0.0
        for version, share in shares:
            acc += share / total
            if u < acc:
                return version
        return shares[-1][0]

    def _versions(self, route: ModelRoute, pinned: str | None, sticky_key: str) -> tuple[str, ...]:
        if pinned is not None:
            return (pinned,)
        if route.current is not None:
            return (route.current,)
        if route.split is not None:
            return (self._sticky_version(route, sticky_key),)
        return route.versions

    def resolve_version(self, model: str, *, sticky_key: str) -> str | None:
        """The one version `pick(model, sticky_key=...)` serves from, or None when the route
        leaves several versions eligible (no pin, no `current`, no split). Callers that must
        know the version (caches keyed by it) pin "alias@<this>" for the pick."""
        route = self.route(model)
        _, pinned = self.split_model(model)
        versions = self._versions(route, pinned, sticky_key)
        return versions[0] if len(versions) == 1 else None

    def _available(self, backend_id: str, now: float) -> bool:
        state = self._states[backend_id]
        if state.ready is False:
            return False
        return not self._ejected(state, now)

    def _ejected(self, state: _State, now: float) -> bool:
        if state.ejected_until is None:
            return False
        if now < state.ejected_until:
            return True
        # The ejection ran out: the backend returns on probation.
        state.returned_at = state.ejected_until
        state.ejected_until = None
        state.consecutive_failures = 0
        state.probation = True
        return False

    def pick(
        self,
        model: str,
        *,
        sticky_key: str,
        affinity: bytes | None = None,
        exclude: Collection[str] = (),
    ) -> Pick:
        """A backend for one request to `model`. `sticky_key` (e.g. the tenant or user) keeps a
        caller on one version of a split; `affinity` (bytes of the prompt's leading tokens)
        keys prefix affinity; `exclude` lists ids already tried (retries)."""
        now = self._clock()
        route, versions, in_versions, candidates = self._candidates(model, sticky_key, exclude, now)
        if candidates:
            # A backend whose frontend says it admits nothing more would answer 503: another
            # with room (or unknown room) takes the request.
            roomy = [b for b in candidates if not self._full(self._states[b.id], now)]
            if roomy:
                candidates = roomy
        if self.region is not None and candidates:
            local = [b for b in candidates if b.region in (None, self.region)]
            if local:
                candidates = local
        if not candidates:
            n = len(in_versions)
            raise NoBackendError(
                f"No backend can serve model '{model}' right now: none of its {n} "
                f"backend{'s' if n != 1 else ''} is healthy."
            )
        if len(candidates) == 1:
            chosen = candidates[0]
        elif route.strategy == "weighted":
            chosen = self._rng.choices(candidates, weights=[b.weight for b in candidates])[0]
        elif route.strategy == "prefix_affinity" and affinity is not None:
            chosen, cost = self._affinity(route, versions, candidates, affinity)
            return Pick(chosen, route.alias, chosen.version, cost)
        else:
            chosen = self._least_outstanding(candidates)
        return Pick(chosen, route.alias, chosen.version)

    def saturated(self, model: str, *, sticky_key: str, exclude: Collection[str] = ()) -> bool:
        """True when every backend `pick` could choose for `model` has fresh gauges saying its
        frontend admits nothing more: forwarding would only earn a 503 `overloaded`. False when
        any candidate has room or unknown room (no gauges, stale ones, a frontend that exports
        no admission bound), and when there is no candidate at all (pick says why)."""
        now = self._clock()
        candidates = self._candidates(model, sticky_key, exclude, now)[3]
        return bool(candidates) and all(self._full(self._states[b.id], now) for b in candidates)

    def _candidates(
        self, model: str, sticky_key: str, exclude: Collection[str], now: float
    ) -> tuple[ModelRoute, tuple[str, ...], list[Backend], list[Backend]]:
        """(route, versions, the backends of those versions, the ones that may take a request
        now: weight > 0, not excluded, available), as `pick` and `saturated` both read them."""
        route = self.route(model)
        _, pinned = self.split_model(model)
        versions = self._versions(route, pinned, sticky_key)
        in_versions = [b for b in route.backends if b.version in versions]
        candidates = [
            b for b in in_versions if b.weight > 0 and b.id not in exclude and self._available(b.id, now)
        ]
        return route, versions, in_versions, candidates

    def _full(self, state: _State, now: float) -> bool:
        if state.max_queued is None or state.queued is None or not self._fresh(state, now):
            return False
        return state.queued + state.begun_since - state.ended_since >= state.max_queued

    def _least_outstanding(self, candidates: list[Backend]) -> Backend:
        # (outstanding + 1) / weight: when all are idle the heavier backend still wins, and a
        # weight-2 backend takes a second request before a weight-1 one takes its first.
        best: list[Backend] = []
        best_score = math.inf
        for b in candidates:
            score = (self._states[b.id].outstanding + 1) / b.weight
            if score < best_score:
                best, best_score = [b], score
            elif score == best_score:
                best.append(b)
        return best[0] if len(best) == 1 else self._rng.choice(best)

    def _ring(self, route: ModelRoute, versions: tuple[str, ...]) -> _Ring:
        key = (route.alias, versions)
        ring = self._rings.get(key)
        if ring is None:
            ring = _Ring([b for b in route.backends if b.version in versions and b.weight > 0])
            self._rings[key] = ring
        return ring

    def _affinity(
        self, route: ModelRoute, versions: tuple[str, ...], candidates: list[Backend], affinity: bytes
    ) -> tuple[Backend, float]:
        """Prefix-aware, load-aware choice in three steps.

        Prefixes: consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).
        A new prefix walks clockwise from its point to the first candidate holding fewer than
        _prefix_cap(f) of the K live prefixes, f = (K + 1) * w / W (w its weight, W the
        candidates' total), and stays assigned there; hashing alone lands a few prefixes
        unevenly (16 on 2 backends: often 10/6), and the busier cache then overflows.

        Load is work, not requests (issue 22, 2b): a request costs 1 where it misses the prefix
        cache and `hit_cost` (0.2) at the prefix's owner ((1 + hit_cost) / 2 at a backend that
        served it recently), since a hit skips most of the prefill; each backend's load is the
        summed cost of our requests in flight there plus the other gateways' requests waiting
        in its engine (its `vllm:num_requests_waiting` beyond our requests there at the scrape;
        ours are in the work already, and counting them again, a scrape late, pushed requests
        off an owner that had caught up).

        Load cap (a hard guard): a candidate takes the request only while its work is below
        max(ceil(c * f), ceil(f) + slack) of the T in flight (work), f = (T + cost) * w / W, cost
        this request's there (with every cost 1: a cap on requests). Both caps sum to more than
        the load, so some candidate is always below them.

        Score (as llm-d's scheduler weighs a prefix-cache, a queue and a KV-utilization scorer):
        among the candidates below the cap, the highest
            prefix_weight * match + load_weight * (1 - (L - L_min) / (L_mean + smoothing))
            + kv_weight * (1 - kv_usage)
        wins; match is 1 for the prefix's owner, 0.5 for a backend that served it since, else 0;
        L = (its load + this request's cost there) / weight, L_min and L_mean over the
        candidates; the KV term counts only when every candidate's gauge is fresh. With the
        defaults (1, 4, smoothing 12, hit_cost 0.2) the owner keeps a prefix until its work
        leads the least loaded candidate's by a quarter of (L_mean + 12) plus the 0.8 a miss
        adds there: about 4 (20 cached requests' worth) on an idle pair. Counted in requests (a hit
        as dear as a miss), that margin was 4 to 7 requests and the owner of a prefix whose
        requests all hit shed requests to the other cache at every swing of a closed loop; each
        such spill is a full prefill there and evicts another prompt's blocks, about two misses
        more, and the caches polluted each other (an offline model of //bench:gateway's prefix
        part, libs/tests/gateway/prefix_model.py: hit ratio vs round robin 1.25 counted in
        requests, 1.57 in work, first token faster than round robin in both, the owner's
        in-flight peak (p99) 29 of 32 vs round robin's 30). A prefix whose requests outgrow its
        owner (a hot prefix) still spills: its requests pile up work like any others. Ties go
        to the owner, then clockwise from the prefix's point, so gateway replicas with the same
        view agree."""
        ring = self._ring(route, versions)
        now = self._clock()
        point = _hash64(affinity)
        table_key = (route.alias, versions)
        prefixes = self._prefixes.get(table_key)
        if prefixes is None:
            prefixes = self._prefixes[table_key] = _Prefixes()
        # Room for this prefix: the table never holds more than max_affinity_keys.
        prefixes.expire(now, self._key_ttl, self._max_keys - 1)
        by_id = {b.id: b for b in candidates}
        weight = sum(b.weight for b in candidates)
        start = bisect.bisect_left(ring.hashes, point)

        entry = prefixes.owner.get(point)
        owner_id = entry[0] if entry is not None else None
        if owner_id is None or owner_id not in ring.ids:
            # New, forgotten, or its backend left the route: assign it now.
            if owner_id is not None:
                prefixes.drop(point)
            live = sum(prefixes.count.get(i, 0) for i in by_id)
            chosen = self._walk(
                ring,
                start,
                lambda b: prefixes.count.get(b.id, 0) < _prefix_cap((live + 1) * b.weight / weight),
                by_id,
            )
            owner_id = chosen.id if chosen is not None else candidates[0].id
        prefixes.assign(point, owner_id, now)

        c = route.bounded_load if route.bounded_load is not None else self._bounded_load
        slack = route.bounded_load_slack if route.bounded_load_slack is not None else self._slack
        holders = prefixes.holders.get(point, {})
        matches = {b.id: self._match(b, owner_id, holders) for b in candidates}
        # The request's expected work at each: 1 for a cache miss, hit_cost where it hits.
        costs = {i: 1.0 - (1.0 - self._hit_cost) * m for i, m in matches.items()}
        total = sum(self._states[i].work for i in by_id)

        def below_cap(b: Backend) -> bool:
            fair = (total + costs[b.id]) * b.weight / weight
            cap = max(math.ceil(c * fair), math.ceil(fair) + slack)
            return self._states[b.id].work < cap - _SCORE_EPS

        eligible = [b for b in candidates if below_cap(b)]
        if not eligible:
            # Unreachable while the caps sum to more than the load; kept as a guard.
            chosen = self._least_outstanding(candidates)
            return chosen, costs[chosen.id]
        chosen = self._best_scored(ring, start, eligible, owner_id, matches, costs, now)
        if chosen.id != owner_id:
            prefixes.hold(point, chosen.id, self._states[chosen.id].started)
        return chosen, costs[chosen.id]

    def _match(self, b: Backend, owner_id: str, holders: dict[str, int]) -> float:
        if b.id == owner_id:
            return PREFIX_MATCH_OWNER
        started = self._states[b.id].started
        if b.id in holders and started - holders[b.id] <= HOLDER_FRESH_REQUESTS:
            return PREFIX_MATCH_HOLDER
        return 0.0

    def _fresh(self, state: _State, now: float) -> bool:
        return state.gauges_at is not None and now - state.gauges_at < self._gauge_ttl

    def _load(self, state: _State, now: float) -> float:
        """Work at the backend: ours in flight (each its Pick.cost) plus the requests of others
        in its engine's waiting queue (fresh gauge; each counts as a miss, its prefix unknown)."""
        return state.work + (state.foreign if self._fresh(state, now) else 0.0)

    def _best_scored(
        self,
        ring: _Ring,
        start: int,
        eligible: list[Backend],
        owner_id: str,
        matches: dict[str, float],
        costs: dict[str, float],
        now: float,
    ) -> Backend:
        if len(eligible) == 1:
            return eligible[0]
        states = [self._states[b.id] for b in eligible]
        # The load each backend would carry with this request: a miss adds a full prefill there.
        raw = [self._load(s, now) + costs[b.id] for s, b in zip(states, eligible, strict=True)]
        loads = [r / b.weight for r, b in zip(raw, eligible, strict=True)]
        least = min(loads)
        scale = sum(raw) / sum(b.weight for b in eligible) + self._smoothing
        # The KV term only when every candidate's gauge is fresh: a missing one is not a 0.
        known = [s.kv_usage for s in states if s.kv_usage is not None and self._fresh(s, now)]
        kv = known if len(known) == len(states) else None
        scores: dict[str, float] = {}
        for i, b in enumerate(eligible):
            score = self._prefix_weight * matches[b.id] + self._load_weight * (
                1.0 - (loads[i] - least) / scale
            )
            if kv is not None:
                score += self._kv_weight * (1.0 - kv[i])
            scores[b.id] = score
        best = max(scores.values()) - _SCORE_EPS
        if scores.get(owner_id, -math.inf) >= best:
            return next(b for b in eligible if b.id == owner_id)
        by_id = {b.id: b for b in eligible}
        chosen = self._walk(ring, start, lambda b: scores[b.id] >= best, by_id)
        # Every eligible backend is on the ring (weight > 0, same versions): the walk finds one.
        return chosen if chosen is not None else max(eligible, key=lambda b: scores[b.id])

    @staticmethod
    def _walk(
        ring: _Ring, start: int, accept: Callable[[Backend], bool], by_id: dict[str, Backend]
    ) -> Backend | None:
        """The first candidate clockwise from `start` that `accept`s, each backend tried once."""
        n_points = len(ring.hashes)
        seen: set[int] = set()
        for step in range(n_points):
            index = ring.owners[(start + step) % n_points]
            if index in seen:
                continue
            seen.add(index)
            b = by_id.get(ring.backends[index].id)
            if b is not None and accept(b):
                return b
            if len(seen) == len(ring.backends):
                break
        return None

    # -- request accounting and passive ejection -------------------------------------------

    def begin(self, backend_id: str, cost: float = 1.0) -> None:
        """A request to `backend_id` starts (pair with exactly one `end`, given the same `cost`:
        its Pick.cost)."""
        state = self._states.get(backend_id)
        if state is None:
            # Picked under a table swapped out before the request began: track it until it ends.
            state = self._states[backend_id] = _State(url="", routed=False)
        state.outstanding += 1
        state.work += cost
        state.started += 1
        state.begun_since += 1

    def end(self, backend_id: str, *, ok: bool, cost: float = 1.0) -> None:
        """A request ends; ok=False for a connect error, 5xx, timeout or reset."""
        state = self._states.get(backend_id)
        if state is None:
            return
        state.outstanding = max(0, state.outstanding - 1)
        # Idle is exactly 0 (no float residue from the sums).
        state.work = max(0.0, state.work - cost) if state.outstanding else 0.0
        state.ended_since += 1
        if not state.routed:
            if state.outstanding == 0:
                del self._states[backend_id]
            return
        now = self._clock()
        if self._ejected(state, now):
            # A request begun before the ejection: its outcome says nothing new.
            return
        if ok:
            state.consecutive_failures = 0
            state.probation = False
            return
        state.consecutive_failures += 1
        if state.probation or state.consecutive_failures >= self._eject_after:
            self._maybe_eject(backend_id, state, now)

    def _maybe_eject(self, backend_id: str, state: _State, now: float) -> None:
        for alias in self._aliases_of.get(backend_id, ()):
            route = self._table.models[alias]
            allowed = math.floor(len(route.backends) * self._max_eject_pct / 100)
            ejected = sum(1 for b in route.backends if self._ejected(self._states[b.id], now))
            if ejected + 1 > allowed:
                return
        if state.returned_at is not None and now - state.returned_at >= self._eject_max:
            # Healthy for a long while since its last ejection: start the backoff over.
            state.times_ejected = 0
        state.times_ejected += 1
        state.ejected_until = now + min(self._eject_max, self._eject_base * state.times_ejected)
        state.probation = False
        state.consecutive_failures = 0

    def observe_load(
        self,
        backend_id: str,
        *,
        waiting: float,
        kv_usage: float | None = None,
        queued: float | None = None,
        max_queued: float | None = None,
    ) -> None:
        """A backend engine's gauges from a scrape: `waiting` (vllm:num_requests_waiting),
        `kv_usage` (vllm:kv_cache_usage_perc, a 0..1 fraction; None if not exported), and the
        frontend's admission count and bound (paved_queued_sequences, paved_max_queued_sequences;
        both or neither). Prefix affinity, `pick` and `saturated` use them while younger than
        `load_gauge_ttl_s`; unknown ids are ignored."""
        for name, value in (("waiting", waiting), ("queued", queued), ("max_queued", max_queued)):
            if value is None and name != "waiting":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if kv_usage is not None and (
            isinstance(kv_usage, bool) or not isinstance(kv_usage, int | float) or not 0 <= kv_usage <= 1
        ):
            raise ValueError(f"kv_usage must be a fraction in [0, 1], got {kv_usage!r}")
        if (queued is None) != (max_queued is None):
            raise ValueError("queued and max_queued go together")
        state = self._states.get(backend_id)
        if state is not None and state.routed:
            state.waiting = float(waiting)
            state.foreign = max(0.0, float(waiting) - state.outstanding)
            state.kv_usage = None if kv_usage is None else float(kv_usage)
            state.queued = None if queued is None else float(queued)
            state.max_queued = None if max_queued is None else float(max_queued)
            state.begun_since = state.ended_since = 0
            state.gauges_at = self._clock()

    def set_ready(self, backend_id: str, ready: bool) -> None:
        """The health checker's verdict; unknown ids (removed meanwhile) are ignored."""
        state = self._states.get(backend_id)
        if state is not None and state.routed:
            state.ready = bool(ready)

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per backend id: its load and health, for an admin view or metrics. `ready` is False
        only after a failed check (`checked` says whether one ran); `ejected_until` is on the
        router's clock (monotonic by default), None when not ejected; `affinity_prefixes` counts the
        live prefixes prefix affinity has assigned it; `gauges` the engine's last observed gauges
        (`age_s` on the router's clock, `full` as `pick` reads it now), None before any."""
        now = self._clock()
        prefixes: dict[str, int] = {}
        for table in self._prefixes.values():
            table.expire(now, self._key_ttl, self._max_keys)
            for backend_id, n in table.count.items():
                prefixes[backend_id] = prefixes.get(backend_id, 0) + n
        out: dict[str, dict[str, object]] = {}
        for backend_id, state in self._states.items():
            ejected = self._ejected(state, now)
            out[backend_id] = {
                "url": state.url,
                "outstanding": state.outstanding,
                "ready": state.ready is not False,
                "checked": state.ready is not None,
                "ejected_until": state.ejected_until if ejected else None,
                "times_ejected": state.times_ejected,
                "consecutive_failures": state.consecutive_failures,
                "routed": state.routed,
                "affinity_prefixes": prefixes.get(backend_id, 0),
                "gauges": None
                if state.gauges_at is None
                else {
                    "waiting": state.waiting,
                    "kv_usage": state.kv_usage,
                    "queued": state.queued,
                    "max_queued": state.max_queued,
                    "age_s": now - state.gauges_at,
                    "full": self._full(state, now),
                },
            }
        return out

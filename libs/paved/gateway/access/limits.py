"""Per-key and per-tenant limits: requests/min, tokens/min and concurrent requests.

`Limiter.acquire(principal, tokens)` admits one request for BOTH subjects of a principal (its
key, `principal.key_limits`, id `principal.key_id`; its tenant, `principal.tenant.limits`, id
`principal.tenant.id`) or for neither; `finish(reservation, used_tokens)` settles it.
`acquire(principal, tokens, tokens_only=True)` is the same for the tokens/min buckets alone: the
gateway's own calls on a request's behalf (conversation summaries, cache embeddings) spend the
caller's tokens but are not requests of its own nor concurrent slots.

Semantics (identical in `InProcessLimiter` and `RedisLimiter`):
- requests/min and tokens/min are token buckets: capacity = the per-minute limit, refilled
  continuously at limit/60 per second, starting full. A request is admitted only if every
  bucket holds its full amount (1 request; `tokens` tokens), so the tokens admitted by one
  subject in any interval T never exceed capacity + capacity/60 * T.
- max_concurrent counts live reservations. Each holds a lease of `lease_s` (default 10 min):
  `finish` frees the slot, and a slot whose request never finished (a crashed replica, a lost
  task) frees itself when its lease runs out. A request outliving its lease loses its slot
  and its reservation: its `finish` is then a no-op and the reserved tokens stay charged.
- All-or-nothing: if any limit of either subject refuses, nothing is taken and
  `RateLimitedError` (429, Retry-After, x-ratelimit-* headers) names the limit and subject.
- A request needing more tokens than a tokens/min capacity could never pass, so it is refused
  at once with `GatewayError(429, code="tokens_exceed_limit")` and no Retry-After. A limit of 0
  requests or 0 concurrent requests (a key that admits nothing) is a `RateLimitedError` with
  Retry-After 60, without consulting any store.
- `finish` is idempotent (a second call is a no-op, so streamed usage never counts twice). It
  frees the slot; `used_tokens=None` (failed or disconnected before usage was known) refunds the
  whole token reservation; otherwise reserved - used is refunded, or used - reserved charged
  (the bucket may go into debt, delaying the subject's next requests). Requests/min is never
  refunded. Refunds never fill a bucket beyond its capacity.
- `None` in `Limits` means no limit of that kind and costs nothing; a principal without any
  limit is admitted without touching the store (no Redis round trip).
- Response headers follow OpenAI: x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the
  tighter (fewer remaining) of key and tenant; kinds unlimited for both are omitted.

`RedisLimiter` shares the limits between gateway replicas: one acquire is ONE Lua script over
all the subjects' keys, timed by Redis `TIME` (never a replica's clock), so no replica can slip
between another's check and increment. Every key carries a TTL (a bucket's lasts until it would
be full again) so idle subjects vanish. A connection error is retried once on a fresh
connection (a restarted Redis breaks every pooled connection once); an acquire is idempotent
per reservation id, so its retry never counts a request twice. An acquire that fails or is
cancelled once its script may have been sent (its reply lost: past the deadline, the caller
gone) is undone in the background by the same id, so what it may have taken does not stay
taken for the lease (see `_LUA_FINISH`). Redis errors and timeouts fail
closed: every call is bounded by `timeout_s`; acquire and snapshot then raise
`GatewayError(503, code="limiter_unavailable")` with Retry-After 1 rather than admitting
unlimited traffic or hanging. `finish` does not raise for an outage: it comes after the backend
did the work, and a 503 then would make the client retry and have it done twice; the outage is
logged, the slot frees itself with its lease and the reserved tokens stay charged. One
RedisLimiter serves one event loop (redis-py's asyncio connections are bound to it). The keys of
one principal live on different hash slots, so Redis Cluster is not supported (use one primary).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from paved.gateway.errors import GatewayError, RateLimitedError
from paved.gateway.types import Limits, Principal

__all__ = [
    "DEFAULT_LEASE_S",
    "InProcessLimiter",
    "Limiter",
    "RedisLimiter",
    "Reservation",
    "format_duration",
    "make_limiter",
]

# Not __name__: that is under "paved.gateway.access", the access log's logger, and a limiter
# warning is no access line.
log = logging.getLogger("paved.gateway.limits")

DEFAULT_LEASE_S = 600.0
# Kinds, as they appear in Redis keys (equal lengths keep key names unambiguous).
_RPM, _TPM, _CON = "rpm", "tpm", "con"
_LABELS = {_RPM: "requests per minute", _TPM: "tokens per minute", _CON: "concurrent requests"}
_SNAPSHOT_NAMES = {_RPM: "requests_per_min", _TPM: "tokens_per_min", _CON: "max_concurrent"}
# In-process: a sweep of idle state every this many acquires keeps memory proportional to the
# subjects active in the last minute (amortised O(1) per acquire).
_SWEEP_EVERY = 1024
# Tries (1 s apart) to undo an admission whose reply was lost before its lease is left to it.
_UNDO_TRIES = 5


@dataclass(frozen=True)
class _Limit:
    """One limit of one subject, and what this request needs from it."""

    subject: str  # "key" or "tenant"
    subject_id: str  # what the counters are keyed by
    label: str  # what messages call it: the key's id, the tenant's name (not its internal id)
    kind: str
    capacity: int
    need: int

    @property
    def rate(self) -> float:
        """Refill per second (buckets only)."""
        return self.capacity / 60.0

    @property
    def name(self) -> str:
        return f"{self.subject} '{self.label}'"


@dataclass
class Reservation:
    """One admitted request. `headers` are the x-ratelimit-* headers for its response."""

    id: str  # unique per admission
    tokens: int  # tokens reserved
    headers: dict[str, str]
    # The tokens/min and concurrency limits `finish` settles (requests/min is never refunded).
    _held: tuple[_Limit, ...] = field(default=(), repr=False, compare=False)
    _finished: bool = field(default=False, repr=False, compare=False)


class Limiter(Protocol):
    async def acquire(
        self, principal: Principal, tokens: int, *, tokens_only: bool = False
    ) -> Reservation: ...

    async def finish(self, reservation: Reservation, used_tokens: int | None) -> None: ...

    async def snapshot(self, principal: Principal) -> dict[str, Any]: ...

    async def close(self) -> None: ...


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: "0s", "250ms" below a second, else whole seconds rounded up
    ("1s", "59s", "6m0s", "1h2m3s")."""
    if not seconds > 0:
        return "0s"
    ms = math.ceil(seconds * 1000 - 1e-6)
    if ms < 1000:
        return f"{max(ms, 1)}ms"
    total = math.ceil(ms / 1000)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _plan(
    principal: Principal, tokens: int, *, refuse: bool = True, tokens_only: bool = False
) -> list[_Limit]:
    """The limits this request must pass, key first (only tokens/min with `tokens_only`); with
    `refuse`, raises at once for what no wait can ever admit."""
    limits: list[_Limit] = []
    subjects: tuple[tuple[str, str, str, Limits], ...] = (
        ("key", principal.key_id, principal.key_id, principal.key_limits),
        ("tenant", principal.tenant.id, principal.tenant.name, principal.tenant.limits),
    )
    for subject, subject_id, label, config in subjects:
        for kind, capacity, need in (
            (_RPM, config.requests_per_min, 1),
            (_TPM, config.tokens_per_min, tokens),
            (_CON, config.max_concurrent, 1),
        ):
            if capacity is None or (tokens_only and kind != _TPM):
                continue
            if not _is_count(capacity):
                raise ValueError(f"{subject} {subject_id!r}: {_SNAPSHOT_NAMES[kind]} must be an int >= 0")
            limits.append(_Limit(subject, subject_id, label, kind, capacity, need))
    for lim in limits:
        if not refuse or lim.need <= lim.capacity:
            continue
        if lim.kind == _TPM:
            # Retrying can never help, so no Retry-After: the caller must ask for fewer tokens.
            raise GatewayError(
                429,
                f"This request needs {lim.need} tokens (prompt + max_tokens), more than the "
                f"{lim.capacity} tokens per minute {lim.name} allows: it can never be admitted. "
                "Lower max_tokens or shorten the prompt.",
                code="tokens_exceed_limit",
            )
        raise RateLimitedError(f"Rate limit: {lim.name} allows 0 {_LABELS[lim.kind]}.", retry_after_s=60)
    return limits


def _headers(limits: Sequence[_Limit], values: Sequence[float]) -> dict[str, str]:
    """x-ratelimit-* for the tighter subject of each bucket kind (fewer remaining, then the
    smaller limit)."""
    out: dict[str, str] = {}
    for kind, word in ((_RPM, "requests"), (_TPM, "tokens")):
        best: tuple[tuple[int, int], _Limit, float] | None = None
        for lim, value in zip(limits, values, strict=True):
            if lim.kind != kind:
                continue
            rank = (max(0, math.floor(value)), lim.capacity)
            if best is None or rank < best[0]:
                best = (rank, lim, value)
        if best is not None:
            (remaining, _), lim, value = best
            reset = (lim.capacity - value) / lim.rate if lim.capacity > 0 else 0.0
            out[f"x-ratelimit-limit-{word}"] = str(lim.capacity)
            out[f"x-ratelimit-remaining-{word}"] = str(remaining)
            out[f"x-ratelimit-reset-{word}"] = format_duration(reset)
    return out


def _refusal(limits: Sequence[_Limit], values: Sequence[float]) -> RateLimitedError:
    """The 429 for a refused acquire; `values` are the state before it (nothing was taken)."""
    reasons: list[str] = []
    retry = 0.0
    for lim, value in zip(limits, values, strict=True):
        if lim.kind == _CON:
            if value + lim.need <= lim.capacity:
                continue
            # A slot frees when some request finishes: nothing says when, so retry soon.
            wait = 1.0
            reasons.append(f"{lim.name} has {int(value)} of {lim.capacity} {_LABELS[_CON]} in flight")
        else:
            if value >= lim.need:
                continue
            wait = (lim.need - value) / lim.rate
            reasons.append(
                f"{lim.name} on {_LABELS[lim.kind]}: limit {lim.capacity}, "
                f"remaining {max(0, math.floor(value))}, requested {lim.need}"
            )
        retry = max(retry, wait)
    message = f"Rate limit reached for {'; '.join(reasons)}. Retry after {format_duration(retry)}."
    return RateLimitedError(message, retry_after_s=retry, headers=_headers(limits, values))


def _check_tokens(tokens: object) -> None:
    if not _is_count(tokens):
        raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")


def _check_used(used_tokens: object) -> None:
    if used_tokens is not None and not _is_count(used_tokens):
        raise ValueError(f"used_tokens must be None or an int >= 0, got {used_tokens!r}")


def _refund(reservation: Reservation, used_tokens: int | None) -> int:
    """Tokens to give back to each tokens/min bucket (negative: extra to charge)."""
    return reservation.tokens if used_tokens is None else reservation.tokens - used_tokens


class _BaseLimiter:
    """The store-independent half: planning, headers, refusals, idempotent finish."""

    def __init__(self, lease_s: float):
        if not (isinstance(lease_s, int | float) and math.isfinite(lease_s) and lease_s > 0):
            raise ValueError(f"lease_s must be a positive number of seconds, got {lease_s!r}")
        self._lease_s = float(lease_s)

    async def acquire(self, principal: Principal, tokens: int, *, tokens_only: bool = False) -> Reservation:
        """Admits one request of `tokens` tokens for the key and the tenant, or raises
        RateLimitedError / GatewayError (see the module docstring) having taken nothing;
        `tokens_only`: the tokens/min buckets alone (no request counted, no slot held)."""
        _check_tokens(tokens)
        limits = _plan(principal, tokens, tokens_only=tokens_only)
        rid = uuid.uuid4().hex
        if not limits:
            return Reservation(rid, tokens, {})
        admitted, values = await self._admit(rid, limits)
        if not admitted:
            raise _refusal(limits, values)
        held = tuple(lim for lim in limits if lim.kind != _RPM)
        return Reservation(rid, tokens, _headers(limits, values), _held=held)

    async def finish(self, reservation: Reservation, used_tokens: int | None) -> None:
        """Frees the slot and reconciles tokens; idempotent (see the module docstring)."""
        _check_used(used_tokens)
        if reservation._finished:
            return
        if reservation._held:
            try:
                await self._release(reservation, _refund(reservation, used_tokens))
            except GatewayError as exc:
                if exc.code != "limiter_unavailable":
                    raise
                # The store already logged the outage (once per 10 s). Not marked finished: a
                # caller may still call again.
                return
        reservation._finished = True

    async def snapshot(self, principal: Principal) -> dict[str, Any]:
        """Remaining capacity per subject and limit, for an admin/debug view, e.g.
        {"key": {"id": "k1", "tokens_per_min": {"limit": 1000, "remaining": 400, "reset_s":
        36.0}, "max_concurrent": {"limit": 4, "in_use": 1, "remaining": 3}}, "tenant": {...}}.
        Read-only; unlimited kinds are omitted."""
        limits = _plan(principal, 0, refuse=False)
        values = await self._read(limits) if limits else []
        out: dict[str, Any] = {
            "key": {"id": principal.key_id},
            "tenant": {"id": principal.tenant.id},
        }
        for lim, value in zip(limits, values, strict=True):
            entry: dict[str, int | float]
            if lim.kind == _CON:
                entry = {
                    "limit": lim.capacity,
                    "in_use": int(value),
                    "remaining": max(0, lim.capacity - int(value)),
                }
            else:
                reset = (lim.capacity - value) / lim.rate if lim.capacity > 0 else 0.0
                entry = {
                    "limit": lim.capacity,
                    "remaining": max(0, math.floor(value)),
                    "reset_s": round(reset, 3),
                }
            out[lim.subject][_SNAPSHOT_NAMES[lim.kind]] = entry
        return out

    async def close(self) -> None:
        return None

    # The store: all-or-nothing admission, settling, and reading.
    async def _admit(self, rid: str, limits: list[_Limit]) -> tuple[bool, list[float]]:
        """(admitted, values): each limit's bucket level / live count after the admission, or
        before it when refused."""
        raise NotImplementedError

    async def _release(self, reservation: Reservation, refund: int) -> None:
        raise NotImplementedError

    async def _read(self, limits: list[_Limit]) -> list[float]:
        raise NotImplementedError


class InProcessLimiter(_BaseLimiter):
    """Limits held in this process: correct for ONE gateway replica (each replica would
    otherwise grant the full limits). `clock` (seconds, monotonic) is injectable for tests.
    Thread-safe; every operation is O(limits) under one lock, never awaiting while held."""

    def __init__(self, *, lease_s: float = DEFAULT_LEASE_S, clock: Callable[[], float] = time.monotonic):
        super().__init__(lease_s)
        self._clock = clock
        self._lock = threading.Lock()
        # (subject, id, kind) -> (level, when): a missing bucket is full.
        self._buckets: dict[tuple[str, str, str], tuple[float, float]] = {}
        # (subject, id) -> {reservation id: lease expiry}
        self._slots: dict[tuple[str, str], dict[str, float]] = {}
        # Unfinished reservations holding something: id -> lease expiry.
        self._live: dict[str, float] = {}
        self._ops = 0

    def _level(self, lim: _Limit, now: float) -> float:
        state = self._buckets.get((lim.subject, lim.subject_id, lim.kind))
        if state is None:
            return float(lim.capacity)
        level, when = state
        return min(float(lim.capacity), level + max(0.0, now - when) * lim.rate)

    def _live_slots(self, lim: _Limit, now: float) -> dict[str, float]:
        slots = self._slots.setdefault((lim.subject, lim.subject_id), {})
        for rid in [rid for rid, expiry in slots.items() if expiry <= now]:
            del slots[rid]
        return slots

    def _sweep(self, now: float) -> None:
        # A full bucket is the same as none; an expired lease is the same as a finished one.
        for bkey, (level, when) in list(self._buckets.items()):
            if level >= 0 and when <= now - 60.0:  # any bucket with level >= 0 refills in 60 s
                del self._buckets[bkey]
        for skey, slots in list(self._slots.items()):
            for rid in [rid for rid, expiry in slots.items() if expiry <= now]:
                del slots[rid]
            if not slots:
                del self._slots[skey]
        for rid in [rid for rid, expiry in self._live.items() if expiry <= now]:
            del self._live[rid]

    async def _admit(self, rid: str, limits: list[_Limit]) -> tuple[bool, list[float]]:
        with self._lock:
            now = self._clock()
            self._ops += 1
            if self._ops % _SWEEP_EVERY == 0:
                self._sweep(now)
            values: list[float] = []
            admitted = True
            for lim in limits:
                if lim.kind == _CON:
                    live = len(self._live_slots(lim, now))
                    values.append(float(live))
                    admitted = admitted and live + lim.need <= lim.capacity
                else:
                    level = self._level(lim, now)
                    values.append(level)
                    admitted = admitted and level >= lim.need
            if not admitted:
                return False, values
            after: list[float] = []
            held = False
            expiry = now + self._lease_s
            for lim, value in zip(limits, values, strict=True):
                if lim.kind == _CON:
                    self._slots[(lim.subject, lim.subject_id)][rid] = expiry
                    after.append(value + lim.need)
                else:
                    self._buckets[(lim.subject, lim.subject_id, lim.kind)] = (value - lim.need, now)
                    after.append(value - lim.need)
                held = held or lim.kind != _RPM
            if held:
                self._live[rid] = expiry
            return True, after

    async def _release(self, reservation: Reservation, refund: int) -> None:
        with self._lock:
            now = self._clock()
            expiry = self._live.pop(reservation.id, None)
            if expiry is None or expiry <= now:
                return
            for lim in reservation._held:
                if lim.kind == _CON:
                    self._slots.get((lim.subject, lim.subject_id), {}).pop(reservation.id, None)
                elif lim.capacity > 0:
                    level = min(float(lim.capacity), self._level(lim, now) + refund)
                    self._buckets[(lim.subject, lim.subject_id, lim.kind)] = (level, now)

    async def _read(self, limits: list[_Limit]) -> list[float]:
        with self._lock:
            now = self._clock()
            return [
                float(sum(1 for e in self._slots.get((lim.subject, lim.subject_id), {}).values() if e > now))
                if lim.kind == _CON
                else self._level(lim, now)
                for lim in limits
            ]


# ---- Redis ------------------------------------------------------------------------------------
# Shared Lua: a bucket is a hash {l: level, t: Redis time of l}; a missing one is full. Numbers
# are stored with %.17g so doubles round-trip exactly. A bucket's TTL is the time it takes to
# refill (plus 1 s): when it vanishes it would have been full anyway.
_LUA_BUCKET = """
local function level(key, cap, now)
  local st = redis.call('HMGET', key, 'l', 't')
  if not st[1] then return cap end
  local dt = now - tonumber(st[2])
  if dt < 0 then
    -- Written later than now: Redis's clock stepped back (or a failover reached a server whose
    -- clock is behind). The refill restarts from now; left as it was, a drained bucket stayed
    -- drained (and its key alive) until the clock caught up, however long the step.
    redis.call('HSET', key, 't', string.format('%.17g', now))
    dt = 0
  end
  return math.min(cap, tonumber(st[1]) + dt * cap / 60)
end
local function store(key, cap, lvl, now)
  redis.call('HSET', key, 'l', string.format('%.17g', lvl), 't', string.format('%.17g', now))
  local ms = 1000
  if cap > 0 then ms = math.ceil((cap - lvl) * 60000 / cap) + 1000 end
  redis.call('PEXPIRE', key, ms)
  return lvl
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# KEYS[1]: the reservation's marker; KEYS[1+i]: limit i. ARGV[1]: lease (s); ARGV[2]: reservation
# id; ARGV[3]: replay window (ms); limit i: ARGV[3i+1] kind, ARGV[3i+2] capacity, ARGV[3i+3]
# need. Checks everything, then writes everything or nothing. Returns {1|0, value_1, ...}
# (values as strings: Lua numbers would be truncated to integers).
# Idempotent per reservation id: an admission stores its reply in the marker, and a second run
# with the same id (the client's retry after a connection error that lost the first reply)
# returns that reply without counting the request again. The marker of a reservation holding
# nothing to settle (requests/min only) lives for the replay window alone: no finish deletes it.
# A marker '-' is an undone reservation (see _LUA_FINISH): an acquire arriving after its undo
# admits nothing.
_LUA_ACQUIRE = (
    _LUA_BUCKET
    + """
local done = redis.call('GET', KEYS[1])
if done == '-' then return {0} end
if done then
  local out = {1}
  for v in string.gmatch(done, '[^,]+') do out[#out + 1] = v end
  return out
end
local lease = tonumber(ARGV[1])
local rid = ARGV[2]
local n = #KEYS - 1
local vals = {}
local ok = true
for i = 1, n do
  local key, kind = KEYS[i + 1], ARGV[3 * i + 1]
  local cap, need = tonumber(ARGV[3 * i + 2]), tonumber(ARGV[3 * i + 3])
  if kind == 'con' then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    vals[i] = redis.call('ZCARD', key)
    if vals[i] + need > cap then ok = false end
  else
    vals[i] = level(key, cap, now)
    if vals[i] < need then ok = false end
  end
end
local held = false
if ok then
  for i = 1, n do
    local key, kind = KEYS[i + 1], ARGV[3 * i + 1]
    local cap, need = tonumber(ARGV[3 * i + 2]), tonumber(ARGV[3 * i + 3])
    if kind == 'con' then
      redis.call('ZADD', key, now + lease, rid)
      redis.call('PEXPIRE', key, math.ceil(lease * 1000) + 1000)
      vals[i] = vals[i] + need
    else
      vals[i] = store(key, cap, vals[i] - need, now)
    end
    if kind ~= 'rpm' then held = true end
  end
end
local out = {ok and 1 or 0}
for i = 1, n do out[i + 1] = string.format('%.17g', vals[i]) end
if ok then
  local ttl = tonumber(ARGV[3])
  if held then ttl = math.ceil(lease * 1000) end
  redis.call('SET', KEYS[1], table.concat(out, ',', 2), 'PX', ttl)
end
return out
"""
)

# KEYS[1]: the marker; KEYS[1+i]: limit i. ARGV[1]: reservation id; ARGV[2]: 0 for a finish,
# else the undo of an acquire whose reply was lost: how long (ms) its tombstone lives; limit i:
# ARGV[3i] kind, ARGV[3i+1] capacity, ARGV[3i+2] token refund (negative: extra charge).
# Deleting the marker is the idempotence: only the first finish (on any replica) finds it. An
# undo that finds no marker may have overtaken its acquire (still on its way to Redis): it
# leaves the tombstone '-', which that acquire reads as "admit nothing". Returns 1, or 0 if
# no-op.
_LUA_FINISH = (
    _LUA_BUCKET
    + """
local done = redis.call('GET', KEYS[1])
if not done then
  local tomb = tonumber(ARGV[2])
  if tomb > 0 then redis.call('SET', KEYS[1], '-', 'PX', tomb) end
  return 0
end
if done == '-' then return 0 end
redis.call('DEL', KEYS[1])
for i = 1, #KEYS - 1 do
  local key, kind = KEYS[i + 1], ARGV[3 * i]
  local cap, refund = tonumber(ARGV[3 * i + 1]), tonumber(ARGV[3 * i + 2])
  if kind == 'con' then
    redis.call('ZREM', key, ARGV[1])
  elseif cap > 0 then
    store(key, cap, math.min(cap, level(key, cap, now) + refund), now)
  end
end
return 1
"""
)

# Reads (it writes only the time of a bucket written later than now: see level). KEYS[i]: limit
# i; ARGV[2i-1] kind, ARGV[2i] capacity. Returns values as strings.
_LUA_READ = (
    _LUA_BUCKET
    + """
local out = {}
for i = 1, #KEYS do
  local key, kind, cap = KEYS[i], ARGV[2 * i - 1], tonumber(ARGV[2 * i])
  if kind == 'con' then
    out[i] = string.format('%.17g', redis.call('ZCOUNT', key, '(' .. now, '+inf'))
  else
    out[i] = string.format('%.17g', level(key, cap, now))
  end
end
return out
"""
)


@dataclass(frozen=True)
class _Script:
    source: str
    sha: str

    @classmethod
    def of(cls, source: str) -> _Script:
        return cls(source, hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest())


_ACQUIRE, _FINISH, _READ = _Script.of(_LUA_ACQUIRE), _Script.of(_LUA_FINISH), _Script.of(_LUA_READ)


class RedisLimiter(_BaseLimiter):
    """Limits shared by every gateway replica through one Redis (see the module docstring).

    Keys: `{key_prefix}{kind}:{subject}:{id}` (kind rpm|tpm|con, subject key|tenant) and
    `{key_prefix}res:{reservation id}` (the marker that makes finish idempotent). Connections
    come from a bounded pool (`max_connections`); waiting for one counts against `timeout_s`.
    """

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "paved:rl:",
        timeout_s: float = 0.5,
        lease_s: float = DEFAULT_LEASE_S,
        max_connections: int = 64,
    ):
        super().__init__(lease_s)
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError

        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("RedisLimiter url must start with redis://, rediss:// or unix://")
        if not isinstance(key_prefix, str) or not key_prefix:
            raise ValueError("key_prefix must be a non-empty string")
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not (isinstance(max_connections, int) and max_connections > 0):
            raise ValueError(f"max_connections must be a positive int, got {max_connections!r}")
        self._prefix = key_prefix
        self._timeout_s = float(timeout_s)
        # A pooled connection whose server restarted fails on its next use (every idle one in
        # the pool does, once): so a connection error is retried once, at once, on a fresh
        # socket (redis-py closes the failed one and reconnects). Timeouts are not retried: one
        # deadline covers the whole call, and failing fast (503 + Retry-After) beats silently
        # spending the request's latency budget. A retried command may already have run (the
        # connection broke after Redis had it): finish and read are idempotent, and acquire
        # replays its first reply by reservation id (see _LUA_ACQUIRE), so nothing counts twice.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=self._timeout_s,
            socket_timeout=self._timeout_s,
            socket_connect_timeout=self._timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        self._redis = aioredis.Redis.from_pool(pool)
        self._last_error_log = -math.inf
        # Undos of acquires whose reply was lost, running in the background (see _admit).
        self._undoing: set[asyncio.Task[None]] = set()

    def _key(self, lim: _Limit) -> str:
        return f"{self._prefix}{lim.kind}:{lim.subject}:{lim.subject_id}"

    def _marker(self, rid: str) -> str:
        return f"{self._prefix}res:{rid}"

    async def _eval(self, script: _Script, keys: list[str], args: list[str | int | float]) -> Any:
        from redis.exceptions import NoScriptError, RedisError

        try:
            async with asyncio.timeout(self._timeout_s):
                try:
                    return await self._redis.evalsha(script.sha, len(keys), *keys, *args)
                except NoScriptError:
                    # Redis restarted or SCRIPT FLUSH: load once, then the sha works again.
                    await self._redis.script_load(script.source)
                    return await self._redis.evalsha(script.sha, len(keys), *keys, *args)
        except (RedisError, OSError, TimeoutError) as exc:
            now = time.monotonic()
            if now - self._last_error_log >= 10.0:  # one line per 10 s during an outage
                self._last_error_log = now
                log.warning(
                    "rate limiter: Redis call failed, refusing requests: %s: %s", type(exc).__name__, exc
                )
            raise GatewayError(
                503,
                "The rate limiter is unavailable; please retry shortly.",
                code="limiter_unavailable",
                headers={"Retry-After": "1"},
            ) from None

    async def _admit(self, rid: str, limits: list[_Limit]) -> tuple[bool, list[float]]:
        # A retry comes within the call's deadline, so the replay window outlasts it.
        args: list[str | int | float] = [repr(self._lease_s), rid, math.ceil(self._timeout_s * 1000) + 1000]
        for lim in limits:
            args += [lim.kind, lim.capacity, lim.need]
        try:
            reply = await self._eval(_ACQUIRE, [self._marker(rid), *map(self._key, limits)], args)
        except BaseException:
            # Past the deadline, or the caller cancelled (a gRPC client's deadline), after the
            # script may have been sent: it may run, or have run, with nobody to get its reply,
            # its slots and tokens taken for the whole lease (a key locked out for 10 min after
            # a Redis latency spike). Undo it by its id, in the background.
            held = [lim for lim in limits if lim.kind != _RPM]
            if held:
                task = asyncio.get_running_loop().create_task(self._undo(rid, held))
                self._undoing.add(task)
                task.add_done_callback(self._undoing.discard)
            raise
        return int(reply[0]) == 1, [float(v) for v in reply[1:]]

    async def _undo(self, rid: str, held: list[_Limit]) -> None:
        """Settle a reservation whose admission reply was lost as a request that never ran
        (all its tokens back), or, when its acquire has not run yet, leave the tombstone that
        makes it admit nothing. Retried while Redis is unavailable, a few times; the lease is
        the last resort."""
        args: list[str | int | float] = [rid, math.ceil(self._lease_s * 1000)]
        for lim in held:
            args += [lim.kind, lim.capacity, lim.need]
        keys = [self._marker(rid), *map(self._key, held)]
        for _ in range(_UNDO_TRIES):
            try:
                await self._eval(_FINISH, keys, args)
                return
            except GatewayError:
                await asyncio.sleep(1.0)

    async def _release(self, reservation: Reservation, refund: int) -> None:
        args: list[str | int | float] = [reservation.id, 0]
        for lim in reservation._held:
            args += [lim.kind, lim.capacity, refund]
        keys = [self._marker(reservation.id), *map(self._key, reservation._held)]
        await self._eval(_FINISH, keys, args)

    async def _read(self, limits: list[_Limit]) -> list[float]:
        args: list[str | int | float] = []
        for lim in limits:
            args += [lim.kind, lim.capacity]
        reply = await self._eval(_READ, [self._key(lim) for lim in limits], args)
        return [float(v) for v in reply]

    async def close(self) -> None:
        undoing = list(self._undoing)
        for task in undoing:
            task.cancel()
        await asyncio.gather(*undoing, return_exceptions=True)
        await self._redis.aclose()


def make_limiter(redis_url: str | None) -> Limiter:
    """A RedisLimiter when a Redis URL is configured (several replicas), else an
    InProcessLimiter (one replica)."""
    if redis_url:
        return RedisLimiter(redis_url)
    return InProcessLimiter()

"""Authentication of callers (API keys) and of the admin (one shared admin key).

`Authenticator.authenticate` turns an `Authorization` value ("Bearer pvd_..."; the gRPC
`authorization` metadata has the same form) into a `Principal` or raises AuthError:
missing_api_key, invalid_api_key (malformed, unknown or wrong secret: unknown and wrong secret
read identically, so a caller cannot probe which key ids exist), revoked_api_key,
expired_api_key.

Invariants:
- Lookups, positive and negative, are cached for at most `cache_s` seconds counted from when the
  database read began, so a revocation made on any replica is enforced everywhere within
  `cache_s` (default 0.5 s); the cache is a bounded LRU.
- The cache never lets a wrong secret in: every call hashes the presented secret and compares it
  with the stored hash in constant time; revocation and expiry are checked on every call too.
- A flood of bad keys cannot hammer the database: malformed keys never reach it, repeated ids
  hit the cache, concurrent lookups of one id share a single read, and at most
  `max_concurrent_lookups` reads run at once.
- No secret is logged, cached in plaintext or echoed in an error.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import sys
import time
from collections import OrderedDict
from datetime import UTC, datetime
from pathlib import Path

from paved.gateway.access import keys as keylib
from paved.gateway.access.state import GatewayStore, KeyInfo
from paved.gateway.errors import AuthError
from paved.gateway.types import Principal, Tenant

# Far above any real header; beyond it the value is refused before any parsing.
MAX_AUTHORIZATION_LEN = 4096
_INVALID = "invalid API key: check the key you sent in 'Authorization: Bearer <key>'"
_MISSING = "missing API key: send 'Authorization: Bearer <key>'"


def bearer_token(authorization: str | None) -> str:
    """The token of a "Bearer <token>" value (scheme case-insensitive); AuthError otherwise."""
    if authorization is None or not authorization.strip():
        raise AuthError(_MISSING, code="missing_api_key")
    if len(authorization) > MAX_AUTHORIZATION_LEN:
        raise AuthError("malformed Authorization header: too long", code="invalid_api_key")
    parts = authorization.strip().split(None, 1)
    if parts[0].lower() != "bearer":
        raise AuthError("malformed Authorization header: expected 'Bearer <key>'", code="invalid_api_key")
    if len(parts) == 1 or not parts[1].strip():
        raise AuthError(_MISSING, code="missing_api_key")
    return parts[1].strip()


def _principal(info: KeyInfo, tenant: Tenant) -> Principal:
    return Principal(key_id=info.key_id, key_name=info.name, tenant=tenant, key_limits=info.limits)


async def live_principal(store: GatewayStore, key_id: str, now: float) -> Principal | None:
    """The principal of key `key_id` while it is neither revoked nor expired at `now` (UNIX
    seconds), else None (unknown too). For work that goes on after its request, as the key that
    started it: a batch's lines, a response another replica takes over. No secret is checked:
    the caller holds the id from an authenticated request."""
    found = await store.lookup(key_id)
    if found is None:
        return None
    info, tenant, _ = found
    if info.revoked_at is not None or (info.expires_at is not None and info.expires_at.timestamp() <= now):
        return None
    return _principal(info, tenant)


# One cached lookup: (key info, tenant, secret hash, principal), or None for an unknown key id.
_Record = tuple[KeyInfo, Tenant, str, Principal]


class Authenticator:
    """API-key authentication over a GatewayStore, with a short-lived bounded cache."""

    def __init__(
        self,
        store: GatewayStore,
        *,
        cache_s: float = 0.5,
        max_entries: int = 10_000,
        max_concurrent_lookups: int = 16,
    ):
        if not 0 <= cache_s <= 60:
            raise ValueError("cache_s must be between 0 and 60 seconds")
        if max_entries < 1 or max_concurrent_lookups < 1:
            raise ValueError("max_entries and max_concurrent_lookups must be at least 1")
        self._store = store
        self._cache_s = cache_s
        self._max_entries = max_entries
        # key_id -> (monotonic time the entry stops being valid, record or None)
        self._cache: OrderedDict[str, tuple[float, _Record | None]] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[_Record | None]] = {}
        self._max_lookups = max_concurrent_lookups
        self._lookups: asyncio.Semaphore | None = None
        # Counts of database reads (tests and metrics: the cache's effect is observable).
        self.db_lookups = 0

    async def authenticate(self, authorization: str | None) -> Principal:
        token = bearer_token(authorization)
        key_id, secret = keylib.parse_key(token)
        record = await self._record(key_id)
        # The hash is compared even for an unknown id (against a dummy), so both paths do
        # the same work.
        expected = record[2] if record is not None else "0" * 64
        if not keylib.secret_matches(secret, expected) or record is None:
            raise AuthError(_INVALID, code="invalid_api_key")
        info, _tenant, _hash, principal = record
        if info.revoked_at is not None:
            raise AuthError("this API key has been revoked", code="revoked_api_key")
        if info.expires_at is not None and info.expires_at <= datetime.now(UTC):
            raise AuthError("this API key has expired", code="expired_api_key")
        return principal

    def invalidate(self, key_id: str) -> None:
        """Drop a cached entry (this replica's admin API calls it after a revoke)."""
        self._cache.pop(key_id, None)

    async def _record(self, key_id: str) -> _Record | None:
        now = time.monotonic()
        hit = self._cache.get(key_id)
        if hit is not None:
            if hit[0] > now:
                self._cache.move_to_end(key_id)
                return hit[1]
            del self._cache[key_id]
        pending = self._inflight.get(key_id)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch(key_id))
            self._inflight[key_id] = pending
            pending.add_done_callback(lambda f: self._settled(key_id, f))
        # Shielded: one caller going away must not cancel the read the others wait on.
        return await asyncio.shield(pending)

    def _settled(self, key_id: str, future: asyncio.Future[_Record | None]) -> None:
        self._inflight.pop(key_id, None)
        # Marks a failure as seen even when every waiter has gone (no "never retrieved" log);
        # waiters still present get it raised.
        if not future.cancelled():
            future.exception()

    async def _fetch(self, key_id: str) -> _Record | None:
        if self._lookups is None:
            self._lookups = asyncio.Semaphore(self._max_lookups)
        async with self._lookups:
            # The entry's age counts from before the read, so it is never older than cache_s.
            started = time.monotonic()
            self.db_lookups += 1
            found = await self._store.lookup(key_id)
        record: _Record | None = None
        if found is not None:
            info, tenant, secret_hash = found
            record = (info, tenant, secret_hash, _principal(info, tenant))
        if self._cache_s > 0:
            self._cache[key_id] = (started + self._cache_s, record)
            self._cache.move_to_end(key_id)
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        return record


def check_admin_key(admin_key: object) -> str:
    """`admin_key` stripped, if it can be presented at all; ValueError otherwise.

    Only printable ASCII: an HTTP header value reaches the app as latin-1 and HTTP clients
    (httpx, the `paved` CLI) refuse to send anything else, so a key with any other character
    would be accepted at startup and then never match, locking the admin out with no hint why.
    """
    if not isinstance(admin_key, str) or not admin_key.strip():
        raise ValueError("the admin key must be a non-empty string")
    key = admin_key.strip()
    if not all(" " <= c <= "~" for c in key):
        raise ValueError(
            "the admin key must be printable ASCII (it travels in an HTTP header); "
            "generate one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return key


class AdminAuth:
    """The admin key check. Holds only the key's SHA-256; compares in constant time."""

    def __init__(self, admin_key: str):
        self._hash = hashlib.sha256(check_admin_key(admin_key).encode()).digest()

    def check(self, authorization: str | None) -> None:
        try:
            token = bearer_token(authorization)
        except AuthError as exc:
            raise AuthError(
                exc.message.replace("API key", "admin key"), code=exc.code or "invalid_api_key"
            ) from None
        presented = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        if not hmac.compare_digest(presented, self._hash):
            raise AuthError("invalid admin key", code="invalid_api_key")

    def __repr__(self) -> str:
        return "AdminAuth(<redacted>)"


def generate_admin_key() -> str:
    return "pvd_admin_" + secrets.token_urlsafe(32)


def load_admin_key(path: str | os.PathLike[str] | None, env: str = "PAVED_ADMIN_KEY") -> str:
    """The admin key: from `path` (file contents, stripped) if given, else the `env` variable,
    else a freshly generated one (`admin_key_for_run` prints that once). A named file that is
    missing, unreadable, empty or oversized, and a key from either that is not printable ASCII,
    are errors (ValueError), never a silent fresh key."""
    key = configured_admin_key(path, env)
    return generate_admin_key() if key is None else key


def admin_key_for_run(path: str | os.PathLike[str] | None, server: str) -> str:
    """`load_admin_key(path)` for a server's run: a key it had to generate (none configured)
    exists only in this process, so it is printed once to stderr, `server` naming whose."""
    key = configured_admin_key(path)
    if key is not None:
        return key
    key = generate_admin_key()
    print(f"{server}: admin key for this run (set PAVED_ADMIN_KEY to choose one): {key}", file=sys.stderr)
    return key


def configured_admin_key(path: str | os.PathLike[str] | None, env: str = "PAVED_ADMIN_KEY") -> str | None:
    """The admin key `path` or the `env` variable configures, None where neither does (no
    file named, the variable unset or blank); ValueError as `load_admin_key`. A server's
    argument check calls this: it validates without generating a key."""
    if path is not None:
        p = Path(path)
        try:
            with p.open("rb") as f:
                raw = f.read(4097)
        except OSError as exc:
            raise ValueError(f"cannot read the admin key file {p}: {exc.strerror}") from None
        if len(raw) > 4096:
            raise ValueError(f"the admin key file {p} is larger than 4096 bytes")
        try:
            key = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ValueError(f"the admin key file {p} is not UTF-8 text") from None
        if not key:
            raise ValueError(f"the admin key file {p} is empty")
        try:
            return check_admin_key(key)
        except ValueError as exc:
            raise ValueError(f"the admin key file {p}: {exc}") from None
    # An empty variable counts as unset (a common way to "unset" one in compose files).
    key = os.environ.get(env, "").strip()
    if not key:
        return None
    try:
        return check_admin_key(key)
    except ValueError as exc:
        raise ValueError(f"${env}: {exc}") from None

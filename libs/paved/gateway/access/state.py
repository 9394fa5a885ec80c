"""The gateway's durable state: tenants and API keys, in SQLite (one replica) or PostgreSQL
(many replicas sharing one database).

`GatewayStore` wraps a synchronous SQLAlchemy engine; every public method is a coroutine that
runs its database work in a worker thread (`asyncio.to_thread`), so the event loop never blocks
on the database.

Invariants:
- No secret is ever stored or returned by a listing: `api_keys.secret_hash` holds the SHA-256 of
  the secret part (paved.gateway.access.keys.hash_secret), and only `lookup` hands that hash out.
- Every input is validated before it reaches SQL; a bad one is GatewayError(400), an unknown
  tenant or key GatewayError(404), a duplicate tenant GatewayError(409).
- Datetimes are UTC-aware on the way in (naive ones are refused) and on the way out.
- `start()` is idempotent and safe when several replicas run it at once on one PostgreSQL
  (the DDL runs under a transaction-scoped advisory lock).
- PostgreSQL connections carry connect and statement timeouts, so no call waits forever.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import re
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from paved.gateway.access import keys as keylib
from paved.gateway.errors import GatewayError
from paved.gateway.types import Limits, Tenant
from paved.sql import engine_for, utc, utc_now

TENANT_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
MAX_MODELS = 1000
MAX_MODEL_LEN = 256
MAX_KEY_NAME_LEN = 128
# Far above any sane limit, and small enough for every backend's integer column/JSON number.
MAX_LIMIT = 2**53
# Any constant unique to this schema: the advisory lock that serialises concurrent start()s.
_DDL_LOCK_ID = 0x7061766564  # "paved"
_T = TypeVar("_T")
# Limits is frozen, so one shared default is safe.
NO_LIMITS = Limits()

metadata = sa.MetaData()

tenants_table = sa.Table(
    "tenants",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(63), nullable=False, unique=True),
    sa.Column("models", sa.JSON, nullable=False),
    sa.Column("limits", sa.JSON, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)

api_keys_table = sa.Table(
    "api_keys",
    metadata,
    sa.Column("key_id", sa.String(keylib.KEY_ID_LEN), primary_key=True),
    sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False, index=True),
    sa.Column("name", sa.String(MAX_KEY_NAME_LEN), nullable=False),
    sa.Column("secret_hash", sa.String(64), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("limits", sa.JSON, nullable=False),
)


@dataclass(frozen=True)
class KeyInfo:
    """What may be shown about a key: never its secret or its hash."""

    key_id: str
    tenant: str  # the tenant's name
    name: str
    prefix: str  # "pvd_" + key_id: the visible part of the plaintext key
    created_at: datetime
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    limits: Limits = field(default_factory=Limits)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (ISO 8601 datetimes) for the admin API."""
        return {
            "key_id": self.key_id,
            "tenant": self.tenant,
            "name": self.name,
            "prefix": self.prefix,
            "created_at": self.created_at.isoformat(),
            "expires_at": _iso(self.expires_at),
            "revoked_at": _iso(self.revoked_at),
            "limits": limits_to_dict(self.limits),
        }


def tenant_to_dict(tenant: Tenant) -> dict[str, Any]:
    return {
        "id": tenant.id,
        "name": tenant.name,
        "models": list(tenant.models),
        "limits": limits_to_dict(tenant.limits),
    }


def limits_to_dict(limits: Limits) -> dict[str, int | None]:
    return {
        "requests_per_min": limits.requests_per_min,
        "tokens_per_min": limits.tokens_per_min,
        "max_concurrent": limits.max_concurrent,
    }


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _bad(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, code="invalid_request", param=param)


def validate_tenant_name(name: object) -> str:
    if not isinstance(name, str) or TENANT_NAME_RE.fullmatch(name) is None:
        raise _bad(
            "tenant name must match [a-z0-9][a-z0-9._-]{0,62} (lowercase letters, digits, '.', '_', '-')",
            param="name",
        )
    return name


def validate_models(models: object) -> tuple[str, ...]:
    if isinstance(models, str) or not isinstance(models, Iterable):
        raise _bad("models must be a list of model aliases (or ['*'] for all)", param="models")
    out = tuple(models)
    if len(out) > MAX_MODELS:
        raise _bad(f"models may list at most {MAX_MODELS} aliases", param="models")
    for alias in out:
        if (
            not isinstance(alias, str)
            or not alias
            or len(alias) > MAX_MODEL_LEN
            or not alias.isprintable()
            or alias != alias.strip()
        ):
            raise _bad(
                f"each model must be a non-empty printable string of at most {MAX_MODEL_LEN} characters",
                param="models",
            )
    # Order kept (it is what the admin wrote), duplicates dropped.
    return tuple(dict.fromkeys(out))


def validate_limits(limits: object) -> Limits:
    if not isinstance(limits, Limits):
        raise _bad("limits must be a Limits value", param="limits")
    for name, value in limits_to_dict(limits).items():
        # bool is an int subclass; True as a limit is a bug, not 1.
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LIMIT
        ):
            raise _bad(
                f"limits.{name} must be null or an integer between 0 and {MAX_LIMIT}", param=f"limits.{name}"
            )
    return limits


def _validate_key_name(name: object) -> str:
    if not isinstance(name, str) or len(name) > MAX_KEY_NAME_LEN or not name.isprintable():
        raise _bad(
            f"key name must be a printable string of at most {MAX_KEY_NAME_LEN} characters", param="name"
        )
    return name


def _limits_from_json(raw: Any) -> Limits:
    raw = raw if isinstance(raw, dict) else {}
    return Limits(
        requests_per_min=raw.get("requests_per_min"),
        tokens_per_min=raw.get("tokens_per_min"),
        max_concurrent=raw.get("max_concurrent"),
    )


def _tenant_from_row(row: Any) -> Tenant:
    return Tenant(
        id=row.id,
        name=row.name,
        models=tuple(row.models or ()),
        limits=_limits_from_json(row.limits),
    )


def _key_from_row(row: Any, tenant_name: str) -> KeyInfo:
    created = utc(row.created_at) or utc_now()  # NOT NULL column: the fallback never runs
    return KeyInfo(
        key_id=row.key_id,
        tenant=tenant_name,
        name=row.name,
        prefix=keylib.KEY_PREFIX + row.key_id,
        created_at=created,
        expires_at=utc(row.expires_at),
        revoked_at=utc(row.revoked_at),
        limits=_limits_from_json(row.limits),
    )


DB_THREADS = 15


def _tenant_not_found(name: str) -> GatewayError:
    return GatewayError(404, f"no tenant named '{name}'", code="tenant_not_found", param="tenant")


class GatewayStore:
    """Tenants and API keys. Construct, `await start()`, use, `await close()`."""

    def __init__(self, url: str):
        self._engine = engine_for(url, what="gateway's state store")
        self._is_pg = self._engine.dialect.name == "postgresql"
        # Database work has threads of its own: on asyncio's default pool (min(32, CPUs + 4)
        # threads, 6 on a 2-core host) it queued behind batch files being validated and
        # written, and every request's key lookup waited with it. As many as the PostgreSQL
        # connection pool holds (5 + 10 overflow): more would only wait for a connection.
        self._threads = ThreadPoolExecutor(max_workers=DB_THREADS, thread_name_prefix="paved-db")

    @property
    def dialect(self) -> str:
        return self._engine.dialect.name

    @property
    def engine(self) -> sa.Engine:
        """The SQLAlchemy engine, for the gateway's other stores (templates, conversations,
        experiments): one database, one connection pool, each store owning its own tables."""
        return self._engine

    async def create_tables(self, other: sa.MetaData) -> None:
        """Create another store's tables if missing, with `start()`'s concurrency guarantees."""
        await asyncio.to_thread(self._create_all_sync, other)

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run `fn(*args)` (synchronous database work) in a worker thread; an unreachable or
        timed-out database becomes GatewayError(503)."""
        return await self._run(fn, *args)

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        try:
            call = functools.partial(contextvars.copy_context().run, fn, *args)
            return await asyncio.get_running_loop().run_in_executor(self._threads, call)
        except (OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError) as exc:
            # The database is down, slow or unreachable: a 503 the caller may retry, not a 500.
            # The driver's message can carry connection details, so it is not passed on.
            raise GatewayError(
                503, "the gateway's state store is unavailable", code="store_unavailable"
            ) from exc

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the tables if missing (idempotent; safe concurrently across replicas)."""
        await asyncio.to_thread(self._start_sync)

    def _start_sync(self) -> None:
        self._create_all_sync(metadata)

    def _create_all_sync(self, tables: sa.MetaData) -> None:
        if self._is_pg:
            with self._engine.begin() as conn:
                # Held to commit: a second replica waits here, then finds the tables.
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": _DDL_LOCK_ID})
                tables.create_all(conn)
            return
        # SQLite: two processes on one file can both see "no table"; the loser's CREATE fails
        # with "already exists" and a second pass (which then sees the tables) succeeds.
        for attempt in range(3):
            try:
                with self._engine.begin() as conn:
                    tables.create_all(conn)
                return
            except (OperationalError, ProgrammingError):
                if attempt == 2:
                    raise

    async def close(self) -> None:
        await asyncio.to_thread(self._engine.dispose)
        self._threads.shutdown(wait=False)

    # -- tenants ---------------------------------------------------------------------------

    async def create_tenant(
        self, name: str, models: Sequence[str] = ("*",), limits: Limits = NO_LIMITS
    ) -> Tenant:
        tenant = Tenant(
            id="ten_" + uuid.uuid4().hex,
            name=validate_tenant_name(name),
            models=validate_models(models),
            limits=validate_limits(limits),
        )
        return await self._run(self._create_tenant_sync, tenant)

    def _create_tenant_sync(self, tenant: Tenant) -> Tenant:
        try:
            with self._engine.begin() as conn:
                conn.execute(
                    tenants_table.insert().values(
                        id=tenant.id,
                        name=tenant.name,
                        models=list(tenant.models),
                        limits=limits_to_dict(tenant.limits),
                        created_at=utc_now(),
                    )
                )
        except IntegrityError:
            raise GatewayError(
                409, f"a tenant named '{tenant.name}' already exists", code="tenant_exists", param="name"
            ) from None
        return tenant

    async def update_tenant(
        self, name: str, *, models: Sequence[str] | None = None, limits: Limits | None = None
    ) -> Tenant:
        """Replace the tenant's models and/or limits (None leaves that field as it is)."""
        validate_tenant_name(name)
        new_models = None if models is None else validate_models(models)
        new_limits = None if limits is None else validate_limits(limits)
        return await self._run(self._update_tenant_sync, name, new_models, new_limits)

    def _update_tenant_sync(self, name: str, models: tuple[str, ...] | None, limits: Limits | None) -> Tenant:
        values: dict[str, Any] = {}
        if models is not None:
            values["models"] = list(models)
        if limits is not None:
            values["limits"] = limits_to_dict(limits)
        with self._engine.begin() as conn:
            if values:
                conn.execute(tenants_table.update().where(tenants_table.c.name == name).values(**values))
            row = conn.execute(sa.select(tenants_table).where(tenants_table.c.name == name)).first()
        if row is None:
            raise _tenant_not_found(name)
        return _tenant_from_row(row)

    async def get_tenant(self, name: str) -> Tenant | None:
        if not isinstance(name, str) or TENANT_NAME_RE.fullmatch(name) is None:
            return None
        return await self._run(self._get_tenant_sync, name)

    def _get_tenant_sync(self, name: str) -> Tenant | None:
        with self._engine.connect() as conn:
            row = conn.execute(sa.select(tenants_table).where(tenants_table.c.name == name)).first()
        return None if row is None else _tenant_from_row(row)

    async def list_tenants(self) -> list[Tenant]:
        return await self._run(self._list_tenants_sync)

    def _list_tenants_sync(self) -> list[Tenant]:
        with self._engine.connect() as conn:
            rows = conn.execute(sa.select(tenants_table).order_by(tenants_table.c.name)).all()
        return [_tenant_from_row(r) for r in rows]

    # -- keys ------------------------------------------------------------------------------

    async def create_key(
        self,
        tenant_name: str,
        *,
        name: str = "",
        expires_at: datetime | None = None,
        limits: Limits = NO_LIMITS,
    ) -> tuple[KeyInfo, str]:
        """A new key for the tenant: (its info, the plaintext key, to be shown exactly once)."""
        validate_tenant_name(tenant_name)
        _validate_key_name(name)
        validate_limits(limits)
        if expires_at is not None:
            if not isinstance(expires_at, datetime) or expires_at.tzinfo is None:
                raise _bad("expires_at must be a timezone-aware datetime", param="expires_at")
            try:
                expires_at = expires_at.astimezone(UTC)
            except OverflowError:  # e.g. 9999-12-31T23:59:59-14:00: past year 9999 in UTC
                raise _bad("expires_at must be before the year 10000 in UTC", param="expires_at") from None
            if expires_at <= utc_now():
                raise _bad("expires_at must be in the future", param="expires_at")
        return await self._run(self._create_key_sync, tenant_name, name, expires_at, limits)

    def _create_key_sync(
        self, tenant_name: str, name: str, expires_at: datetime | None, limits: Limits
    ) -> tuple[KeyInfo, str]:
        for attempt in range(3):
            try:
                return self._insert_key(tenant_name, name, expires_at, limits)
            except IntegrityError:
                # A key_id collision (2^-60 per pair) or the tenant vanishing mid-call.
                if attempt == 2:
                    raise GatewayError(409, "could not create the key; retry", code="conflict") from None
        raise GatewayError(409, "could not create the key; retry", code="conflict")

    def _insert_key(
        self, tenant_name: str, name: str, expires_at: datetime | None, limits: Limits
    ) -> tuple[KeyInfo, str]:
        with self._engine.begin() as conn:
            tenant_id = conn.execute(
                sa.select(tenants_table.c.id).where(tenants_table.c.name == tenant_name)
            ).scalar_one_or_none()
            if tenant_id is None:
                raise _tenant_not_found(tenant_name)
            key_id, plaintext = keylib.generate_key()
            _, secret = keylib.parse_key(plaintext)
            created = utc_now()
            conn.execute(
                api_keys_table.insert().values(
                    key_id=key_id,
                    tenant_id=tenant_id,
                    name=name,
                    secret_hash=keylib.hash_secret(secret),
                    created_at=created,
                    expires_at=expires_at,
                    revoked_at=None,
                    limits=limits_to_dict(limits),
                )
            )
        info = KeyInfo(
            key_id=key_id,
            tenant=tenant_name,
            name=name,
            prefix=keylib.KEY_PREFIX + key_id,
            created_at=created,
            expires_at=expires_at,
            limits=limits,
        )
        return info, plaintext

    def _key_select(self) -> sa.Select[Any]:
        return sa.select(api_keys_table, tenants_table.c.name.label("tenant_name")).join(
            tenants_table, tenants_table.c.id == api_keys_table.c.tenant_id
        )

    async def list_keys(self, tenant_name: str | None = None) -> list[KeyInfo]:
        """Every key (of one tenant, if named), oldest first; never a secret or hash."""
        if tenant_name is not None:
            validate_tenant_name(tenant_name)
        return await self._run(self._list_keys_sync, tenant_name)

    def _list_keys_sync(self, tenant_name: str | None) -> list[KeyInfo]:
        query = self._key_select().order_by(api_keys_table.c.created_at, api_keys_table.c.key_id)
        with self._engine.connect() as conn:
            if tenant_name is not None:
                exists = conn.execute(
                    sa.select(tenants_table.c.id).where(tenants_table.c.name == tenant_name)
                ).first()
                if exists is None:
                    raise _tenant_not_found(tenant_name)
                query = query.where(tenants_table.c.name == tenant_name)
            rows = conn.execute(query).all()
        return [_key_from_row(r, r.tenant_name) for r in rows]

    async def revoke_key(self, key_id: str) -> KeyInfo:
        """Revoke a key (idempotent: revoking again keeps the first revocation time)."""
        if not isinstance(key_id, str) or not keylib.is_key_id(key_id):
            raise GatewayError(404, "no API key with that id", code="key_not_found", param="key_id")
        return await self._run(self._revoke_key_sync, key_id)

    def _revoke_key_sync(self, key_id: str) -> KeyInfo:
        with self._engine.begin() as conn:
            conn.execute(
                api_keys_table.update()
                .where(api_keys_table.c.key_id == key_id, api_keys_table.c.revoked_at.is_(None))
                .values(revoked_at=utc_now())
            )
            row = conn.execute(self._key_select().where(api_keys_table.c.key_id == key_id)).first()
        if row is None:
            raise GatewayError(404, f"no API key with id '{key_id}'", code="key_not_found", param="key_id")
        return _key_from_row(row, row.tenant_name)

    async def lookup(self, key_id: str) -> tuple[KeyInfo, Tenant, str] | None:
        """(key info, its tenant, the secret's hash) for authentication; None if unknown."""
        if not isinstance(key_id, str) or not keylib.is_key_id(key_id):
            return None
        return await self._run(self._lookup_sync, key_id)

    def _lookup_sync(self, key_id: str) -> tuple[KeyInfo, Tenant, str] | None:
        query = sa.select(
            api_keys_table,
            tenants_table.c.id.label("t_id"),
            tenants_table.c.name.label("t_name"),
            tenants_table.c.models.label("t_models"),
            tenants_table.c.limits.label("t_limits"),
        ).join(tenants_table, tenants_table.c.id == api_keys_table.c.tenant_id)
        with self._engine.connect() as conn:
            row = conn.execute(query.where(api_keys_table.c.key_id == key_id)).first()
        if row is None:
            return None
        tenant = Tenant(
            id=row.t_id,
            name=row.t_name,
            models=tuple(row.t_models or ()),
            limits=_limits_from_json(row.t_limits),
        )
        return _key_from_row(row, row.t_name), tenant, row.secret_hash

"""The values every gateway layer passes around: limits, tenants and the authenticated caller.

Invariants callers rely on:
- A `Principal` is immutable and fully resolved: its tenant and limits are the ones in force
  when the key was authenticated (a cached principal is at most `auth_cache_s` old).
- `None` in `Limits` means "no limit of this kind"; 0 is a real limit that admits nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Ids the gateway hands out (files, batches, responses, streams) are short printable ASCII: any
# other string names nothing, and a NUL in one would be a database error rather than a 404.
MAX_ID_LEN = 128


def well_formed_id(value: str) -> bool:
    return len(value) <= MAX_ID_LEN and value.isascii() and value.isprintable()


@dataclass(frozen=True)
class Limits:
    requests_per_min: int | None = None
    tokens_per_min: int | None = None
    max_concurrent: int | None = None

    def is_unlimited(self) -> bool:
        return self.requests_per_min is None and self.tokens_per_min is None and self.max_concurrent is None


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    # Model aliases this tenant may call; ("*",) allows every routed model.
    models: tuple[str, ...] = ("*",)
    limits: Limits = field(default_factory=Limits)

    def allows(self, alias: str) -> bool:
        """Whether `alias` (a bare alias: strip any "@version" first) may be used."""
        return "*" in self.models or alias in self.models


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: one API key of one tenant."""

    key_id: str  # the key's public id (the visible prefix), never the secret
    key_name: str
    tenant: Tenant
    key_limits: Limits = field(default_factory=Limits)

    def allows(self, alias: str) -> bool:
        return self.tenant.allows(alias)

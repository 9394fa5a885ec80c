"""Two gateway replicas on one real PostgreSQL 15: two GatewayStores on one database.

Covers: concurrent start() (the DDL race between replicas), state written by one replica read
by the other (tenants, keys, UTC datetimes), and a revocation made through one replica enforced
by the other's Authenticator within 1 s (polled, then the state asserted).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import Iterator

import pytest

from paved.gateway.access import keys
from paved.gateway.access.auth import Authenticator
from paved.gateway.access.state import GatewayStore
from paved.gateway.errors import AuthError, GatewayError
from paved.gateway.types import Limits
from paved.testing.postgres import create_database, postgres_server

_db_names = itertools.count()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with postgres_server() as url:
        yield url


@pytest.fixture
def db_url(server) -> str:
    """A fresh database per test (much cheaper than a fresh cluster)."""
    return create_database(server, f"gw_{next(_db_names)}")


def test_url_forms_select_psycopg(db_url):
    store = GatewayStore(db_url)
    assert store.dialect == "postgresql"
    assert store._engine.url.drivername == "postgresql+psycopg"


def test_two_replicas_start_concurrently_and_share_state(db_url):
    async def go():
        replicas = [GatewayStore(db_url) for _ in range(4)]
        # The race a rolling deploy causes: every replica creates the schema at once.
        await asyncio.gather(*(r.start() for r in replicas))
        await asyncio.gather(*(r.start() for r in replicas))  # and again: idempotent
        a, b = replicas[0], replicas[1]

        tenant = await a.create_tenant("acme", models=["llama"], limits=Limits(tokens_per_min=500))
        assert await b.get_tenant("acme") == tenant
        with pytest.raises(GatewayError) as err:
            await b.create_tenant("acme")
        assert err.value.status == 409

        info, plaintext = await a.create_key("acme", name="ci", limits=Limits(requests_per_min=3))
        listed = await b.list_keys("acme")
        assert listed == [info]
        assert listed[0].created_at.utcoffset().total_seconds() == 0
        found = await b.lookup(info.key_id)
        assert found is not None
        _, secret = keys.parse_key(plaintext)
        assert found[2] == keys.hash_secret(secret) and found[1] == tenant

        principal = await Authenticator(b).authenticate(f"Bearer {plaintext}")
        assert principal.tenant.name == "acme" and principal.key_limits.requests_per_min == 3

        updated = await b.update_tenant("acme", models=["*"])
        assert (await a.get_tenant("acme")) == updated
        await asyncio.gather(*(r.close() for r in replicas))

    asyncio.run(go())


def test_revocation_on_one_replica_is_enforced_by_the_other_within_1s(db_url):
    async def go():
        a, b = GatewayStore(db_url), GatewayStore(db_url)
        await asyncio.gather(a.start(), b.start())
        await a.create_tenant("acme")
        info, plaintext = await a.create_key("acme")
        authn_b = Authenticator(b, cache_s=0.5)
        header = f"Bearer {plaintext}"
        assert (await authn_b.authenticate(header)).key_id == info.key_id  # now cached on b

        await a.revoke_key(info.key_id)
        deadline = time.monotonic() + 1.0
        code = None
        while time.monotonic() < deadline:
            try:
                await authn_b.authenticate(header)
            except AuthError as exc:
                code = exc.code
                break
            await asyncio.sleep(0.02)
        assert code == "revoked_api_key"
        # And it stays rejected (the fresh entry carries the revocation).
        with pytest.raises(AuthError) as err:
            await authn_b.authenticate(header)
        assert err.value.code == "revoked_api_key"
        await asyncio.gather(a.close(), b.close())

    asyncio.run(go())


def test_unreachable_database_is_a_503_not_a_hang(server):
    # A port nothing listens on: connect fails fast, the store answers 503.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = GatewayStore(f"postgresql://postgres@127.0.0.1:{port}/postgres")

    async def go():
        with pytest.raises(GatewayError) as err:
            await store.list_tenants()
        assert err.value.status == 503 and err.value.code == "store_unavailable"
        assert str(port) not in err.value.message
        await store.close()

    asyncio.run(go())

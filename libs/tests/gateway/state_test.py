"""The key/tenant store on SQLite, API-key parsing and hashing, and authentication.

Covers: tenant and key lifecycle (create, list, update, revoke, expire) with input validation;
secrets never reaching the database file; every malformed Authorization form answering 401 with
its code; unknown and wrong-secret keys being indistinguishable; the lookup cache (revocations
enforced once an entry is cache_s old, negative entries, one read for concurrent lookups, never
a wrong secret through a cached entry); the admin key; and, as properties, that a key never
authenticates as another tenant and that no mutation of a valid key authenticates.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import string
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from paved.gateway.access import auth as auth_mod
from paved.gateway.access import keys
from paved.gateway.access.auth import AdminAuth, Authenticator, load_admin_key
from paved.gateway.access.state import GatewayStore, api_keys_table
from paved.gateway.errors import AuthError, GatewayError
from paved.gateway.types import Limits, Principal


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[GatewayStore]:
    s = GatewayStore(f"sqlite:///{tmp_path / 'gw.db'}")
    run(s.start())
    yield s
    run(s.close())


def bearer(token: str) -> str:
    return f"Bearer {token}"


# -- key format -------------------------------------------------------------------------------


def test_generated_keys_have_the_documented_format_and_parse_back():
    seen = set()
    for _ in range(200):
        key_id, plaintext = keys.generate_key()
        assert re.fullmatch(r"pvd_[a-z2-7]{12}_[A-Za-z0-9_-]{32}", plaintext)
        assert plaintext.startswith(f"pvd_{key_id}_")
        parsed_id, secret = keys.parse_key(plaintext)
        assert parsed_id == key_id and plaintext.endswith(secret) and len(secret) == 32
        seen.add(key_id)
    assert len(seen) == 200


def test_hash_secret_is_sha256_hex_and_compares():
    _, plaintext = keys.generate_key()
    _, secret = keys.parse_key(plaintext)
    digest = keys.hash_secret(secret)
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert keys.secret_matches(secret, digest)
    assert not keys.secret_matches(secret[:-1] + ("A" if secret[-1] != "A" else "B"), digest)


_VALID_ID = "abcdefgh2345"
_VALID_SECRET = "A" * 32


@pytest.mark.parametrize(
    "token",
    [
        "",
        "pvd_",
        f"sk-_{_VALID_ID}_{_VALID_SECRET}",  # wrong prefix
        f"PVD_{_VALID_ID}_{_VALID_SECRET}",
        f"pvd_{_VALID_ID.upper()}_{_VALID_SECRET}",  # id must be lowercase base32
        f"pvd_abcdefgh2341_{_VALID_SECRET}",  # '1' is not base32
        f"pvd_{_VALID_ID}-{_VALID_SECRET}",  # separator
        f"pvd_{_VALID_ID}_{_VALID_SECRET[:-1]}",  # short secret
        f"pvd_{_VALID_ID}_{_VALID_SECRET}A",  # long secret
        f"pvd_{_VALID_ID}_{'A' * 31}é",  # non-ASCII, right length
        f"pvd_{_VALID_ID}_{'A' * 31}\x00",
        f"pvd_{_VALID_ID}_{'A' * 31}=",
        "pvd_" + "a" * 100_000,  # huge
    ],
)
def test_parse_key_rejects_malformed(token):
    with pytest.raises(AuthError) as err:
        keys.parse_key(token)
    assert err.value.status == 401 and err.value.code == "invalid_api_key"
    # The message never echoes what was sent.
    assert token[4:] not in err.value.message or not token[4:]


# -- tenants ----------------------------------------------------------------------------------


def test_tenant_create_get_list_update(store):
    a = run(store.create_tenant("acme", models=["llama", "qwen"], limits=Limits(requests_per_min=60)))
    assert a.name == "acme" and a.models == ("llama", "qwen") and a.limits.requests_per_min == 60
    b = run(store.create_tenant("beta.corp-1"))
    assert b.models == ("*",) and b.limits == Limits()
    assert run(store.get_tenant("acme")) == a
    assert run(store.get_tenant("nobody")) is None
    assert run(store.get_tenant("Not A Name")) is None
    assert [t.name for t in run(store.list_tenants())] == ["acme", "beta.corp-1"]

    updated = run(store.update_tenant("acme", limits=Limits(tokens_per_min=1000, max_concurrent=0)))
    assert updated.models == ("llama", "qwen")  # untouched
    assert updated.limits == Limits(tokens_per_min=1000, max_concurrent=0)
    updated = run(store.update_tenant("acme", models=["*"]))
    assert updated.models == ("*",) and updated.limits.tokens_per_min == 1000

    with pytest.raises(GatewayError) as err:
        run(store.create_tenant("acme"))
    assert err.value.status == 409 and err.value.code == "tenant_exists"
    with pytest.raises(GatewayError) as err:
        run(store.update_tenant("ghost", models=["x"]))
    assert err.value.status == 404 and err.value.code == "tenant_not_found"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": ""},
        {"name": "UPPER"},
        {"name": "-leading-dash"},
        {"name": "a" * 64},
        {"name": "sp ace"},
        {"name": "ünï"},
        {"name": 7},
        {"name": "ok", "models": "llama"},  # a string, not a list
        {"name": "ok", "models": [""]},
        {"name": "ok", "models": [3]},
        {"name": "ok", "models": ["x" * 257]},
        {"name": "ok", "models": ["a\nb"]},
        {"name": "ok", "models": ["m"] * 1001},
        {"name": "ok", "limits": Limits(requests_per_min=-1)},
        {"name": "ok", "limits": Limits(tokens_per_min=1.5)},  # type: ignore[arg-type]
        {"name": "ok", "limits": Limits(max_concurrent=True)},
        {"name": "ok", "limits": Limits(max_concurrent=2**60)},
        {"name": "ok", "limits": {"requests_per_min": 1}},
    ],
)
def test_tenant_inputs_are_validated(store, kwargs):
    with pytest.raises(GatewayError) as err:
        run(store.create_tenant(**kwargs))
    assert err.value.status == 400
    assert run(store.list_tenants()) == []


# -- keys -------------------------------------------------------------------------------------


def test_key_lifecycle_and_authentication(store):
    run(store.create_tenant("acme", models=["llama"], limits=Limits(requests_per_min=10)))
    info, plaintext = run(store.create_key("acme", name="ci", limits=Limits(max_concurrent=2)))
    assert info.prefix == "pvd_" + info.key_id and plaintext.startswith(info.prefix + "_")
    assert info.tenant == "acme" and info.name == "ci" and info.revoked_at is None
    assert info.created_at.tzinfo is not None and info.limits == Limits(max_concurrent=2)

    listed = run(store.list_keys())
    assert [k.key_id for k in listed] == [info.key_id]
    assert listed[0].created_at == info.created_at and listed[0].created_at.tzinfo is not None
    _, secret = keys.parse_key(plaintext)
    shown = repr(listed) + repr(listed[0].to_dict())
    assert secret not in shown and keys.hash_secret(secret) not in shown
    assert run(store.list_keys("acme")) == listed

    found = run(store.lookup(info.key_id))
    assert found is not None
    key_info, tenant, secret_hash = found
    assert key_info == listed[0] and tenant.name == "acme" and secret_hash == keys.hash_secret(secret)
    assert run(store.lookup("zzzzzzzzzzzz")) is None
    assert run(store.lookup("not-an-id")) is None

    authn = Authenticator(store, cache_s=0)
    principal = run(authn.authenticate(bearer(plaintext)))
    assert isinstance(principal, Principal)
    assert principal.key_id == info.key_id and principal.key_name == "ci"
    assert principal.tenant.name == "acme" and principal.tenant.limits.requests_per_min == 10
    assert principal.key_limits == Limits(max_concurrent=2)
    assert principal.allows("llama") and not principal.allows("qwen")
    # The scheme is case-insensitive; surrounding whitespace is tolerated.
    assert run(authn.authenticate(f"  bEaReR   {plaintext} ")).key_id == info.key_id

    revoked = run(store.revoke_key(info.key_id))
    assert revoked.revoked_at is not None and revoked.revoked_at.tzinfo is not None
    again = run(store.revoke_key(info.key_id))
    assert again.revoked_at == revoked.revoked_at  # idempotent: the first revocation stands
    with pytest.raises(AuthError) as err:
        run(authn.authenticate(bearer(plaintext)))
    assert err.value.code == "revoked_api_key"

    for bad in ("zzzzzzzzzzzz", "nope", ""):
        with pytest.raises(GatewayError) as gerr:
            run(store.revoke_key(bad))
        assert gerr.value.status == 404 and gerr.value.code == "key_not_found"


def test_key_inputs_are_validated(store):
    run(store.create_tenant("acme"))
    with pytest.raises(GatewayError) as err:
        run(store.create_key("ghost"))
    assert err.value.status == 404 and err.value.code == "tenant_not_found"
    with pytest.raises(GatewayError) as err:
        run(store.list_keys("ghost"))
    assert err.value.status == 404
    bad_calls = [
        {"name": "x" * 129},
        {"name": "tab\there"},
        {"expires_at": datetime(2100, 1, 1)},  # naive
        {"expires_at": datetime.now(UTC) - timedelta(seconds=1)},
        {"limits": Limits(tokens_per_min=-5)},
    ]
    for kwargs in bad_calls:
        with pytest.raises(GatewayError) as err:
            run(store.create_key("acme", **kwargs))
        assert err.value.status == 400, kwargs
    with pytest.raises(GatewayError) as err:
        run(store.create_key("BAD NAME"))
    assert err.value.status == 400
    assert run(store.list_keys()) == []


def test_expired_key_is_rejected(store, tmp_path):
    run(store.create_tenant("acme"))
    later = datetime.now(UTC) + timedelta(hours=1)
    info, plaintext = run(store.create_key("acme", expires_at=later))
    assert info.expires_at == later
    authn = Authenticator(store, cache_s=0)
    assert run(authn.authenticate(bearer(plaintext))).key_id == info.key_id
    # Time passing, without waiting: move the stored expiry into the past.
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'gw.db'}")
    with engine.begin() as conn:
        conn.execute(
            api_keys_table.update()
            .where(api_keys_table.c.key_id == info.key_id)
            .values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
        )
    engine.dispose()
    with pytest.raises(AuthError) as err:
        run(authn.authenticate(bearer(plaintext)))
    assert err.value.code == "expired_api_key"
    assert run(store.list_keys())[0].expires_at < datetime.now(UTC)


def test_secrets_are_never_stored(store, tmp_path):
    run(store.create_tenant("acme"))
    created = [run(store.create_key("acme", name=f"k{i}")) for i in range(5)]
    run(store.close())  # flush; the fixture's second close is harmless
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("gw.db"))
    for info, plaintext in created:
        _, secret = keys.parse_key(plaintext)
        assert secret.encode() not in raw
        assert plaintext.encode() not in raw
        # What is stored is the hash (so the check above looked at the right bytes).
        assert keys.hash_secret(secret).encode() in raw
        assert info.key_id.encode() in raw


def test_concurrent_start_on_one_sqlite_file(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    stores = [GatewayStore(url) for _ in range(4)]

    async def go():
        await asyncio.gather(*(s.start() for s in stores))
        await stores[0].create_tenant("acme")
        names = [[t.name for t in await s.list_tenants()] for s in stores]
        await asyncio.gather(*(s.close() for s in stores))
        return names

    assert run(go()) == [["acme"]] * 4


def test_unsupported_url_is_refused():
    with pytest.raises(ValueError):
        GatewayStore("mysql://localhost/db")
    with pytest.raises(ValueError):
        GatewayStore("")


# -- Authorization header forms ------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "code"),
    [
        (None, "missing_api_key"),
        ("", "missing_api_key"),
        ("   ", "missing_api_key"),
        ("Bearer", "missing_api_key"),
        ("Bearer    ", "missing_api_key"),
        ("Basic dXNlcjpwYXNz", "invalid_api_key"),
        (f"Token pvd_{_VALID_ID}_{_VALID_SECRET}", "invalid_api_key"),
        (f"pvd_{_VALID_ID}_{_VALID_SECRET}", "invalid_api_key"),  # no scheme
        ("Bearer sk-abc", "invalid_api_key"),
        ("Bearer pvd_", "invalid_api_key"),
        ("Bearer " + "pvd_" + "a" * 10_000, "invalid_api_key"),
        ("Bearer " + "x" * 100_000, "invalid_api_key"),
        (f"Bearer pvd_{_VALID_ID}_{'Ä' * 32}", "invalid_api_key"),
        (f"Bearer pvd_{_VALID_ID}_{_VALID_SECRET} extra", "invalid_api_key"),
    ],
)
def test_malformed_authorization_is_401(store, header, code):
    authn = Authenticator(store)
    with pytest.raises(AuthError) as err:
        run(authn.authenticate(header))
    assert err.value.status == 401 and err.value.code == code
    assert err.value.headers.get("WWW-Authenticate") == "Bearer"
    # Malformed input never reaches the database.
    assert authn.db_lookups == 0


def test_unknown_key_and_wrong_secret_read_the_same(store):
    run(store.create_tenant("acme"))
    info, plaintext = run(store.create_key("acme"))
    key_id, secret = keys.parse_key(plaintext)
    other_id = "a" * 12 if key_id != "a" * 12 else "b" * 12
    wrong_secret = ("B" if secret[0] != "B" else "C") + secret[1:]
    authn = Authenticator(store)
    errors = []
    for token in (f"pvd_{other_id}_{secret}", f"pvd_{key_id}_{wrong_secret}"):
        with pytest.raises(AuthError) as err:
            run(authn.authenticate(bearer(token)))
        errors.append((err.value.status, err.value.code, err.value.message))
        assert secret not in err.value.message and wrong_secret not in err.value.message
    assert errors[0] == errors[1] and errors[0][1] == "invalid_api_key"
    # A revoked key with a wrong secret still reads "invalid", so revocation leaks nothing either.
    run(store.revoke_key(info.key_id))
    with pytest.raises(AuthError) as err2:
        run(Authenticator(store, cache_s=0).authenticate(bearer(f"pvd_{key_id}_{wrong_secret}")))
    assert err2.value.code == "invalid_api_key"


# -- the cache --------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(auth_mod.time, "monotonic", fake)
    return fake


def test_revocation_is_enforced_once_the_cache_entry_is_cache_s_old(store, clock):
    run(store.create_tenant("acme"))
    info, plaintext = run(store.create_key("acme"))
    authn = Authenticator(store, cache_s=0.5)

    async def go():
        assert (await authn.authenticate(bearer(plaintext))).key_id == info.key_id
        assert authn.db_lookups == 1
        # Revoked elsewhere (another replica: nothing tells this authenticator).
        await store.revoke_key(info.key_id)
        clock.now += 0.2
        # Within cache_s the cached entry answers (no read) ...
        assert (await authn.authenticate(bearer(plaintext))).key_id == info.key_id
        assert authn.db_lookups == 1
        # ... and once it is cache_s old the revocation is read and enforced.
        clock.now += 0.3
        with pytest.raises(AuthError) as err:
            await authn.authenticate(bearer(plaintext))
        assert err.value.code == "revoked_api_key"
        assert authn.db_lookups == 2

    run(go())


def test_negative_lookups_are_cached_and_concurrent_ones_share_a_read(store, clock):
    authn = Authenticator(store, cache_s=0.5)
    token = bearer(f"pvd_{'q' * 12}_{_VALID_SECRET}")

    async def attempt() -> str | None:
        try:
            await authn.authenticate(token)
        except AuthError as exc:
            return exc.code
        return None

    async def go():
        codes = await asyncio.gather(*(attempt() for _ in range(50)))
        assert set(codes) == {"invalid_api_key"}
        assert authn.db_lookups == 1
        for _ in range(100):
            assert await attempt() == "invalid_api_key"
        assert authn.db_lookups == 1
        clock.now += 0.5
        assert await attempt() == "invalid_api_key"
        assert authn.db_lookups == 2

    run(go())


def test_a_cached_entry_never_admits_a_wrong_secret(store, clock):
    run(store.create_tenant("acme"))
    _, plaintext = run(store.create_key("acme"))
    key_id, secret = keys.parse_key(plaintext)
    authn = Authenticator(store, cache_s=0.5)

    async def go():
        await authn.authenticate(bearer(plaintext))
        for i in range(32):
            wrong = secret[:i] + ("x" if secret[i] != "x" else "y") + secret[i + 1 :]
            with pytest.raises(AuthError) as err:
                await authn.authenticate(bearer(f"pvd_{key_id}_{wrong}"))
            assert err.value.code == "invalid_api_key"
        assert authn.db_lookups == 1  # all of those were answered from the cache
        assert (await authn.authenticate(bearer(plaintext))).tenant.name == "acme"

    run(go())


def test_cache_is_bounded(store, clock):
    authn = Authenticator(store, cache_s=10, max_entries=8)

    async def go():
        for i in range(40):
            kid = f"{i:02d}".translate(str.maketrans("0123456789", "abcdefghij")) + "a" * 10
            with pytest.raises(AuthError):
                await authn.authenticate(bearer(f"pvd_{kid}_{_VALID_SECRET}"))

    run(go())
    assert len(authn._cache) == 8
    assert authn.db_lookups == 40


def test_store_failure_is_not_cached_and_not_a_500(store, clock):
    run(store.create_tenant("acme"))
    _, plaintext = run(store.create_key("acme"))
    authn = Authenticator(store, cache_s=0.5)
    real_lookup = store.lookup

    async def broken(key_id):
        raise GatewayError(503, "the gateway's state store is unavailable", code="store_unavailable")

    store.lookup = broken
    with pytest.raises(GatewayError) as err:
        run(authn.authenticate(bearer(plaintext)))
    assert err.value.status == 503
    store.lookup = real_lookup
    assert run(authn.authenticate(bearer(plaintext))).tenant.name == "acme"


# -- admin key --------------------------------------------------------------------------------


def test_admin_auth():
    admin = AdminAuth("the-admin-key-123")
    admin.check("Bearer the-admin-key-123")
    admin.check("bearer   the-admin-key-123 ")
    assert "the-admin-key-123" not in repr(admin) and "the-admin-key-123" not in repr(vars(admin))
    for header, code in [
        (None, "missing_api_key"),
        ("Bearer", "missing_api_key"),
        ("Bearer the-admin-key-12", "invalid_api_key"),
        ("Bearer the-admin-key-1234", "invalid_api_key"),
        ("Basic the-admin-key-123", "invalid_api_key"),
        ("Bearer " + "é" * 50, "invalid_api_key"),
        ("Bearer \udcff", "invalid_api_key"),
    ]:
        with pytest.raises(AuthError) as err:
            admin.check(header)
        assert err.value.status == 401 and err.value.code == code, header
    with pytest.raises(ValueError):
        AdminAuth("  ")


def test_load_admin_key(tmp_path, monkeypatch):
    f = tmp_path / "admin.key"
    f.write_text("  from-file\n")
    monkeypatch.setenv("PAVED_ADMIN_KEY", "from-env")
    assert load_admin_key(f) == "from-file"
    assert load_admin_key(None) == "from-env"
    monkeypatch.setenv("PAVED_ADMIN_KEY", "")
    generated = load_admin_key(None)
    assert generated.startswith("pvd_admin_") and len(generated) >= 40
    assert load_admin_key(None) != generated
    f.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_admin_key(f)
    with pytest.raises(ValueError, match="cannot read"):
        load_admin_key(tmp_path / "missing")
    f.write_bytes(b"x" * 5000)
    with pytest.raises(ValueError, match="larger"):
        load_admin_key(f)


# -- properties -------------------------------------------------------------------------------


class World:
    """One store with two tenants' keys, on one event loop shared by every example."""

    def __init__(self, path: Path):
        self.runner = asyncio.Runner()
        self.store = GatewayStore(f"sqlite:///{path}")
        self.runner.run(self.store.start())
        self.runner.run(self.store.create_tenant("tenant-a"))
        self.runner.run(self.store.create_tenant("tenant-b"))
        self.keys: list[tuple[str, str]] = []  # (tenant, plaintext)
        for tenant in ("tenant-a", "tenant-b"):
            for _ in range(3):
                _, plaintext = self.runner.run(self.store.create_key(tenant))
                self.keys.append((tenant, plaintext))
        self.authn = Authenticator(self.store, cache_s=0.5)

    def authenticate(self, token: str) -> Principal | None:
        try:
            return self.runner.run(self.authn.authenticate(bearer(token)))
        except AuthError:
            return None

    def close(self) -> None:
        self.runner.run(self.store.close())
        self.runner.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("prop") / "gw.db")
    yield w
    w.close()


_TOKEN_CHARS = string.ascii_letters + string.digits + "_-=+/. é\x00"


@settings(max_examples=300, deadline=None)
@given(i=st.integers(0, 5), j=st.integers(0, 5))
def test_a_key_never_authenticates_as_another_tenant(world, i, j):
    tenant_i, key_i = world.keys[i]
    _, key_j = world.keys[j]
    principal = world.authenticate(key_i)
    assert principal is not None and principal.tenant.name == tenant_i
    # One key's id with another key's secret.
    id_i, _ = keys.parse_key(key_i)
    _, secret_j = keys.parse_key(key_j)
    spliced = world.authenticate(f"pvd_{id_i}_{secret_j}")
    if i == j:
        assert spliced is not None and spliced.tenant.name == tenant_i
    else:
        assert spliced is None


@settings(max_examples=500, deadline=None)
@given(
    which=st.integers(0, 5),
    edits=st.lists(
        st.tuples(
            st.sampled_from(["replace", "insert", "delete"]),
            st.integers(0, 60),
            st.sampled_from(_TOKEN_CHARS),
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_mutations_of_a_valid_key_never_authenticate(world, which, edits):
    tenant, original = world.keys[which]
    token = original
    for op, pos, ch in edits:
        pos = min(pos, len(token))
        if op == "replace" and pos < len(token):
            token = token[:pos] + ch + token[pos + 1 :]
        elif op == "insert":
            token = token[:pos] + ch + token[pos:]
        elif op == "delete" and pos < len(token):
            token = token[:pos] + token[pos + 1 :]
    principal = world.authenticate(token)
    # Whitespace around the token is the header's, not the key's (it is stripped).
    if token.strip() == original:
        assert principal is not None and principal.tenant.name == tenant
    else:
        assert principal is None


@settings(max_examples=300, deadline=None)
@given(token=st.text(max_size=80))
def test_random_tokens_never_authenticate(world, token):
    assert world.authenticate(token) is None


def test_database_work_does_not_queue_behind_the_default_thread_pool(store):
    """Every worker of asyncio's default pool busy (batch files being validated, written):
    the store's calls, every request's key lookup among them, still run at once on threads of
    their own. With the old code the call waited for the pool and this timed out."""

    async def go() -> str:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=2))
        release = threading.Event()
        busy = [loop.run_in_executor(None, release.wait, 60) for _ in range(2)]
        try:
            return await asyncio.wait_for(store.run(lambda: threading.current_thread().name), 20)
        finally:
            release.set()
            await asyncio.gather(*busy)

    assert run(go()).startswith("paved-db")


def test_a_key_expiry_past_year_9999_in_utc_is_a_400(store):
    """9999-12-31T23:59:59-14:00 is a valid time whose UTC conversion overflows (it was a 500)."""
    from datetime import datetime, timedelta, timezone

    run(store.create_tenant("acme"))
    late = datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone(timedelta(hours=-14)))
    with pytest.raises(GatewayError) as info:
        run(store.create_key("acme", expires_at=late))
    assert info.value.status == 400 and info.value.param == "expires_at"

"""Two control-plane replicas on one real PostgreSQL 15: two ControlStores on one database.

Covers: concurrent start() (the DDL race of a rolling deploy), state written by one replica read
by the other, the races the partial unique indexes and compare-and-set settle (one deployment
per (model, version), one current per model, one running rollout per model, update_rollout
with expect_phase from both replicas: exactly one wins), routes revisions from both replicas
strictly increasing, LeaderLock exclusivity across replicas and takeover once the holder
releases or its connection dies, and 503 once the database is gone.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import psycopg
import pytest

from paved.control_plane.errors import ControlError
from paved.control_plane.leader import LeaderLock
from paved.control_plane.store import ControlStore
from paved.control_plane.types import DeploymentSpec, Replica
from paved.testing.postgres import create_database, postgres_server

_db_names = itertools.count()
FP = {"kind": "generate"}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with postgres_server() as url:
        yield url


@pytest.fixture
def db_url(server) -> str:
    """A fresh database per test (much cheaper than a fresh cluster)."""
    return create_database(server, f"cp_{next(_db_names)}")


def run(coro):
    return asyncio.run(coro)


async def two(db_url: str) -> tuple[ControlStore, ControlStore]:
    a, b = ControlStore(db_url), ControlStore(db_url)
    # The race a rolling deploy causes: every replica creates the schema at once.
    await asyncio.gather(a.start(), b.start(), ControlStore(db_url).start())
    return a, b


def split(results: list) -> tuple[list, list[ControlError]]:
    wins = [r for r in results if not isinstance(r, BaseException)]
    errors = [r for r in results if isinstance(r, BaseException)]
    assert all(isinstance(e, ControlError) for e in errors), errors
    return wins, errors  # type: ignore[return-value]


def test_url_forms_select_psycopg(db_url):
    store = ControlStore(db_url)
    assert store.dialect == "postgresql"
    assert store._engine.url.drivername == "postgresql+psycopg"


def test_two_replicas_share_state_and_settle_races(db_url):
    async def go():
        a, b = await two(db_url)
        await asyncio.gather(a.start(), b.start())  # and again: idempotent

        # Both replicas create the same deployment at once: one row, one 409.
        wins, errors = split(
            await asyncio.gather(
                *(s.create_deployment(DeploymentSpec("llama", "1", "/p"), FP) for s in (a, b, a, b)),
                return_exceptions=True,
            )
        )
        assert len(wins) == 1 and [e.status for e in errors] == [409, 409, 409]
        dep = wins[0]
        assert await b.get_deployment("llama", "1") == dep
        await a.create_deployment(DeploymentSpec("llama", "2", "/p", strategy="versioned"), FP)

        # Both flip `current` back and forth: exactly one current at the end.
        split(
            await asyncio.gather(
                *(s.set_current("llama", v) for s, v in zip((a, b, a, b), ("1", "2", "2", "1"), strict=True)),
                return_exceptions=True,
            )
        )
        current = [d.spec.version for d in await b.list_deployments("llama") if d.current]
        assert len(current) == 1

        # Concurrent desired-count changes through both replicas: neither is lost half-way.
        await asyncio.gather(a.update_deployment(dep.id, replicas=3), b.update_deployment(dep.id, no_gc=True))
        seen = await a.get_deployment_by_id(dep.id)
        assert seen.spec.replicas == 3 and seen.spec.no_gc

        r = Replica("rep_1", dep.id, "local", "starting", "http://127.0.0.1:1", "http://127.0.0.1:2")
        await a.add_replica(r)
        assert (await b.update_replica("rep_1", state="ready")).state == "ready"
        assert (await a.get_replica("rep_1")).state == "ready"

        event = await a.audit("scale", "1 -> 3", model_id="llama", version="1", data={"to": 3})
        assert [e.id for e in await b.list_audit(model_id="llama")] == [event.id]
        assert (await b.list_audit())[0].at == event.at
        await a.close()
        await b.close()

    run(go())


def test_rollout_compare_and_set_from_both_replicas(db_url):
    async def go():
        a, b = await two(db_url)
        wins, errors = split(
            await asyncio.gather(
                *(s.create_rollout("llama", "1", "2", "red_black", {}) for s in (a, b, a, b)),
                return_exceptions=True,
            )
        )
        assert len(wins) == 1 and all(e.status == 409 for e in errors)
        ro = wins[0]
        # Several rounds: each time both replicas try to advance from the same phase.
        phase = "starting"
        for step in range(5):
            attempts = [
                s.update_rollout(
                    ro.id, phase=f"step:{step}", expect_phase=phase, state={"by": name, "step": step}
                )
                for s, name in ((a, "a"), (b, "b"), (a, "a2"), (b, "b2"))
            ]
            wins, errors = split(await asyncio.gather(*attempts, return_exceptions=True))
            assert len(wins) == 1, (step, wins)
            assert len(errors) == 3 and all(e.status == 409 and e.code == "phase_conflict" for e in errors)
            stored = await b.get_rollout(ro.id)
            assert stored.phase == f"step:{step}" and stored.state == wins[0].state
            phase = stored.phase
        await a.request_abort(ro.id, "stop")
        later = await b.update_rollout(ro.id, phase="rolling_back", expect_phase=phase, state={"x": 1})
        assert later.state["abort_requested"] is True and later.state["x"] == 1
        await a.close()
        await b.close()

    run(go())


def test_routes_revisions_from_both_replicas(db_url):
    async def go():
        a, b = await two(db_url)
        revisions = await asyncio.gather(*(s.publish_routes({"n": i}) for i, s in enumerate([a, b] * 6)))
        assert len(set(revisions)) == 12
        latest = await b.latest_routes()
        assert latest is not None and latest[0] == max(revisions)
        # The same table from both at once: deduplicated against whichever committed first.
        same = await asyncio.gather(a.publish_routes({"final": True}), b.publish_routes({"final": True}))
        assert same[0] == same[1] == (await a.latest_routes())[0]
        await a.close()
        await b.close()

    run(go())


def test_leader_lock_exclusive_and_taken_over(db_url):
    async def go():
        a, b = LeaderLock(db_url), LeaderLock(db_url)
        results = await asyncio.gather(a.try_acquire(), b.try_acquire())
        assert sorted(results) == [False, True]
        holder, other = (a, b) if results[0] else (b, a)
        assert holder.is_leader and await holder.check()
        assert not other.is_leader and not await other.check()
        assert not await other.try_acquire()
        await holder.release()
        assert not holder.is_leader
        assert await other.try_acquire() and await other.check()
        assert not await holder.try_acquire()

        # The holder's session dies (a crash, a network partition): the server frees the lock.
        with psycopg.connect(db_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'paved-leader'"
            )
        assert not await other.check() and not other.is_leader
        assert await holder.try_acquire()
        await holder.release()
        await other.release()

    run(go())


def test_database_gone_is_503(server):
    url = create_database(server, f"cp_{next(_db_names)}")

    async def go():
        s = ControlStore(url)
        await s.start()
        await s.create_deployment(DeploymentSpec("llama", "1", "/p"), FP)
        await s.close()
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE {url.rsplit('/', 1)[1]} WITH (FORCE)")
        with pytest.raises(ControlError) as err:
            await s.list_deployments()
        assert err.value.status == 503 and "postgres" not in err.value.message
        assert not await LeaderLock(url).try_acquire()

    run(go())

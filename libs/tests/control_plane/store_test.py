"""ControlStore on SQLite, and LeaderLock on SQLite (file flock and in-memory).

Covers: deployments (validation, one live row per (model, version), exactly one current per
model, updates kept within [min, max], delete), replicas (forward-only states, filters),
rollouts (one running per model, compare-and-set on the phase from many tasks and from two
stores on one file, sticky abort requests), the audit log (order, after_id, limit, filters),
routes revisions (monotonic, identical content deduplicated, pruned), 503 when the database
cannot be opened, and the leader lock (exclusive, handed over on release, lost with the
holder's process, check() noticing a replaced lock file).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from paved.control_plane import store as store_mod
from paved.control_plane.errors import ControlError
from paved.control_plane.leader import LeaderLock
from paved.control_plane.store import ControlStore, spec_from_dict, spec_to_dict
from paved.control_plane.types import AutoscalePolicy, DeploymentSpec, Replica

FP = {"kind": "generate", "tokenizer_sha256": "a" * 64}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'cp.db'}"


@pytest.fixture
def store(url: str) -> Iterator[ControlStore]:
    s = ControlStore(url)
    run(s.start())
    yield s
    run(s.close())


def spec(version: str = "1", **kw) -> DeploymentSpec:
    return DeploymentSpec(model_id=kw.pop("model_id", "llama"), version=version, package_uri="/pkg", **kw)


def status_of(coro) -> int:
    with pytest.raises(ControlError) as err:
        run(coro)
    return err.value.status


def replica(dep_id: str, rid: str = "rep_1", state: str = "starting", region: str = "local") -> Replica:
    return Replica(
        id=rid,
        deployment_id=dep_id,
        region=region,
        state=state,  # type: ignore[arg-type]
        url="http://127.0.0.1:1",
        admin_url="http://127.0.0.1:2",
        driver_ref={"pid": 1, "start_time": 2},
    )


# -- deployments ---------------------------------------------------------------------------


def test_start_is_idempotent_and_two_stores_share_a_file(url):
    a, b = ControlStore(url), ControlStore(url)

    async def go():
        await asyncio.gather(a.start(), b.start(), a.start())
        dep = await a.create_deployment(spec(), FP)
        assert await b.get_deployment_by_id(dep.id) == dep
        await a.close()
        await b.close()

    run(go())


def test_create_get_list_and_duplicate(store):
    dep = run(store.create_deployment(spec(regions=("us", "eu")), FP))
    assert dep.id.startswith("dep_") and dep.state == "active" and not dep.current
    assert dep.created_at.tzinfo is not None
    assert run(store.get_deployment("llama", "1")) == dep
    assert run(store.get_deployment_by_id(dep.id)) == dep
    assert run(store.get_deployment("llama", "2")) is None
    assert run(store.get_deployment("bad name", "1")) is None
    assert status_of(store.create_deployment(spec(), FP)) == 409
    other = run(store.create_deployment(spec("2"), FP))
    run(store.create_deployment(spec("1", model_id="other"), FP))
    assert [d.id for d in run(store.list_deployments("llama"))] == [dep.id, other.id]
    assert len(run(store.list_deployments())) == 3


def test_delete_frees_the_version_and_clears_current(store):
    dep = run(store.create_deployment(spec(), FP))
    run(store.set_current("llama", "1"))
    deleted = run(store.delete_deployment(dep.id))
    assert deleted.state == "deleted" and not deleted.current
    assert run(store.delete_deployment(dep.id)).state == "deleted"  # idempotent
    assert run(store.get_deployment("llama", "1")) is None
    assert run(store.list_deployments("llama")) == []
    assert [d.id for d in run(store.list_deployments("llama", include_deleted=True))] == [dep.id]
    again = run(store.create_deployment(spec(), FP))
    assert again.id != dep.id
    assert status_of(store.delete_deployment("dep_missing")) == 404
    assert status_of(store.update_deployment(dep.id, replicas=2)) == 409


@pytest.mark.parametrize(
    "bad",
    [
        {"model_id": "has space"},
        {"model_id": ""},
        {"version": "../1"},
        {"strategy": "canary"},
        {"min_replicas": 3, "max_replicas": 2},
        {"replicas": 5, "max_replicas": 4},
        {"replicas": True},
        {"min_replicas": -1},
        {"regions": ()},
        {"regions": ("us", "us")},
        {"regions": ("bad region",)},
        {"regions": ["us"]},
        {"engine": "vllm"},
        {"package_uri": ""},
        {"autoscale": AutoscalePolicy(target_waiting=0)},
        {"autoscale": AutoscalePolicy(target_kv_usage=1.5)},
        {"autoscale": AutoscalePolicy(panic_window_s=100, stable_window_s=10)},
        {"autoscale": AutoscalePolicy(panic_threshold=0.5)},
        {"autoscale": AutoscalePolicy(interval_s=float("nan"))},
        {"no_gc": "yes"},
    ],
)
def test_invalid_specs_are_400(store, bad):
    values = {"model_id": "llama", "version": "1", "package_uri": "/pkg"} | bad
    assert status_of(store.create_deployment(DeploymentSpec(**values), FP)) == 400
    assert run(store.list_deployments(include_deleted=True)) == []


def test_fingerprint_must_be_json(store):
    assert status_of(store.create_deployment(spec(), {"x": object()})) == 400
    assert status_of(store.create_deployment(spec(), ["not", "a", "dict"])) == 400  # type: ignore[arg-type]


def test_spec_round_trips_through_json():
    s = spec(regions=("a", "b"), autoscale=AutoscalePolicy(enabled=True, target_waiting=3), engine="sim://x")
    assert spec_from_dict(spec_to_dict(s)) == s
    with pytest.raises(ControlError) as err:
        spec_from_dict(spec_to_dict(s) | {"surprise": 1})
    assert err.value.status == 400 and "surprise" in err.value.message
    with pytest.raises(ControlError):
        spec_from_dict(spec_to_dict(s) | {"autoscale": {"nope": 1}})


def test_a_stored_spec_that_no_longer_validates_still_loads(store):
    """A rule tightened since a deployment was stored, or fields a newer control plane wrote,
    leave the row readable: one such row used to fail every list (and so every reconcile pass,
    for every deployment)."""
    import sqlalchemy as sa

    dep = run(store.create_deployment(spec(), {}))
    run(store.create_deployment(spec("2"), {}))
    with store._engine.begin() as conn:
        raw = conn.execute(
            sa.text("SELECT spec FROM cp_deployments WHERE id = :id"), {"id": dep.id}
        ).scalar_one()
        stored = json.loads(raw) if isinstance(raw, str) else dict(raw)
        stored |= {"min_replicas": 3, "max_replicas": 2, "from_the_future": True}
        stored["autoscale"] = {**stored["autoscale"], "also_new": 1}
        conn.execute(
            sa.text("UPDATE cp_deployments SET spec = :spec WHERE id = :id"),
            {"spec": json.dumps(stored), "id": dep.id},
        )
    listed = {d.spec.version: d for d in run(store.list_deployments())}
    assert set(listed) == {"1", "2"} and listed["1"].spec.min_replicas == 3
    # State and traffic writes do not check it again; a spec change keeps the unknown fields.
    run(store.update_deployment(dep.id, state="inactive"))
    run(store.update_deployment(dep.id, state="active"))
    run(store.update_deployment(dep.id, no_gc=True, min_replicas=1, max_replicas=2))
    with store._engine.begin() as conn:
        raw = conn.execute(
            sa.text("SELECT spec FROM cp_deployments WHERE id = :id"), {"id": dep.id}
        ).scalar_one()
    stored = json.loads(raw) if isinstance(raw, str) else dict(raw)
    assert stored["from_the_future"] is True and stored["no_gc"] is True
    # A new spec breaking the same rule is still refused.
    assert status_of(store.create_deployment(spec("3", min_replicas=3, max_replicas=2), {})) == 400


def test_update_deployment_keeps_replicas_within_bounds(store):
    dep = run(store.create_deployment(spec(min_replicas=1, max_replicas=4, replicas=1), FP))
    assert run(store.update_deployment(dep.id, replicas=4)).spec.replicas == 4
    assert status_of(store.update_deployment(dep.id, replicas=5)) == 400
    # Lowering max below the current desired count is refused unless replicas moves too.
    assert status_of(store.update_deployment(dep.id, max_replicas=2)) == 400
    upd = run(store.update_deployment(dep.id, max_replicas=2, replicas=2, min_replicas=2))
    assert (upd.spec.min_replicas, upd.spec.replicas, upd.spec.max_replicas) == (2, 2, 2)
    policy = AutoscalePolicy(enabled=True, target_waiting=4)
    at = datetime(2030, 1, 1, 12, tzinfo=UTC)
    upd = run(
        store.update_deployment(dep.id, state="inactive", no_gc=True, autoscale=policy, last_traffic_at=at)
    )
    assert upd.state == "inactive" and upd.spec.no_gc and upd.spec.autoscale == policy
    assert upd.last_traffic_at == at
    assert run(store.get_deployment_by_id(dep.id)) == upd
    assert status_of(store.update_deployment(dep.id, state="deleted")) == 400  # type: ignore[arg-type]
    assert status_of(store.update_deployment(dep.id, last_traffic_at=datetime(2030, 1, 1))) == 400
    assert status_of(store.update_deployment(dep.id, autoscale=AutoscalePolicy(panic_threshold=0))) == 400
    assert status_of(store.update_deployment("dep_missing", replicas=1)) == 404
    # A refused update changed nothing.
    assert run(store.get_deployment_by_id(dep.id)) == upd


def test_exactly_one_current_per_model(store):
    for v in ("1", "2", "3"):
        run(store.create_deployment(spec(v, strategy="versioned"), FP))
    run(store.create_deployment(spec("1", model_id="other"), FP))
    run(store.set_current("other", "1"))

    async def race():
        await asyncio.gather(*(store.set_current("llama", v) for v in ("1", "2", "3", "2", "1")))

    run(race())
    current = [d.spec.version for d in run(store.list_deployments("llama")) if d.current]
    assert len(current) == 1
    assert run(store.set_current("llama", "3")).current
    assert [d.spec.version for d in run(store.list_deployments("llama")) if d.current] == ["3"]
    assert run(store.get_deployment("other", "1")).current  # another model's current untouched
    assert status_of(store.set_current("llama", "9")) == 404


# -- replicas ------------------------------------------------------------------------------


def test_replica_lifecycle_is_forward_only(store):
    dep = run(store.create_deployment(spec(), FP))
    r = run(store.add_replica(replica(dep.id)))
    assert run(store.get_replica("rep_1")) == r
    assert status_of(store.add_replica(replica(dep.id))) == 409
    assert status_of(store.add_replica(replica("dep_missing", "rep_2"))) == 404
    assert run(store.update_replica("rep_1", state="ready")).state == "ready"
    assert (
        run(store.update_replica("rep_1", state="unhealthy", reason="probe failed")).reason == "probe failed"
    )
    assert run(store.update_replica("rep_1", state="ready", reason=None)).reason is None
    assert status_of(store.update_replica("rep_1", state="starting")) == 409
    assert run(store.update_replica("rep_1", state="draining")).state == "draining"
    assert status_of(store.update_replica("rep_1", state="ready")) == 409
    final = run(store.update_replica("rep_1", state="stopped", driver_ref={"pid": 7}))
    assert final.state == "stopped" and final.driver_ref == {"pid": 7}
    assert status_of(store.update_replica("rep_1", state="failed")) == 409
    assert status_of(store.update_replica("rep_1", pid=3)) == 400
    assert status_of(store.update_replica("rep_1", state="gone")) == 400
    assert status_of(store.update_replica("rep_missing", state="ready")) == 404
    assert run(store.get_replica("rep_1")) == final


def test_list_and_delete_replicas(store):
    a = run(store.create_deployment(spec("1"), FP))
    b = run(store.create_deployment(spec("2"), FP))
    run(store.add_replica(replica(a.id, "r1", region="us")))
    run(store.add_replica(replica(a.id, "r2", state="ready", region="eu")))
    run(store.add_replica(replica(b.id, "r3", state="ready", region="us")))
    ids = lambda rs: sorted(r.id for r in rs)  # noqa: E731
    assert ids(run(store.list_replicas())) == ["r1", "r2", "r3"]
    assert ids(run(store.list_replicas(deployment_id=a.id))) == ["r1", "r2"]
    assert ids(run(store.list_replicas(region="us"))) == ["r1", "r3"]
    assert ids(run(store.list_replicas(states=["ready"]))) == ["r2", "r3"]
    assert ids(run(store.list_replicas(deployment_id=a.id, region="us", states={"starting"}))) == ["r1"]
    assert status_of(store.list_replicas(states="ready")) == 400
    assert status_of(store.list_replicas(states=["bogus"])) == 400
    assert status_of(store.add_replica(replica(a.id, "bad id"))) == 400
    assert status_of(store.add_replica(replica(a.id, "r9", state="weird"))) == 400
    assert run(store.delete_replica("r1")) is True
    assert run(store.delete_replica("r1")) is False
    assert run(store.get_replica("r1")) is None


# -- rollouts ------------------------------------------------------------------------------


def test_one_running_rollout_per_model(store):
    ro = run(store.create_rollout("llama", "1", "2", "red_black", {"phases": [50, 100]}))
    assert ro.id.startswith("ro_") and ro.status == "running" and ro.phase == "starting" and ro.state == {}
    assert status_of(store.create_rollout("llama", "1", "3", "red_black", {})) == 409
    run(store.create_rollout("other", None, "1", "versioned", {}))
    done = run(store.update_rollout(ro.id, status="succeeded", phase="done", reason="ok"))
    assert (done.status, done.phase, done.reason) == ("succeeded", "done", "ok")
    second = run(store.create_rollout("llama", "2", "3", "red_black", {}))
    # Reviving the finished one while another runs would make two running rollouts.
    assert status_of(store.update_rollout(ro.id, status="running")) == 409
    assert [r.id for r in run(store.list_rollouts("llama"))] == [ro.id, second.id]
    assert [r.id for r in run(store.list_rollouts(status="running", model_id="llama"))] == [second.id]
    assert status_of(store.list_rollouts(status="weird")) == 400
    assert status_of(store.create_rollout("llama", None, "4", "canary", {})) == 400  # type: ignore[arg-type]
    assert status_of(store.create_rollout("bad id", None, "4", "red_black", {})) == 400
    assert status_of(store.update_rollout("ro_missing", phase="x")) == 404
    assert run(store.get_rollout("ro_missing")) is None
    # What the dashboard and /metrics read, without loading every rollout on record.
    assert [r.id for r in run(store.newest_rollouts(2))] == [
        second.id,
        run(store.list_rollouts("other"))[0].id,
    ]
    assert run(store.rollout_counts()) == {
        ("llama", "succeeded"): 1,
        ("llama", "running"): 1,
        ("other", "running"): 1,
    }
    assert status_of(store.newest_rollouts(0)) == 400


def test_compare_and_set_has_exactly_one_winner(store):
    ro = run(store.create_rollout("llama", "1", "2", "red_black", {}))

    async def race():
        attempts = [
            store.update_rollout(ro.id, phase="health_gate", expect_phase="starting", state={"by": i})
            for i in range(8)
        ]
        return await asyncio.gather(*attempts, return_exceptions=True)

    results = run(race())
    wins = [r for r in results if not isinstance(r, BaseException)]
    losses = [r for r in results if isinstance(r, ControlError)]
    assert len(wins) == 1 and len(losses) == 7
    assert all(e.status == 409 and e.code == "phase_conflict" for e in losses)
    stored = run(store.get_rollout(ro.id))
    assert stored.phase == "health_gate" and stored.state == wins[0].state


def test_compare_and_set_across_two_stores_on_one_file(url):
    a, b = ControlStore(url), ControlStore(url)

    async def go():
        await a.start()
        await b.start()
        ro = await a.create_rollout("llama", "1", "2", "red_black", {})
        results = await asyncio.gather(
            *(
                s.update_rollout(ro.id, phase=f"shift:{i}", expect_phase="starting")
                for i, s in enumerate([a, b, a, b])
            ),
            return_exceptions=True,
        )
        final = await b.get_rollout(ro.id)
        await a.close()
        await b.close()
        return results, final

    results, final = run(go())
    wins = [r for r in results if not isinstance(r, BaseException)]
    assert len(wins) == 1
    assert all(isinstance(r, ControlError) and r.status == 409 for r in results if r not in wins)
    assert final.phase == wins[0].phase


def test_abort_request_is_sticky(store):
    ro = run(store.create_rollout("llama", "1", "2", "red_black", {}))
    run(store.update_rollout(ro.id, state={"step": 1}))
    aborted = run(store.request_abort(ro.id, "operator said so"))
    assert aborted.state == {"step": 1, "abort_requested": True, "abort_reason": "operator said so"}
    # A state machine that read the record before the abort writes its own state: kept anyway.
    later = run(store.update_rollout(ro.id, state={"step": 2}, phase="shift:0", expect_phase="starting"))
    assert later.state == {"step": 2, "abort_requested": True, "abort_reason": "operator said so"}
    run(store.update_rollout(ro.id, status="rolled_back", phase="rolled_back"))
    assert status_of(store.request_abort(ro.id)) == 409
    assert status_of(store.update_rollout(ro.id, state={"x": float("inf")})) == 400
    assert status_of(store.update_rollout(ro.id, status="paused")) == 400  # type: ignore[arg-type]


# -- audit ---------------------------------------------------------------------------------


def test_audit_order_filters_and_paging(store):
    events = [
        run(store.audit("scale", f"event {i}", model_id="llama" if i % 2 else "other", data={"i": i}))
        for i in range(6)
    ]
    run(store.audit("rollout.phase", "phase", model_id="llama", version="2", rollout_id="ro_x"))
    leader = run(store.audit("leader", "control plane pid 1 became the leader"))
    ids = [e.id for e in events]
    assert ids == sorted(ids) and len(set(ids)) == 6
    assert [e.id for e in run(store.list_audit())] == [*ids, ids[-1] + 1, leader.id]
    assert [e.data["i"] for e in run(store.list_audit(model_id="llama", limit=2))] == [1, 3]
    # A model's events include the fleet-wide ones (no model), such as a leader change.
    assert [e.data.get("i", e.kind) for e in run(store.list_audit(model_id="other"))] == [0, 2, 4, "leader"]
    assert [e.data.get("i") for e in run(store.list_audit(after_id=ids[3]))] == [4, 5, None, None]
    (by_rollout,) = run(store.list_audit(rollout_id="ro_x"))
    assert by_rollout.kind == "rollout.phase" and by_rollout.version == "2" and by_rollout.at.tzinfo
    assert status_of(store.list_audit(limit=0)) == 400
    assert status_of(store.list_audit(limit=10_000)) == 400
    assert status_of(store.audit("", "empty kind")) == 400
    assert status_of(store.audit("k", "m", data={"f": float("nan")})) == 400


# -- routes --------------------------------------------------------------------------------


def test_routes_revisions(store, monkeypatch):
    assert run(store.latest_routes()) is None
    t1 = {"models": {"llama": {"backends": ["a"]}}}
    t2 = {"models": {"llama": {"backends": ["a", "b"]}}}
    r1 = run(store.publish_routes(t1))
    assert run(store.publish_routes({"models": {"llama": {"backends": ["a"]}}})) == r1  # same content
    r2 = run(store.publish_routes(t2))
    assert r2 > r1
    r3 = run(store.publish_routes(t1))  # back to an older table: a new revision, not the old one
    assert r3 > r2
    assert run(store.latest_routes()) == (r3, t1)
    assert status_of(store.publish_routes(["not a table"])) == 400  # type: ignore[arg-type]
    monkeypatch.setattr(store_mod, "ROUTES_KEPT", 3)
    last = 0
    for i in range(6):
        last = run(store.publish_routes({"n": i}))
    with store._engine.connect() as conn:
        kept = conn.execute(store_mod.routes_table.select()).all()
    assert sorted(r.revision for r in kept) == [last - 2, last - 1, last]


def test_concurrent_publishers_get_distinct_increasing_revisions(store):
    async def go():
        return await asyncio.gather(*(store.publish_routes({"n": i}) for i in range(10)))

    revisions = run(go())
    assert len(set(revisions)) == 10
    assert run(store.latest_routes())[0] == max(revisions)


def test_unreachable_database_is_503(tmp_path):
    s = ControlStore(f"sqlite:///{tmp_path / 'missing-dir' / 'cp.db'}")
    err = status_of(s.start())
    assert err == 503
    assert status_of(s.list_deployments()) == 503
    with pytest.raises(ValueError):
        ControlStore("mysql://x/y")


# -- leader (SQLite) -----------------------------------------------------------------------


def test_leader_lock_is_exclusive_and_handed_over(url):
    a, b = LeaderLock(url), LeaderLock(url)
    other_name = LeaderLock(url, name="another-loop")

    async def go():
        assert await a.try_acquire() and a.is_leader
        assert await a.try_acquire()  # re-acquiring what one holds is a no-op
        assert not await b.try_acquire() and not b.is_leader
        assert await a.check()
        assert not await b.check()
        assert await other_name.try_acquire()  # a different name is a different lock
        await a.release()
        assert not a.is_leader and not await a.check()
        assert await b.try_acquire()
        assert not await a.try_acquire()
        await b.release()
        await b.release()  # idempotent
        await other_name.release()

    run(go())


def test_leader_lock_file_replaced_is_noticed(url, tmp_path):
    a = LeaderLock(url)

    async def go():
        assert await a.try_acquire()
        os.unlink(str(tmp_path / "cp.db") + ".leader")
        # Someone removed the file: another process could lock a new one, so "no longer held".
        assert not await a.check()
        assert not a.is_leader
        b = LeaderLock(url)
        assert await b.try_acquire()
        await b.release()

    run(go())


def test_leader_lock_in_memory_is_process_local():
    a, b = LeaderLock("sqlite://"), LeaderLock("sqlite://")

    async def go():
        assert await a.try_acquire()
        assert not await b.try_acquire()
        await a.release()
        assert await b.try_acquire()
        await b.release()

    run(go())


def test_leader_lock_dies_with_its_process(url):
    holder = textwrap.dedent(
        f"""
        import asyncio, sys
        from paved.control_plane.leader import LeaderLock
        lock = LeaderLock({url!r})
        assert asyncio.run(lock.try_acquire())
        print("held", flush=True)
        sys.stdin.read()  # hold until killed
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen(
        [sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"held"
        mine = LeaderLock(url)
        assert not run(mine.try_acquire())
        proc.kill()
        proc.wait(timeout=30)
        assert run(mine.try_acquire())
        run(mine.release())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_leader_lock_rejects_bad_input():
    with pytest.raises(ControlError):
        LeaderLock("sqlite://", name="")
    with pytest.raises(ValueError):
        LeaderLock("redis://x")

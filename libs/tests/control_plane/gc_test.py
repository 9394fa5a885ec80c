"""GC rules: retention since creation and since traffic (both must be exceeded), never the latest
or current version, never no_gc, always min_kept most recent, active red-black deployments
untouched, protected ids, and policy validation."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from paved.control_plane.errors import BadRequest
from paved.control_plane.gc import GcPolicy, gc_candidates
from paved.control_plane.types import Deployment, DeploymentSpec

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
DAY = 86400.0


def dep(
    version: str,
    age_days: float,
    *,
    model: str = "m",
    state: str = "inactive",
    strategy: str = "versioned",
    current: bool = False,
    no_gc: bool = False,
    traffic_days_ago: float | None = None,
) -> Deployment:
    spec = DeploymentSpec(model, version, f"/pkg/{version}", strategy=strategy, no_gc=no_gc)  # type: ignore[arg-type]
    last = None if traffic_days_ago is None else NOW - timedelta(days=traffic_days_ago)
    return Deployment(
        id=f"dep_{model}_{version}",
        spec=spec,
        fingerprint={},
        created_at=NOW - timedelta(days=age_days),
        state=state,  # type: ignore[arg-type]
        current=current,
        last_traffic_at=last,
    )


def versions(result: list[tuple[Deployment, str]]) -> list[str]:
    return [d.spec.version for d, _ in result]


def test_retention_since_created_and_min_kept() -> None:
    deps = [dep(f"v{i}", age_days=10 - i) for i in range(1, 6)]  # v1 oldest (9 d) .. v5 (5 d)
    policy = GcPolicy(retain_s_since_created=6 * DAY, retain_s_since_traffic=None, min_kept=2)
    result = gc_candidates(deps, policy, NOW)
    # v4, v5 are the two newest (kept); v3 is 7 d old, v1/v2 older: all beyond 6 d.
    assert versions(result) == ["v1", "v2", "v3"]
    reason = dict((d.spec.version, r) for d, r in result)["v1"]
    assert "created 777600 s ago (retain 518400 s)" in reason
    assert "the 2 newest kept" in reason


def test_never_current_latest_or_pinned() -> None:
    deps = [
        dep("v1", 30, current=True),
        dep("v2", 29, no_gc=True),
        dep("v3", 28),
        dep("v4", 27),
    ]
    policy = GcPolicy(retain_s_since_created=DAY, retain_s_since_traffic=None, min_kept=1)
    assert versions(gc_candidates(deps, policy, NOW)) == ["v3"]
    # The latest is kept even when it is inactive and far beyond retention.
    only = [dep("v9", 400)]
    assert gc_candidates(only, policy, NOW) == []


def test_traffic_retention_needs_both_limits_exceeded() -> None:
    deps = [
        dep("v1", 30, traffic_days_ago=1),  # recent traffic: kept
        dep("v2", 29, traffic_days_ago=20),  # old and idle: collected
        dep("v3", 28),  # never had traffic: idle since creation
        dep("v4", 1),
        dep("v5", 0.5),
    ]
    policy = GcPolicy(retain_s_since_created=7 * DAY, retain_s_since_traffic=7 * DAY, min_kept=2)
    result = gc_candidates(deps, policy, NOW)
    assert versions(result) == ["v2", "v3"]
    reasons = dict((d.spec.version, r) for d, r in result)
    assert "no traffic since creation" in reasons["v3"]
    assert "last traffic 1728000 s ago" in reasons["v2"]
    only_traffic = GcPolicy(retain_s_since_created=None, retain_s_since_traffic=7 * DAY, min_kept=2)
    assert versions(gc_candidates(deps, only_traffic, NOW)) == ["v2", "v3"]


def test_active_red_black_is_serving_and_versioned_active_is_eligible() -> None:
    deps = [
        dep("v1", 30, state="active", strategy="red_black"),
        dep("v2", 29, state="active", strategy="versioned"),
        dep("v3", 28, state="inactive", strategy="red_black"),
        dep("v4", 2, state="active", strategy="red_black"),
        dep("v5", 1, state="active", strategy="red_black"),
    ]
    policy = GcPolicy(retain_s_since_created=7 * DAY, retain_s_since_traffic=None, min_kept=2)
    result = gc_candidates(deps, policy, NOW)
    assert versions(result) == ["v2", "v3"]
    assert dict((d.spec.version, r) for d, r in result)["v2"].startswith("versioned, not current")


def test_models_are_independent_deleted_ignored_and_protected_kept() -> None:
    deps = [
        dep("v1", 30, model="a"),
        dep("v2", 20, model="a"),
        dep("v1", 30, model="b"),
        dep("v0", 40, model="b", state="deleted"),
    ]
    policy = GcPolicy(retain_s_since_created=DAY, retain_s_since_traffic=None, min_kept=1)
    result = gc_candidates(deps, policy, NOW)
    assert [(d.spec.model_id, d.spec.version) for d, _ in result] == [("a", "v1")]
    assert gc_candidates(deps, policy, NOW, protected={"dep_a_v1"}) == []


def test_no_retention_collects_nothing_and_naive_times_are_utc() -> None:
    deps = [dep("v1", 300), dep("v2", 200), dep("v3", 100)]
    assert gc_candidates(deps, GcPolicy(None, None, min_kept=1), NOW) == []
    naive_now = NOW.replace(tzinfo=None)
    assert versions(gc_candidates(deps, GcPolicy(DAY, None, min_kept=1), naive_now)) == ["v1", "v2"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"retain_s_since_created": -1, "retain_s_since_traffic": None},
        {"retain_s_since_created": float("inf"), "retain_s_since_traffic": None},
        {"retain_s_since_created": None, "retain_s_since_traffic": "1d"},
        {"retain_s_since_created": None, "retain_s_since_traffic": None, "min_kept": 0},
        {"retain_s_since_created": None, "retain_s_since_traffic": None, "min_kept": True},
    ],
)
def test_policy_is_validated(kwargs: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        GcPolicy(**kwargs)

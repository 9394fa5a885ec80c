"""Garbage collection of old deployments: which versions may go, and why.

A candidate is a deployment that no longer serves (state `inactive`) or a versioned one that
lives side by side (its pins may simply have stopped), beyond EVERY retention the policy sets
(since created, since its last traffic; a deployment that never had traffic counts from its
creation). A policy with no retention collects nothing. Never collected, whatever the age:
- the model's latest version (by creation time),
- the model's `current` version,
- a `no_gc` (pinned) deployment,
- the `min_kept` most recent versions of the model (deleted ones do not count),
- deployments named in `protected` (e.g. those of a running rollout).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from paved.control_plane.errors import BadRequest
from paved.control_plane.types import Deployment


@dataclass(frozen=True)
class GcPolicy:
    retain_s_since_created: float | None
    retain_s_since_traffic: float | None
    min_kept: int = 2

    def __post_init__(self) -> None:
        for name in ("retain_s_since_created", "retain_s_since_traffic"):
            v = getattr(self, name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0
            ):
                raise BadRequest(f"{name} must be null or a finite number of seconds >= 0 (got {v!r})")
        if isinstance(self.min_kept, bool) or not isinstance(self.min_kept, int) or self.min_kept < 1:
            raise BadRequest(f"min_kept must be an integer >= 1 (got {self.min_kept!r})")


def gc_candidates(
    deployments: list[Deployment],
    policy: GcPolicy,
    now: datetime,
    *,
    protected: Iterable[str] = (),
) -> list[tuple[Deployment, str]]:
    """(deployment, reason) for each deployment the policy lets go, oldest first."""
    if policy.retain_s_since_created is None and policy.retain_s_since_traffic is None:
        return []
    keep_ids = set(protected)
    by_model: dict[str, list[Deployment]] = {}
    for d in deployments:
        if d.state != "deleted":
            by_model.setdefault(d.spec.model_id, []).append(d)
    out: list[tuple[Deployment, str]] = []
    for versions in by_model.values():
        newest_first = sorted(versions, key=lambda d: d.created_at, reverse=True)
        kept_recent = {d.id for d in newest_first[: policy.min_kept]}
        for d in reversed(newest_first):
            if d.id in kept_recent or d.id in keep_ids or d.current or d.spec.no_gc:
                continue
            if d.state != "inactive" and d.spec.strategy != "versioned":
                continue  # an active red-black deployment is serving its alias
            age_s = _seconds(now, d.created_at)
            idle_s = _seconds(now, d.last_traffic_at or d.created_at)
            reasons = []
            if policy.retain_s_since_created is not None:
                if age_s <= policy.retain_s_since_created:
                    continue
                reasons.append(f"created {age_s:.0f} s ago (retain {policy.retain_s_since_created:g} s)")
            if policy.retain_s_since_traffic is not None:
                if idle_s <= policy.retain_s_since_traffic:
                    continue
                seen = (
                    "no traffic since creation"
                    if d.last_traffic_at is None
                    else f"last traffic {idle_s:.0f} s ago"
                )
                reasons.append(f"{seen} (retain {policy.retain_s_since_traffic:g} s)")
            state = "inactive" if d.state == "inactive" else "versioned, not current"
            out.append((d, f"{state}; " + "; ".join(reasons) + f"; the {policy.min_kept} newest kept"))
    return out


def _seconds(now: datetime, then: datetime) -> float:
    # A naive timestamp is UTC (SQLite hands back naive datetimes).
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    if then.tzinfo is None:
        then = then.replace(tzinfo=UTC)
    return (now - then).total_seconds()

"""Rollouts: the state machine that moves a model from one version to the next.

`advance(record, fleet, store, now)` is one idempotent reconcile step from the PERSISTED phase:
it re-reads the record, acts through the `Fleet` (absolute desired counts and absolute weights,
so repeating a step repeats the same calls), then writes the new state with a compare-and-set
on the phase it read (`expect_phase`), and audits every decision. Resuming after a
control-plane restart is calling `advance` again. `now` is wall-clock seconds (time.time()):
it is persisted, so it must survive a restart.

Red-black (`strategy="red_black"` with a previous version), per wave of regions:

    starting      new deployment scaled to its first-phase share (>= 1 replica), weights
                  pinned {old: 100, new: 0} first so nothing reaches it before the shift
    health_gate   wait until the requested new replicas are ready; a failed replica or
                  health_timeout_s -> rolling_back
    shift:i       per region: scale new up within the surge headroom, wait ready, set_weights
                  {new: p, old: 100-p} (one atomic publish), then scale old down to
                  max(warm_reserve, N - new). When the headroom forbids reaching the goal, old is
                  lowered only by what the ready new replicas take over, and the weights follow
                  the ready capacity (never more new weight than p). Failures/timeout -> rolling_back
    analysis:i    after interval_s: analyze the new version since its weight became p (from the
                  gateways' counters persisted when it did, so a restart loses nothing); error
                  rate > max_error_rate or p99 > max_p99_s -> rolling_back; fewer than
                  min_requests -> one more interval (at most 3 in all), then pass
    bake:k        between waves: bake_s with wave k at 100 % before wave k+1 starts
    promoted      every region at 100 % new; new activated; old kept at warm_reserve for
                  fast_rollback_window_s (an abort now is instant: one set_weights back)
    done          old scaled to 0 and deactivated; status succeeded
    rolling_back  FIRST set_weights {old: 100, new: 0} in every region already moved (waves
                  0..k), THEN new scaled to 0 (unless keep_failed, which keeps what fits in the
                  surge) and old back to its original count; wait for old ready (at most
                  health_timeout_s); status rolled_back, or halted (waves) naming the region

Versioned (and a first deploy, which has nothing to shift from): starting (new scaled to N) ->
health_gate -> done (new activated; a versioned `current` moves only with `promote: true` or
when the model has none). Their failures end `failed` after the new is scaled to 0.

Abort: `request_abort` sets `state["abort_requested"]`; the next advance from ANY running phase
goes to rolling_back (from promoted that is the fast rollback). Terminal statuses never move.

Sizes are per region: N = the old version's desired count there (the store's get_desired when
it has one, else spec.replicas) clamped to the new deployment's [min, max]; new.spec.replicas
for a first or versioned deploy and for a region the old version does not serve. old_n = the
old version's count when the rollout began (what a rollback restores).

Capacity invariant: per region, the desired new + desired old never exceeds
cap = max(N, old_n) + surge, and scale-ups count max(desired, ready) of each side so a
lagging drain is never double-counted as free room. With surge 0 one replica may be
unavailable at a time (otherwise nothing could ever move).

State JSON (`record.state`): mode ("red_black"|"versioned"|"first"), new_id, old_id, waves
(list of region lists), wave (index), regions {region: {n, old_n, new, old, weight, failed0}}
(new/old: desired counts this rollout asked for; weight: the new version's last published
weight or null; failed0: failed replicas of the new version before this rollout began),
entered_at (when the phase began), weights_at (when the phase's weight was reached),
baselines {region: the Fleet's counters of the new version at weights_at, or null},
extra_intervals, promoted (bool), rollback {reason, status, region, step} while rolling back,
abort_requested / abort_reason.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

from paved.control_plane.errors import BadRequest, ControlError

if TYPE_CHECKING:
    from paved.control_plane.store import ControlStore, RolloutRecord
    from paved.control_plane.types import Deployment

POLL_S = 1.0  # how soon to come back while waiting on replicas
MAX_WAIT_S = 2.0  # the longest sleep returned while running, so abort requests are seen soon
MAX_EXTRA_INTERVALS = 2  # inconclusive analysis: at most 3 intervals in all, then pass
_MAX_TRANSITIONS = 12  # phase changes chained in one advance call (bounded loop)
_MAX_PHASES = 20
_MAX_WAVES = 64


@dataclass(frozen=True)
class RolloutParams:
    phases: tuple[int, ...] = (25, 50, 100)  # percent of traffic on the new version per phase
    interval_s: float = 10.0  # time in each phase before analysis
    health_timeout_s: float = 600.0
    max_error_rate: float = 0.05  # new version's errors / requests in the phase
    max_p99_s: float | None = None
    min_requests: int = 1  # fewer -> inconclusive -> one more interval (at most 3x), then pass
    surge: int = 1  # replicas allowed above the target total, per region
    warm_reserve: int = 1  # old replicas kept until done
    fast_rollback_window_s: float = 60.0  # old kept (at warm_reserve) after promotion
    keep_failed: bool = False  # keep the failed new version's replicas for debugging
    force: bool = False  # red-black despite an I/O fingerprint change
    waves: tuple[tuple[str, ...], ...] | None = None  # regions per wave, in order; None = all at once
    bake_s: float = 0.0  # wait between waves
    promote: bool = False  # versioned: move `current` to the new version when healthy

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> RolloutParams:
        """Validated: BadRequest naming the field on anything out of range or unknown."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise BadRequest("params must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise BadRequest(f"params: unknown field(s) {unknown}; known: {sorted(known)}")
        kw: dict[str, Any] = {}
        if "phases" in d:
            kw["phases"] = _phases(d["phases"])
        for name, low, allow_zero in (
            ("interval_s", 0.0, True),
            ("health_timeout_s", 0.0, False),
            ("fast_rollback_window_s", 0.0, True),
            ("bake_s", 0.0, True),
        ):
            if name in d:
                kw[name] = _number(name, d[name], low, allow_zero)
        if "max_error_rate" in d:
            v = _number("max_error_rate", d["max_error_rate"], 0.0, True)
            if v > 1.0:
                raise BadRequest("params.max_error_rate must be within [0, 1]")
            kw["max_error_rate"] = v
        if "max_p99_s" in d:
            kw["max_p99_s"] = (
                None if d["max_p99_s"] is None else _number("max_p99_s", d["max_p99_s"], 0.0, False)
            )
        for name, cap in (("min_requests", 10**9), ("surge", 1000), ("warm_reserve", 1000)):
            if name in d:
                kw[name] = _int(name, d[name], 0, cap)
        for name in ("keep_failed", "force", "promote"):
            if name in d:
                if not isinstance(d[name], bool):
                    raise BadRequest(f"params.{name} must be a boolean")
                kw[name] = d[name]
        if "waves" in d:
            kw["waves"] = _waves(d["waves"])
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["phases"] = list(self.phases)
        out["waves"] = None if self.waves is None else [list(w) for w in self.waves]
        return out


def _phases(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list | tuple) or not v or len(v) > _MAX_PHASES:
        raise BadRequest(f"params.phases must be a list of 1..{_MAX_PHASES} percents ending at 100")
    out: list[int] = []
    for p in v:
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 100:
            raise BadRequest(f"params.phases: {p!r} is not an integer percent in 1..100")
        if out and p <= out[-1]:
            raise BadRequest(f"params.phases must be strictly increasing (got {list(v)})")
        out.append(p)
    if out[-1] != 100:
        raise BadRequest(f"params.phases must end at 100 (got {list(v)})")
    return tuple(out)


def _number(name: str, v: Any, low: float, allow_zero: bool) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise BadRequest(f"params.{name} must be a finite number")
    if v < low or (not allow_zero and v <= low):
        raise BadRequest(f"params.{name} must be {'>=' if allow_zero else '>'} {low:g} (got {v})")
    return float(v)


def _int(name: str, v: Any, low: int, high: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise BadRequest(f"params.{name} must be an integer in [{low}, {high}] (got {v!r})")
    return v


def waves_mismatch(waves: Sequence[Sequence[str]], regions: Sequence[str]) -> str | None:
    """Why `waves` cannot roll out a deployment in `regions` (they must name each once), or None."""
    flat = [r for w in waves for r in w]
    if sorted(flat) != sorted(regions):
        listed = [list(w) for w in waves]
        return f"params.waves {listed} must cover exactly the deployment's regions {list(regions)}"
    return None


def _waves(v: Any) -> tuple[tuple[str, ...], ...] | None:
    if v is None:
        return None
    if not isinstance(v, list | tuple) or not v or len(v) > _MAX_WAVES:
        raise BadRequest(f"params.waves must be null or a list of 1..{_MAX_WAVES} region lists")
    seen: set[str] = set()
    out = []
    for wave in v:
        if not isinstance(wave, list | tuple) or not wave:
            raise BadRequest("params.waves: every wave must be a non-empty list of region names")
        for region in wave:
            if not isinstance(region, str) or not region or len(region) > 128:
                raise BadRequest(f"params.waves: {region!r} is not a region name")
            if region in seen:
                raise BadRequest(f"params.waves: region {region!r} appears twice")
            seen.add(region)
        out.append(tuple(wave))
    return tuple(out)


@dataclass(frozen=True)
class Analysis:
    requests: int
    errors: int
    p99_s: float | None


class Fleet(Protocol):
    """What the rollout drives (the controller implements it; tests use a fake)."""

    async def scale(self, deployment_id: str, region: str, replicas: int) -> None: ...
    async def counts(self, deployment_id: str, region: str) -> tuple[int, int]: ...  # (ready, failed)
    async def set_weights(self, model_id: str, region: str, weights: dict[str, float]) -> None: ...
    async def counters(self, model_id: str, version: str, region: str) -> dict[str, Any] | None: ...
    async def analyze(
        self, model_id: str, version: str, region: str, since: float, baseline: dict[str, Any] | None
    ) -> Analysis: ...
    async def activate(self, deployment_id: str) -> None: ...
    async def deactivate(self, deployment_id: str) -> None: ...


class _Fail(Exception):
    """A decision to roll back: message for the audit log and the region that failed."""

    def __init__(self, message: str, region: str | None = None):
        super().__init__(message)
        self.message = message
        self.region = region


def check_fingerprint(old_fp: dict[str, Any] | None, new_fp: dict[str, Any] | None, force: bool) -> None:
    """Red-black swaps one version for the other under the same alias: callers would see a
    different tokenizer, chat template, context length or tensor API mid-stream. Refuse it
    unless forced."""
    a, b = old_fp or {}, new_fp or {}
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if changed and not force:
        raise BadRequest(
            f"the new version changes the model's I/O fingerprint ({', '.join(changed)}); a red-black "
            "rollout would change behaviour under the same alias: use the versioned strategy or force",
            code="fingerprint_changed",
        )


async def request_abort(store: ControlStore, record: RolloutRecord, reason: str = "aborted") -> RolloutRecord:
    """Flag a running rollout for abort; the next advance honours it from any phase. The store
    merges the flag atomically and keeps it through the state machine's own writes. Conflict
    when the rollout is no longer running."""
    updated = await store.request_abort(record.id, reason)
    await store.audit(
        "rollout.abort_requested",
        f"rollout {record.id}: abort requested ({reason}) in phase {updated.phase}",
        model_id=record.model_id,
        version=record.to_version,
        rollout_id=record.id,
    )
    return updated


async def advance(
    record: RolloutRecord, fleet: Fleet, store: ControlStore, now: float
) -> tuple[RolloutRecord, float]:
    """One reconcile step; returns the updated record and when to call again (math.inf once
    the rollout is finished). Raises Conflict (409) when another control plane moved it first."""
    fresh = await store.get_rollout(record.id)
    if fresh is None:
        raise ControlError(404, f"no rollout {record.id}", code="rollout_not_found")
    if fresh.status != "running":
        return fresh, math.inf
    return await _Step(fresh, fleet, store, now).run()


class _Step:
    def __init__(self, record: RolloutRecord, fleet: Fleet, store: ControlStore, now: float):
        self.rec = record
        self.fleet = fleet
        self.store = store
        self.now = now
        self.st: dict[str, Any] = copy.deepcopy(record.state or {})
        self.dirty = False
        self.p = RolloutParams()

    # ---- persistence ---------------------------------------------------------------------
    async def _save(self, **fields_: Any) -> None:
        # The store keeps an abort flagged after our read (abort_* keys are sticky).
        self.rec = await self.store.update_rollout(
            self.rec.id, state=self.st, expect_phase=self.rec.phase, **fields_
        )
        self.dirty = False

    async def _audit(self, kind: str, message: str, **data: Any) -> None:
        await self.store.audit(
            kind,
            f"rollout {self.rec.id} ({self.rec.model_id} {self.rec.from_version or '-'} -> "
            f"{self.rec.to_version}): {message}",
            model_id=self.rec.model_id,
            version=self.rec.to_version,
            rollout_id=self.rec.id,
            data={"phase": self.rec.phase, **data},
        )

    async def _goto(self, phase: str, message: str, **data: Any) -> None:
        previous = self.rec.phase
        self.st["entered_at"] = self.now
        await self._save(phase=phase)
        await self._audit("rollout.phase", f"{previous} -> {phase}: {message}", previous=previous, **data)

    async def _finish(self, status: str, message: str, reason: str | None = None) -> None:
        previous = self.rec.phase
        phase = "done" if status == "succeeded" else previous
        self.st["entered_at"] = self.now
        await self._save(phase=phase, status=status, reason=reason)
        await self._audit("rollout.finished", f"{status}: {message}", status=status, reason=reason)

    # ---- main loop -------------------------------------------------------------------------
    async def run(self) -> tuple[RolloutRecord, float]:
        try:
            return await self._run()
        except Exception:
            # Keep what was already done (a fleet or store call failed midway); the next
            # advance repeats the rest, and repeating an absolute call is harmless.
            if self.dirty:
                with contextlib.suppress(Exception):
                    await self._save()
            raise

    async def _run(self) -> tuple[RolloutRecord, float]:
        try:
            self.p = RolloutParams.from_dict(self.rec.params)
        except BadRequest as e:
            await self._finish("failed", f"invalid params: {e.message}", reason=e.message)
            return self.rec, math.inf
        try:
            for _ in range(_MAX_TRANSITIONS):
                if self.rec.status != "running":
                    return self.rec, math.inf
                phase_before = self.rec.phase
                if "mode" not in self.st:
                    await self._init()
                    continue
                if self.st.get("abort_requested") and self.rec.phase != "rolling_back":
                    reason = self.st.get("abort_reason") or "aborted"
                    due = await self._rollback(f"{reason} (in phase {self.rec.phase})")
                else:
                    due = await self._dispatch()
                if self.rec.status != "running":
                    return self.rec, math.inf
                if due is not None:
                    if self.dirty:
                        await self._save()
                    return self.rec, min(due, self.now + MAX_WAIT_S)
                if self.rec.phase == phase_before and self.dirty:
                    await self._save()
            if self.dirty:
                await self._save()
            return self.rec, self.now
        except _Fail as f:
            due = await self._rollback(f.message, f.region)
            if self.rec.status != "running" or due is None:
                return self.rec, math.inf if self.rec.status != "running" else self.now
            return self.rec, min(due, self.now + MAX_WAIT_S)

    async def _dispatch(self) -> float | None:
        """Run the current phase; a float = wait until then, None = phase changed, go on."""
        name, _, index = self.rec.phase.partition(":")
        if name == "starting":
            return await self._starting()
        if name == "health_gate":
            return await self._health_gate()
        if name == "shift":
            return await self._shift(int(index))
        if name == "analysis":
            return await self._analysis(int(index))
        if name == "bake":
            return await self._bake(int(index))
        if name == "promoted":
            return await self._promoted()
        if name == "done":
            return await self._done()
        if name == "rolling_back":
            return await self._rolling_back()
        await self._finish("failed", f"unknown phase {self.rec.phase!r}", reason="unknown phase")
        return math.inf

    # ---- helpers -------------------------------------------------------------------------
    async def _deployment(self, version: str | None) -> Deployment | None:
        if version is None:
            return None
        return await self.store.get_deployment(self.rec.model_id, version)

    async def _desired(self, d: Deployment, region: str) -> int:
        get = getattr(self.store, "get_desired", None)
        if get is not None:
            desired = await get(d.id)
            if region in desired:
                return int(desired[region])
        return d.spec.replicas if d.state == "active" else 0

    def _wave_regions(self) -> list[str]:
        return list(self.st["waves"][self.st["wave"]])

    def _moved_regions(self) -> list[str]:
        return [r for w in self.st["waves"][: self.st["wave"] + 1] for r in w]

    def _cap(self, rs: dict[str, Any]) -> int:
        return max(rs["n"], rs["old_n"]) + self.p.surge

    def _goals(self, rs: dict[str, Any], percent: int) -> tuple[int, int]:
        n, cap = rs["n"], self._cap(rs)
        if rs["old_n"] == 0:
            return n, 0
        new = n if percent >= 100 else min(n, max(1, math.ceil(percent * n / 100)))
        old = max(min(self.p.warm_reserve, cap - new), n - new, 0)
        return new, min(old, rs["old_n"])

    async def _scale(self, side: str, region: str, replicas: int, why: str) -> None:
        rs = self.st["regions"][region]
        dep = self.st["new_id"] if side == "new" else self.st["old_id"]
        version = self.rec.to_version if side == "new" else self.rec.from_version
        if dep is None:
            return
        before = rs[side]
        await self.fleet.scale(dep, region, replicas)
        rs[side] = replicas
        self.dirty = True
        await self._audit(
            "rollout.scale",
            f"scale {version} in {region} {before} -> {replicas} ({why}; desired {rs['new']} new + "
            f"{rs['old']} old, cap {self._cap(rs)})",
            region=region,
            side=side,
            replicas=replicas,
        )

    async def _weights(self, region: str, new_weight: float, why: str) -> None:
        weights = {self.rec.to_version: float(new_weight)}
        if self.rec.from_version is not None and self.st["old_id"] is not None:
            weights[self.rec.from_version] = float(100 - new_weight)
        await self.fleet.set_weights(self.rec.model_id, region, weights)
        self.st["regions"][region]["weight"] = new_weight
        self.dirty = True
        shown = ", ".join(f"{v}={w:g}" for v, w in weights.items())
        await self._audit(
            "rollout.weights", f"weights in {region}: {shown} ({why})", region=region, weights=weights
        )

    async def _counts(self, region: str) -> tuple[int, int, int]:
        """(ready new, failed new, ready old); a failed new replica is a rollback."""
        ready_new, failed_new = await self.fleet.counts(self.st["new_id"], region)
        ready_old = 0
        if self.st["old_id"] is not None:
            ready_old, _ = await self.fleet.counts(self.st["old_id"], region)
        failed_new -= self.st["regions"][region].get("failed0", 0)
        if failed_new > 0:
            raise _Fail(f"{failed_new} replica(s) of {self.rec.to_version} failed in {region}", region)
        return ready_new, failed_new, ready_old

    def _check_timeout(self, region: str, ready: int, wanted: int) -> None:
        waited = self.now - self.st["entered_at"]
        if waited > self.p.health_timeout_s:
            raise _Fail(
                f"{self.rec.to_version} not ready in {region}: {ready}/{wanted} replicas ready after "
                f"{waited:.0f} s (health_timeout_s {self.p.health_timeout_s:g})",
                region,
            )

    # ---- phases --------------------------------------------------------------------------
    async def _init(self) -> None:
        new = await self._deployment(self.rec.to_version)
        if new is None or new.state == "deleted":
            await self._finish(
                "failed", f"deployment {self.rec.model_id}@{self.rec.to_version} not found", "not found"
            )
            return
        old = await self._deployment(self.rec.from_version)
        if self.rec.from_version is not None and (old is None or old.state == "deleted"):
            msg = f"previous deployment {self.rec.model_id}@{self.rec.from_version} not found"
            await self._finish("failed", msg, "not found")
            return
        regions = list(new.spec.regions)
        if self.rec.strategy == "versioned":
            mode = "versioned"
        elif old is None:
            mode = "first"
        else:
            mode = "red_black"
        waves = [list(w) for w in self.p.waves] if (self.p.waves and mode == "red_black") else [regions]
        mismatch = waves_mismatch(waves, regions)
        if mismatch is not None:  # checked when the rollout was started; the deployment may differ now
            await self._finish("failed", mismatch, mismatch)
            return
        per_region: dict[str, dict[str, Any]] = {}
        for region in regions:
            old_n = await self._desired(old, region) if old is not None and region in old.spec.regions else 0
            n = new.spec.replicas
            if mode == "red_black" and old_n > 0:
                n = min(max(old_n, new.spec.min_replicas, 1), new.spec.max_replicas)
            # Failed replicas left by an earlier attempt at this version are not this rollout's.
            _, failed0 = await self.fleet.counts(new.id, region)
            per_region[region] = {
                "n": n,
                "old_n": old_n,
                "new": 0,
                "old": old_n,
                "weight": None,
                "failed0": failed0,
            }
        self.st.update(
            mode=mode,
            new_id=new.id,
            old_id=old.id if (old is not None and mode == "red_black") else None,
            waves=waves,
            wave=0,
            regions=per_region,
            weights_at=None,
            extra_intervals=0,
            promoted=False,
        )
        plan = ", ".join(f"{r}: N={s['n']} (old {s['old_n']})" for r, s in per_region.items())
        await self._goto(
            "starting", f"{mode} rollout planned; phases {list(self.p.phases)}; waves {waves}; {plan}"
        )

    async def _starting(self) -> float | None:
        wave = self._wave_regions()
        started = True
        for region in wave:
            rs = self.st["regions"][region]
            if self.st["mode"] != "red_black" or rs["old_n"] == 0:
                goal = rs["n"]
            else:
                goal = self._goals(rs, self.p.phases[0])[0]
                if rs["weight"] is None:
                    # Pin the old version before the new has replicas: an unweighted route would
                    # otherwise spread traffic over both as soon as the new is ready.
                    await self._weights(region, 0, "before the new version starts")
            if rs["new"] >= goal:
                continue
            ready_new, _, ready_old = await self._counts(region)
            headroom = self._cap(rs) - max(rs["new"], ready_new) - max(rs["old"], ready_old)
            if headroom > 0:
                await self._scale("new", region, min(goal, rs["new"] + headroom), "first-phase share")
            elif rs["old"] > 0 and ready_new >= rs["new"] and self.p.surge == 0:
                # surge 0: room for the first new replica comes from one old replica.
                await self._scale("old", region, rs["old"] - 1, "surge 0: one old replica makes room")
                started = False
            else:
                started = False
            if rs["new"] < 1:
                started = False
        if not started:
            return self.now + POLL_S
        sizes = ", ".join(f"{r}={self.st['regions'][r]['new']}" for r in wave)
        await self._goto(
            "health_gate", f"{self.rec.to_version} scaled to {sizes}; waiting for its health gate"
        )
        return None

    async def _health_gate(self) -> float | None:
        wave = self._wave_regions()
        pending = []
        for region in wave:
            rs = self.st["regions"][region]
            ready_new, _, _ = await self._counts(region)
            if ready_new < rs["new"]:
                self._check_timeout(region, ready_new, rs["new"])
                pending.append(region)
        if pending:
            return self.now + POLL_S
        if self.st["mode"] == "red_black":
            await self._goto("shift:0", f"{self.rec.to_version} passed its health gate in {wave}")
        else:
            if self.st["mode"] == "first":
                for region in wave:
                    await self._weights(region, 100, "first deploy")
            await self._goto("done", f"{self.rec.to_version} passed its health gate in {wave}")
        return None

    async def _shift(self, i: int) -> float | None:
        percent = self.p.phases[i]
        wave = self._wave_regions()
        complete = True
        for region in wave:
            if not await self._converge(region, percent):
                complete = False
        if not complete:
            return self.now + POLL_S
        self.st["weights_at"] = self.now
        self.st["extra_intervals"] = 0
        # Persisted with the phase: a control plane restarted during the analysis still judges
        # the requests answered before it restarted (its in-memory samples start at its start).
        model, version = self.rec.model_id, self.rec.to_version
        self.st["baselines"] = {region: await self.fleet.counters(model, version, region) for region in wave}
        await self._goto(f"analysis:{i}", f"{percent}% of traffic on {self.rec.to_version} in {wave}")
        return None

    async def _converge(self, region: str, percent: int) -> bool:
        """One step of region toward the phase's goals; True when the phase is reached."""
        rs = self.st["regions"][region]
        new_goal, old_goal = self._goals(rs, percent)
        weight = 100 if rs["old_n"] == 0 else percent
        ready_new, _, ready_old = await self._counts(region)
        if rs["new"] < new_goal:
            headroom = self._cap(rs) - max(rs["new"], ready_new) - max(rs["old"], ready_old)
            if headroom > 0:
                await self._scale("new", region, min(new_goal, rs["new"] + headroom), f"phase {percent}%")
                return False
            if ready_new < rs["new"]:
                self._check_timeout(region, ready_new, rs["new"])
                return False
            # No room left: lower old only by what the ready new replicas take over.
            min_available = rs["n"] - (1 if self.p.surge == 0 else 0)
            old_next = max(old_goal, min_available - ready_new, 0)
            if old_next >= rs["old"]:
                return False  # waiting for a drain to finish
            share = 100.0 * ready_new / max(1, ready_new + old_next)
            interim = min(float(weight), share)
            if interim > (rs["weight"] or 0):
                await self._weights(region, interim, f"following the ready capacity toward {percent}%")
            await self._scale("old", region, old_next, f"room for {self.rec.to_version} toward {percent}%")
            return False
        if ready_new < new_goal:
            self._check_timeout(region, ready_new, new_goal)
            return False
        if rs["weight"] != weight:
            await self._weights(region, weight, f"phase {percent}%")
        if rs["old"] > old_goal:
            await self._scale("old", region, old_goal, f"phase {percent}%")
        return True

    async def _analysis(self, i: int) -> float | None:
        percent = self.p.phases[i]
        due = self.st["weights_at"] + self.p.interval_s * (1 + self.st["extra_intervals"])
        if self.now < due:
            return due
        wave = self._wave_regions()
        notes, inconclusive = [], []
        for region in wave:
            # A replica that failed since the shift is as much a failure as a bad answer.
            await self._counts(region)
            baseline = (self.st.get("baselines") or {}).get(region)
            a = await self.fleet.analyze(
                self.rec.model_id, self.rec.to_version, region, self.st["weights_at"], baseline
            )
            if a.requests < self.p.min_requests:
                inconclusive.append(region)
                notes.append(f"{region}: {a.requests} requests")
                continue
            rate = a.errors / a.requests if a.requests else 0.0
            if rate > self.p.max_error_rate:
                raise _Fail(
                    f"analysis failed at {percent}% in {region}: error rate {rate:.2f} > "
                    f"{self.p.max_error_rate:g} over {a.requests} requests; rolling back",
                    region,
                )
            if self.p.max_p99_s is not None and a.p99_s is not None and a.p99_s > self.p.max_p99_s:
                raise _Fail(
                    f"analysis failed at {percent}% in {region}: p99 {a.p99_s:.3f} s > "
                    f"{self.p.max_p99_s:g} s over {a.requests} requests; rolling back",
                    region,
                )
            p99 = "n/a" if a.p99_s is None else f"{a.p99_s:.3f} s"
            notes.append(f"{region}: error rate {rate:.2f} over {a.requests} requests, p99 {p99}")
        if inconclusive and self.st["extra_intervals"] < MAX_EXTRA_INTERVALS:
            self.st["extra_intervals"] += 1
            self.dirty = True
            await self._audit(
                "rollout.analysis",
                f"analysis at {percent}% inconclusive in {inconclusive} (fewer than min_requests "
                f"{self.p.min_requests}: {'; '.join(notes)}); waiting one more interval",
            )
            return self.st["weights_at"] + self.p.interval_s * (1 + self.st["extra_intervals"])
        verdict = "passed" if not inconclusive else "passed (still inconclusive after 3 intervals)"
        await self._audit("rollout.analysis", f"analysis at {percent}% {verdict}: {'; '.join(notes)}")
        if i + 1 < len(self.p.phases):
            await self._goto(f"shift:{i + 1}", f"analysis at {percent}% {verdict}")
        elif self.st["wave"] + 1 < len(self.st["waves"]):
            await self._goto(
                f"bake:{self.st['wave']}",
                f"wave {self.st['wave']} ({wave}) at 100%; baking {self.p.bake_s:g} s",
            )
        else:
            await self._promote()
        return None

    async def _bake(self, k: int) -> float | None:
        due = self.st["entered_at"] + self.p.bake_s
        if self.now < due:
            return due
        self.st["wave"] = k + 1
        await self._goto("starting", f"bake of wave {k} over; starting wave {k + 1} ({self._wave_regions()})")
        return None

    async def _promote(self) -> None:
        await self.fleet.activate(self.st["new_id"])
        self.st["promoted"] = True
        await self._goto(
            "promoted",
            f"100% of traffic on {self.rec.to_version} everywhere; {self.rec.from_version} kept at "
            f"warm_reserve for {self.p.fast_rollback_window_s:g} s of fast rollback",
        )

    async def _promoted(self) -> float | None:
        due = self.st["entered_at"] + self.p.fast_rollback_window_s
        if self.now < due:
            return due
        await self._goto("done", "fast-rollback window over")
        return None

    async def _done(self) -> float | None:
        mode = self.st["mode"]
        if mode == "red_black":
            for region in self.st["regions"]:
                if self.st["regions"][region]["old"] > 0:
                    await self._scale("old", region, 0, "rollout done")
            await self.fleet.deactivate(self.st["old_id"])
            await self._finish(
                "succeeded", f"{self.rec.to_version} serves all traffic; {self.rec.from_version} deactivated"
            )
            return math.inf
        await self.fleet.activate(self.st["new_id"])
        note = ""
        if mode == "versioned":
            models = await self.store.list_deployments(model_id=self.rec.model_id)
            if self.p.promote or not any(d.current for d in models):
                await self.store.set_current(self.rec.model_id, self.rec.to_version)
                note = f"; {self.rec.model_id} now follows {self.rec.to_version}"
        await self._finish("succeeded", f"{self.rec.to_version} is serving ({mode}){note}")
        return math.inf

    # ---- rollback ------------------------------------------------------------------------
    async def _rollback(self, message: str, region: str | None = None) -> float | None:
        if self.st.get("mode") == "red_black":
            status = "halted" if self.p.waves else "rolled_back"
        else:
            status = "failed"
        where = f" (region {region})" if region and f" {region}" not in message else ""
        self.st["rollback"] = {"reason": message + where, "status": status, "region": region, "step": 0}
        await self._goto("rolling_back", message + where, region=region)
        return await self._rolling_back()

    async def _rolling_back(self) -> float | None:
        rb = self.st.get("rollback") or {
            "reason": "rolled back",
            "status": "failed",
            "region": None,
            "step": 0,
        }
        self.st["rollback"] = rb
        if "regions" not in self.st:
            await self._finish(rb["status"], rb["reason"], rb["reason"])
            return math.inf
        moved = self._moved_regions()
        if rb["step"] == 0:
            # Traffic first, in every moved region, before any replica changes.
            if self.st["old_id"] is not None:
                for region in moved:
                    if self.st["regions"][region]["old_n"] > 0:
                        await self._weights(region, 0, "rollback")
            rb["step"] = 1
            await self._save()
        if rb["step"] == 1:
            for region in moved:
                rs = self.st["regions"][region]
                keep = min(rs["new"], max(0, self._cap(rs) - rs["old_n"])) if self.p.keep_failed else 0
                if rs["new"] > keep:
                    await self._scale("new", region, keep, "rollback")
                if self.st["old_id"] is not None and rs["old"] < rs["old_n"]:
                    await self._scale("old", region, rs["old_n"], "rollback: back to its original count")
            if not self.p.keep_failed:
                await self.fleet.deactivate(self.st["new_id"])
            rb["step"] = 2
            await self._save()
        waiting = []
        if self.st["old_id"] is not None:
            for region in moved:
                ready_old, _ = await self.fleet.counts(self.st["old_id"], region)
                if ready_old < self.st["regions"][region]["old_n"]:
                    waiting.append(f"{region} {ready_old}/{self.st['regions'][region]['old_n']}")
        if waiting and self.now - self.st["entered_at"] <= self.p.health_timeout_s:
            return self.now + POLL_S
        note = f"; old not fully ready after health_timeout_s: {waiting}" if waiting else ""
        await self._finish(rb["status"], f"{rb['reason']}{note}", rb["reason"])
        return math.inf

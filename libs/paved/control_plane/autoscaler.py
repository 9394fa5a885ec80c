"""Knative-KPA-style autoscaling of one deployment from its replicas' vLLM gauges.

Signals (totals over the deployment's ready replicas, one observation per scrape round):
`waiting` (vllm:num_requests_waiting), `in_flight` (running + waiting) and `kv_usage`
(vllm:kv_cache_usage_perc, a 0..1 fraction per replica, summed). Each signal's desired replica
count is ceil(window average of the total / its per-replica target); the desired count is the
maximum over the signals, and the reason string names the signal that drove it. The gauges are
read by paved.metrics.gauges (`scrape`), which the gateway's router reads replicas through too.

Invariants callers rely on:
- Every `Decision.target` is within [min_replicas, max_replicas], whatever was observed and
  whatever `current_target` was passed (clamping applies to holds too).
- Decisions are made on the TARGET count: `current_target` is what the deployment was last told
  to run, not how many replicas happen to be ready; while a step is in flight (the caller says
  so, typically `ready != current_target`) the decision is a hold at `current_target`.
  Observations and the panic / scale-down clocks keep running during a hold.
- Stable mode: the stable-window average. Panic mode is entered when the panic-window desire is
  >= panic_threshold x ready (ready counted as at least 1) and lasts until a full stable window
  has passed without that condition; in panic the target never goes down.
- Scale-down happens only once every desire computed in the last scale_down_delay_s was below
  `current_target`; it then goes to the highest of those desires (so a dip shorter than the
  delay never removes capacity). Scale-up is immediate.
- State is bounded: observations older than the longest window and desires older than the
  delay are dropped, with hard caps on both.
- One Autoscaler per deployment (one version): signals are never averaged across versions.

Scale to zero is not a KPA decision: the KPA's floor is max(1, min_replicas) (the controller
passes it so), and only `IdleClock` takes a deployment with `scale_to_zero_after_s` and
min_replicas 0 to zero, after that long without demand. A deployment at zero is woken by
demand (a gateway holding a request calls the control plane's wake endpoint), never by the
KPA: at zero there are no replicas to read gauges from.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from paved.control_plane.types import AutoscalePolicy
from paved.metrics.gauges import ReplicaMetrics

SIGNALS = ("waiting", "in_flight", "kv_usage")
# Hard caps on the history deques, whatever the windows and the observe rate.
MAX_OBSERVATIONS = 10_000
MAX_DESIRES = 10_000
# Float averages such as 3 x (2/3) land a hair above an integer; that must not add a replica.
_EPS = 1e-9


@dataclass(frozen=True)
class Decision:
    target: int
    reason: str
    mode: str  # "stable" | "panic" | "hold"


def validate_policy(policy: AutoscalePolicy) -> None:
    """ValueError naming the field when the policy cannot drive decisions."""
    for name in (
        "target_waiting",
        "target_kv_usage",
        "target_in_flight",
        "stable_window_s",
        "panic_window_s",
    ):
        value = getattr(policy, name)
        if not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ValueError(f"autoscale.{name} must be a finite number > 0, got {value!r}")
    if policy.target_kv_usage > 1:
        raise ValueError(f"autoscale.target_kv_usage is a fraction in (0, 1], got {policy.target_kv_usage!r}")
    if policy.panic_window_s > policy.stable_window_s:
        raise ValueError(
            f"autoscale.panic_window_s ({policy.panic_window_s}) must not exceed "
            f"stable_window_s ({policy.stable_window_s})"
        )
    if not isinstance(policy.panic_threshold, int | float) or not 1 <= policy.panic_threshold < math.inf:
        raise ValueError(
            f"autoscale.panic_threshold must be a finite number >= 1, got {policy.panic_threshold!r}"
        )
    if (
        not isinstance(policy.scale_down_delay_s, int | float)
        or not 0 <= policy.scale_down_delay_s < math.inf
    ):
        raise ValueError(
            f"autoscale.scale_down_delay_s must be a finite number >= 0, got {policy.scale_down_delay_s!r}"
        )
    if not isinstance(policy.interval_s, int | float) or not 0 < policy.interval_s < math.inf:
        raise ValueError(f"autoscale.interval_s must be a finite number > 0, got {policy.interval_s!r}")


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPS))


class Autoscaler:
    """Target tracking for one deployment; `observe` each scrape round, `decide` each tick."""

    def __init__(self, policy: AutoscalePolicy, *, clock: Callable[[], float] = time.monotonic):
        validate_policy(policy)
        self.policy = policy
        self._clock = clock
        self._targets = {
            "waiting": policy.target_waiting,
            "in_flight": policy.target_in_flight,
            "kv_usage": policy.target_kv_usage,
        }
        # (time, {signal: total}) in observation order.
        self._obs: deque[tuple[float, dict[str, float]]] = deque(maxlen=MAX_OBSERVATIONS)
        # (time, desired) of every decide, for the scale-down delay.
        self._desires: deque[tuple[float, int]] = deque(maxlen=MAX_DESIRES)
        self._panic_since: float | None = None  # last time the panic condition held
        self._first_decide: float | None = None

    @property
    def in_panic(self) -> bool:
        return self._panic_since is not None

    def _now(self, now: float | None) -> float:
        value = self._clock() if now is None else now
        if not math.isfinite(value):
            raise ValueError(f"now must be finite, got {value!r}")
        return value

    def observe(
        self, samples: list[ReplicaMetrics], now: float | None = None, *, of: int | None = None
    ) -> None:
        """Record one scrape round: `samples` holds one entry per ready replica scraped (an empty
        list records zero load). `of`: how many ready replicas the round was meant to read;
        when fewer answered, the totals are theirs scaled up to `of` (the unread ones are
        taken to carry the average, as Knative's KPA does), never read as idle. A round with
        `of` > 0 and no sample at all carries no reading: callers hold instead of observing."""
        t = self._now(now)
        for s in samples:
            if not isinstance(s, ReplicaMetrics):
                raise TypeError(f"samples must be ReplicaMetrics, got {type(s).__name__}")
        scale = of / len(samples) if of and samples and of > len(samples) else 1.0
        totals = {
            "waiting": scale * sum(s.waiting for s in samples),
            "in_flight": scale * sum(s.running + s.waiting for s in samples),
            "kv_usage": scale * sum(s.kv_usage for s in samples),
        }
        # A clock that goes back (another caller's `now`) must not reorder the window.
        if self._obs and t < self._obs[-1][0]:
            t = self._obs[-1][0]
        self._obs.append((t, totals))
        self._prune(t)

    def _prune(self, now: float) -> None:
        horizon = now - max(self.policy.stable_window_s, self.policy.panic_window_s)
        while self._obs and self._obs[0][0] < horizon:
            self._obs.popleft()
        while self._desires and self._desires[0][0] < now - self.policy.scale_down_delay_s:
            self._desires.popleft()

    def _desired(self, now: float, window_s: float) -> tuple[int, str] | None:
        """(desired count, reason) from the averages over the last `window_s`, or None when the
        window holds no observation."""
        recent = [totals for t, totals in self._obs if t >= now - window_s]
        if not recent:
            return None
        best: tuple[int, str] | None = None
        for signal in SIGNALS:
            avg = sum(r[signal] for r in recent) / len(recent)
            target = self._targets[signal]
            desired = _ceil(avg / target)
            if best is None or desired > best[0]:
                best = (
                    desired,
                    f"{signal} {avg:.3g} (avg over {window_s:g}s) / {target:g} per replica = {desired}",
                )
        return best

    def decide(
        self,
        *,
        current_target: int,
        ready: int,
        min_replicas: int,
        max_replicas: int,
        step_in_flight: bool,
        now: float | None = None,
    ) -> Decision:
        for name, value in (
            ("current_target", current_target),
            ("ready", ready),
            ("min_replicas", min_replicas),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if (
            not isinstance(max_replicas, int)
            or isinstance(max_replicas, bool)
            or max_replicas < max(min_replicas, 1)
        ):
            raise ValueError(f"max_replicas must be an int >= max(min_replicas, 1), got {max_replicas!r}")
        t = self._now(now)
        self._prune(t)

        def clamp(target: int, reason: str, mode: str) -> Decision:
            if target > max_replicas:
                return Decision(max_replicas, f"{reason}; clamped to max_replicas {max_replicas}", mode)
            if target < min_replicas:
                return Decision(min_replicas, f"{reason}; clamped to min_replicas {min_replicas}", mode)
            return Decision(target, reason, mode)

        stable = self._desired(t, self.policy.stable_window_s)
        panic = self._desired(t, self.policy.panic_window_s)
        if stable is None or panic is None:
            return clamp(current_target, "hold: no metrics observed in the window", "hold")

        # Panic state moves on every decide, holds included, so a burst seen during a step is
        # not forgotten when the step completes.
        if panic[0] >= self.policy.panic_threshold * max(ready, 1):
            self._panic_since = t
        elif self._panic_since is not None and t - self._panic_since >= self.policy.stable_window_s:
            self._panic_since = None
        raw, why = panic if self._panic_since is not None else stable
        desired = min(max(raw, min_replicas), max_replicas)
        if desired != raw:
            why += f", clamped to {desired} (replicas within [{min_replicas}, {max_replicas}])"
        if self._desires and t < self._desires[-1][0]:
            t = self._desires[-1][0]  # a clock that goes back must not reorder the history
        if self._first_decide is None:
            self._first_decide = t
        self._desires.append((t, desired))

        if step_in_flight:
            return clamp(
                current_target,
                f"hold: step in flight (ready {ready} of target {current_target}); {why}",
                "hold",
            )
        if self._panic_since is not None:
            if desired > current_target:
                return clamp(desired, f"panic scale up {current_target} -> {desired}: {why}", "panic")
            return clamp(current_target, f"panic, no scale down (desired {desired}): {why}", "panic")
        if desired > current_target:
            return clamp(desired, f"scale up {current_target} -> {desired}: {why}", "stable")
        if desired == current_target:
            return clamp(current_target, f"steady at {current_target}: {why}", "stable")
        # Below: the highest desire over the delay decides, and only once the history covers
        # the whole delay (a fresh autoscaler has not seen the last delay_s).
        delay = self.policy.scale_down_delay_s
        window = [(dt, d) for dt, d in self._desires if dt >= t - delay]
        down_to = max(d for _, d in window)
        not_lower = [dt for dt, d in window if d >= current_target]
        lower_for = t - (not_lower[-1] if not_lower else self._first_decide)
        if down_to >= current_target or t - self._first_decide < delay:
            return clamp(
                current_target,
                f"scale down to {desired} deferred (lower for {lower_for:.3g}s of {delay:g}s): {why}",
                "stable",
            )
        return clamp(
            down_to,
            f"scale down {current_target} -> {down_to} (highest desire over the last {delay:g}s): {why}",
            "stable",
        )


class IdleClock:
    """When one deployment last showed demand, and whether it has been idle long enough to be
    scaled to zero.

    Invariants:
    - `due` is True only when the policy asks for scale to zero (`scale_to_zero_after_s` set,
      autoscaling enabled, min_replicas 0) and no demand was seen for `scale_to_zero_after_s`;
      the idle time counts from the latest of this clock's creation (the controller makes one
      when it first sees the deployment awake: just started, woken, or rolled out) and every
      `demand` reported.
    - Times are one clock's (the caller's); a demand time in the past of the latest one changes
      nothing, so signals read at different moments may be reported in any order.
    """

    def __init__(self, now: float):
        if not math.isfinite(now):
            raise ValueError(f"now must be finite, got {now!r}")
        self._last = now

    @property
    def last_demand(self) -> float:
        return self._last

    def demand(self, at: float | None) -> None:
        """Demand seen at `at` (None: no reading, nothing changes)."""
        if at is None:
            return
        if not math.isfinite(at):
            raise ValueError(f"at must be finite, got {at!r}")
        self._last = max(self._last, at)

    def idle_for(self, now: float) -> float:
        return max(0.0, now - self._last)

    def due(self, policy: AutoscalePolicy, min_replicas: int, now: float) -> bool:
        after = policy.scale_to_zero_after_s
        return after is not None and wants_scale_to_zero(policy, min_replicas) and self.idle_for(now) >= after


def wants_scale_to_zero(policy: AutoscalePolicy, min_replicas: int) -> bool:
    """Whether a deployment of this policy and floor scales to zero when idle (and is woken by
    demand): the one rule the controller, the routes table and the wake endpoint share."""
    return policy.enabled and policy.scale_to_zero_after_s is not None and min_replicas == 0

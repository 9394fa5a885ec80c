"""Red-black rollouts end to end on the simulated engine: promotion overhead and rollback time.

    tools/bazel run //bench:rollout -- [--driver local|kubernetes] [--interval-s I] [--analysis-s A]
        [--rate R] [--json]

One fleet (libs/tests/control_plane/fleet.py): the control-plane main (`--interval 0.5`, real
launchers of the tiny package running `sim://tiny`), a gateway main following its routes, and a
traffic driver (the `openai` client at `--rate` requests/s through the gateway, every response
recorded with the backend that served it). Three timelines are recorded beside it:

  * the routes feed: a long-poll on `GET /v1/routes?after=N` stamps every revision with the
    wall time it arrived and the weight of each version;
  * the gateway's `/metrics`, polled every 50 ms: the time the new version's
    `paved_gateway_retries_total{backend=<its replica>}` first rose (its first refused request);
  * the control plane's audit trail (`GET /v1/audit`): `replica.ready`, `rollout.phase`.

Part 1, promotion: v1 (1 replica) -> v2 with phases (25, 50, 100), `interval_s` I.
`promote_overhead_ratio` = (rollout created -> `promoted` phase) / (health gate + len(phases) x I),
where the health gate is the new replica's own time from the rollout's creation to its
`replica.ready` audit row (a launcher's boot: the floor the rollout cannot beat). The parts are
reported: each phase's duration from the audit, the time the routes first put 0 on v1 (100 % of
traffic on v2: the last phase's weights, before its analysis interval) and the last response
v1 served.

Part 2, rollback: v2 -> v3 whose engine refuses (503) every request after the first
`--fail-after`, analysis interval A. `rollback_s` = from v3's first refused request (its retries
counter) to the routes revision that puts 0 on v3; `rollback_ratio_vs_interval` = rollback_s / A.

`--driver kubernetes` runs the same two parts with the control plane's Kubernetes driver on a
real API server (kube-apiserver 1.20 from tools/k8s/build_apiserver.sh, etcd, the
controller-manager) and a played node running each pod as a local launcher
(libs/tests/control_plane/kube_fleet.py): the health gate then includes the pod's scheduling,
its IP and the claim, and a drain is a pod deletion (preStop, SIGTERM, the node's final delete).

Both parts also report the traffic driver's failed requests (the gateway retries a refused
request on the old version, so clients must see none). With --json the last stdout line is one
JSON object with every key.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from fleet import SIM, TrafficDriver, deploy, first_deploy, make_fleet
from kube_fleet import kube_fleet, kube_node


class RoutesWatch:
    """Every routes revision with the wall time it arrived (a long poll: it sees each one)."""

    def __init__(self, url: str, token: str):
        self.url = url
        self.token = token
        self.revisions: list[tuple[float, int, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> RoutesWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        after = 0
        with httpx.Client(headers={"Authorization": f"Bearer {self.token}"}, timeout=10) as c:
            while not self._stop.is_set():
                try:
                    r = c.get(self.url, params={"after": after, "timeout_s": 2})
                except httpx.HTTPError:
                    time.sleep(0.1)
                    continue
                if r.status_code != 200:
                    continue
                at = time.time()
                body = r.json()
                weights: dict[str, float] = {}
                for m in body["table"].get("models", []):
                    for b in m["backends"]:
                        weights[b["version"]] = weights.get(b["version"], 0.0) + float(b["weight"])
                self.revisions.append((at, body["revision"], weights))
                after = body["revision"]

    def first(self, since: float, predicate: Any) -> tuple[float, int, dict[str, float]] | None:
        return next((x for x in self.revisions if x[0] >= since and predicate(x[2])), None)


class RetriesWatch:
    """The first wall time a backend's `paved_gateway_retries_total` rose above its start."""

    def __init__(self, metrics_url: str, backend: str, period_s: float = 0.05):
        self.metrics_url = metrics_url
        self.backend = backend
        self.period_s = period_s
        self.first_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _count(self, c: httpx.Client) -> float:
        total = 0.0
        for line in c.get(self.metrics_url).text.splitlines():
            if line.startswith("paved_gateway_retries_total{") and f'backend="{self.backend}"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def start(self) -> RetriesWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as c:
            base = self._count(c)
            while not self._stop.is_set() and self.first_at is None:
                time.sleep(self.period_s)
                try:
                    if self._count(c) > base:
                        self.first_at = time.time()
                except httpx.HTTPError:
                    continue


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def _audit(cp: Any, model_id: str) -> list[dict[str, Any]]:
    events = cp.api("GET", f"/v1/audit?model_id={model_id}&limit=1000")["data"]
    return sorted(events, key=lambda e: e["id"])


def _phase_times(events: list[dict[str, Any]], rollout_id: str) -> list[tuple[str, float]]:
    """(phase entered, wall time) in order, from the rollout's `rollout.phase` audit rows."""
    out = []
    for e in events:
        if e.get("rollout_id") == rollout_id and e["kind"] == "rollout.phase":
            out.append((e["data"].get("phase") or e["message"], _ts(e["at"])))
    return out


def _analysis_notes(events: list[dict[str, Any]], rollout_id: str) -> list[str]:
    """The rollout's analysis verdicts, without the rollout's prefix."""
    return [
        e["message"].split("): ", 1)[-1]
        for e in events
        if e.get("rollout_id") == rollout_id and e["kind"] == "rollout.analysis"
    ]


def _new_share(
    results: list[Any], offset: float, new_urls: set[str], entered: dict[str, float], n: int, end: float
) -> dict[str, float | None]:
    """Per phase i: the share of the driver's answered requests sent in [shift:i, shift:i+1)
    that the new version served (the weight the phase configured, as clients saw it)."""
    out: dict[str, float | None] = {}
    for i in range(n):
        lo, hi = entered[f"shift:{i}"], entered.get(f"shift:{i + 1}", end)
        inside = [r for r in results if r.ok and lo <= r.at + offset < hi]
        out[str(i)] = round(sum(r.version in new_urls for r in inside) / len(inside), 3) if inside else None
    return out


def _start_rollout(cp: Any, version: str, params: dict[str, Any]) -> dict[str, Any]:
    return cp.api("POST", "/v1/rollouts", {"model_id": "tiny", "version": version, "params": params})


def _replica_url(cp: Any, version: str) -> str:
    return cp.wait_for(
        f"a replica of {version}",
        lambda: next((x["url"] for x in cp.replicas("tiny") if x["version"] == version), None),
        timeout_s=60,
    )


def promote(cp: Any, gw: Any, key: str, watch: RoutesWatch, args: argparse.Namespace) -> dict[str, Any]:
    phases = [25, 50, 100]
    v1_urls = {x["url"] for x in cp.replicas("tiny") if x["state"] == "ready"}
    deploy(cp, "v2")
    traffic = TrafficDriver(gw.url, key, "tiny", rate=args.rate, phase="promote").start()
    offset = time.time() - time.monotonic()  # the driver stamps results on the monotonic clock
    params = {
        "phases": phases,
        "interval_s": args.interval_s,
        "health_timeout_s": 120,
        "fast_rollback_window_s": 1,
        "min_requests": args.min_requests,
    }
    ro = _start_rollout(cp, "v2", params)
    final = cp.wait_rollout(ro["id"], timeout_s=120 + 10 * args.interval_s)
    time.sleep(1)
    results = traffic.stop()
    created = _ts(ro["created_at"])
    events = _audit(cp, "tiny")
    ready_v2 = next(
        _ts(e["at"])
        for e in events
        if e["kind"] == "replica.ready" and e.get("version") == "v2" and _ts(e["at"]) >= created
    )
    times = _phase_times(events, ro["id"])
    entered = {name: at for name, at in times}
    promoted = entered["promoted"]
    health_gate_s = ready_v2 - created
    minimum = health_gate_s + len(phases) * args.interval_s
    phase_s = {}
    for i, p in enumerate(phases):
        end = entered.get(f"shift:{i + 1}", promoted)
        phase_s[f"{p}%"] = round(end - entered[f"shift:{i}"], 3)
    all_new = watch.first(created, lambda w: w.get("v2", 0) > 0 and not w.get("v1", 0))
    last_v1 = max((r.at + offset for r in results if r.ok and r.version in v1_urls), default=None)
    v2_urls = {x["url"] for x in cp.replicas("tiny") if x["version"] == "v2"}
    share = _new_share(results, offset, v2_urls, entered, len(phases), promoted)
    extra = sum("waiting one more interval" in m for m in _analysis_notes(events, ro["id"]))
    return {
        "promote_status": final["status"],
        "promote_s": round(promoted - created, 3),
        "promote_min_s": round(minimum, 3),
        "promote_overhead_ratio": round((promoted - created) / minimum, 3),
        "promote_health_gate_s": round(health_gate_s, 3),
        "promote_gate_to_shift0_s": round(entered["shift:0"] - ready_v2, 3),
        "promote_phase_s": phase_s,
        "promote_interval_s": args.interval_s,
        "promote_all_traffic_on_new_routes_s": round(all_new[0] - created, 3) if all_new else None,
        "promote_last_old_response_s": round(last_v1 - created, 3) if last_v1 else None,
        "promote_requests": len(results),
        "promote_failed_requests": len([r for r in results if not r.ok]),
        "promote_phases": [[name, round(at - created, 3)] for name, at in times],
        "promote_new_share_by_phase": {f"{p}%": share[str(i)] for i, p in enumerate(phases)},
        "promote_inconclusive_intervals": extra,
        "promote_overhead_ratio_without_inconclusive": round(
            (promoted - created - extra * args.interval_s) / minimum, 3
        ),
        "promote_analysis": _analysis_notes(events, ro["id"]),
    }


def rollback(
    cp: Any, gw: Any, key: str, watch: RoutesWatch, args: argparse.Namespace, gateway_metrics: str
) -> dict[str, Any]:
    deploy(cp, "v3", engine=f"{SIM}&fail_after={args.fail_after}")
    traffic = TrafficDriver(gw.url, key, "tiny", rate=args.rate, phase="rollback").start()
    offset = time.time() - time.monotonic()
    params = {
        "phases": [25, 50, 100],
        "interval_s": args.analysis_s,
        "health_timeout_s": 120,
        "fast_rollback_window_s": 1,
        "min_requests": args.min_requests,
    }
    ro = _start_rollout(cp, "v3", params)
    retries = RetriesWatch(gateway_metrics, _replica_url(cp, "v3")).start()
    final = cp.wait_rollout(ro["id"], timeout_s=120 + 10 * args.analysis_s)
    time.sleep(1)
    results = traffic.stop()
    retries.stop()
    created = _ts(ro["created_at"])
    events = _audit(cp, "tiny")
    times = _phase_times(events, ro["id"])
    entered = {name: at for name, at in times}
    v3_urls = {x["url"] for x in cp.replicas("tiny") if x["version"] == "v3"}
    ended = entered.get("rolling_back", time.time())
    # Requests v3 answered (200) before its engine started refusing, or took at all, per phase.
    reached = len([r for r in results if r.ok and r.version in v3_urls])
    signal_at = retries.first_at
    on = watch.first(created, lambda w: w.get("v3", 0) > 0)
    back = watch.first(on[0] if on else created, lambda w: not w.get("v3", 0) and w.get("v2", 0) > 0)
    rollback_s = back[0] - signal_at if (back and signal_at) else None
    return {
        "rollback_status": final["status"],
        "rollback_reason": final.get("reason"),
        "rollback_s": round(rollback_s, 3) if rollback_s is not None else None,
        "rollback_interval_s": args.analysis_s,
        "rollback_ratio_vs_interval": round(rollback_s / args.analysis_s, 3) if rollback_s else None,
        "rollback_first_weights_to_first_503_s": (
            round(signal_at - on[0], 3) if (signal_at and on) else None
        ),
        "rollback_decided_after_signal_s": (
            round(entered["rolling_back"] - signal_at, 3)
            if ("rolling_back" in entered and signal_at)
            else None
        ),
        "rollback_phase_reached": next((n for n, _ in reversed(times) if n.startswith("analysis")), None),
        "rollback_new_answers": reached,
        "rollback_new_share_by_phase": {
            k: v
            for k, v in _new_share(
                results, offset, v3_urls, entered, sum(n.startswith("shift") for n, _ in times), ended
            ).items()
        },
        "rollback_analysis": _analysis_notes(events, ro["id"]),
        "rollback_requests": len(results),
        "rollback_failed_requests": len([r for r in results if not r.ok]),
        "rollback_phases": [[name, round(at - created, 3)] for name, at in times],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval-s", type=float, default=3.0, help="promotion: interval_s per phase")
    parser.add_argument("--analysis-s", type=float, default=3.0, help="rollback: the analysis interval A")
    parser.add_argument("--fail-after", type=int, default=2, help="v3 refuses every request after N")
    parser.add_argument(
        "--min-requests", type=int, default=1, help="the rollouts' min_requests (0: no inconclusive analysis)"
    )
    parser.add_argument("--rate", type=float, default=8.0, help="traffic driver requests/s")
    parser.add_argument(
        "--driver",
        choices=("local", "kubernetes"),
        default="local",
        help="the control plane's driver: local processes, or pods on a real API server (played node)",
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    for name in ("interval_s", "analysis_s", "rate"):
        if not 0 < getattr(args, name) <= 60:
            parser.error(f"--{name.replace('_', '-')} must be in (0, 60]")
    if not 0 <= args.min_requests <= 10_000:
        parser.error("--min-requests must be in [0, 10000]")
    if not 1 <= args.fail_after <= 100:
        parser.error("--fail-after must be in [1, 100]")

    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp, contextlib.ExitStack() as stack:
        if args.driver == "kubernetes":
            cluster, _ = stack.enter_context(kube_node(Path(tmp) / "k8s"))
            cp, gw, key = stack.enter_context(kube_fleet(cluster, Path(tmp), "bench"))()
        else:
            cp, gw, key = stack.enter_context(make_fleet(Path(tmp)))()
        gateway_metrics = gw.url + "/metrics"
        first_deploy(cp, gw, key)
        watch = RoutesWatch(cp.url + "/v1/routes", cp.admin_key).start()
        try:
            summary = promote(cp, gw, key, watch, args)
            summary |= rollback(cp, gw, key, watch, args, gateway_metrics)
        finally:
            watch.stop()
    summary["failed_requests"] = summary["promote_failed_requests"] + summary["rollback_failed_requests"]
    summary["driver"] = args.driver
    print(
        f"promotion: {summary['promote_s']} s vs a minimum of {summary['promote_min_s']} s (health gate "
        f"{summary['promote_health_gate_s']} s + 3 x {args.interval_s:g} s): ratio "
        f"{summary['promote_overhead_ratio']} (target <= 1.1); phases {summary['promote_phase_s']}"
    )
    print(
        f"rollback: {summary['rollback_s']} s from the first 503 to 0 % on v3, A = {args.analysis_s:g} s: "
        f"ratio {summary['rollback_ratio_vs_interval']} (target <= 2)"
    )
    print(
        f"failed requests: {summary['failed_requests']} of "
        f"{summary['promote_requests'] + summary['rollback_requests']}"
    )
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    ok = (
        summary["promote_status"] == "succeeded"
        and summary["rollback_status"] == "rolled_back"
        and summary["failed_requests"] == 0
        and summary["rollback_s"] is not None
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

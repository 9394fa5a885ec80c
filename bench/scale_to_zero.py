"""Scale to zero: a burst of requests for a model at zero replicas, held by the gateway while
the control plane wakes it, vs the anchor behaviour (a model with no replica leaves the routes:
every request is a 404, as vLLM production-stack's router and others answer).

    tools/bazel run //bench:scale_to_zero -- [--requests 50] [--start-delay 5] [--json]

The control-plane main (local driver, launchers of the tiny package on the simulated engine
with `start_delay_s` = --start-delay, a model load time) and a gateway main following its
routes, as in the scenario tests. The model is rolled out once (so the launchers' model cache
is warm), then:

  * anchor: `PATCH replicas 0` without a scale-to-zero policy: the replica drains and the
    model leaves the routes; the burst of --requests chat requests, sent at once, is answered
    404 (`anchor_failed_requests`, `anchor_statuses`).
  * scale to zero: the same deployment given `autoscale.scale_to_zero_after_s` (still at 0
    replicas): its alias is routed, marked `scaled_to_zero`; the same burst is held by the
    gateway, which wakes it. `failed_requests` (goal 0); `first_answer_s`, the first 200's
    latency from the burst; `start_to_ready_s`, the woken replica's start to ready as the
    control plane audited it ("started replica" -> "replica.ready"); `one_request_s`, the
    median latency of a request to the warm replica afterwards; `wake_overhead_ratio` =
    first_answer_s / (start_to_ready_s + one_request_s) (goal <= 1.2; what the hold, the wake
    call, the routes publish and the gateway's release add to an unavoidable cold start).

With --json the last stdout line is one JSON object with every key. Every process is stopped
however the bench ends (the fleet's own cleanup); every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from fleet import FAST, SIM, chat_burst, make_fleet, tiny_package


async def _burst(url: str, key: str, n: int) -> list[tuple[int | str, float]]:
    return await chat_burst(url, key, n, max_tokens=16, timeout_s=300)


def _routes(cp: Any) -> dict[str, Any]:
    r = httpx.get(cp.url + "/v1/routes", headers={"Authorization": f"Bearer {cp.admin_key}"}, timeout=10)
    return r.json()["table"]


def _listed(gw: Any, key: str) -> bool:
    """Whether the gateway lists tiny in /v1/models (with no replica: only while it is routed
    at zero)."""
    r = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return "tiny" in {m["id"] for m in r.json()["data"]}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    with make_fleet(work) as make:
        cp, gw, key = make()
        engine = f"{SIM}&start_delay_s={args.start_delay:g}"
        cp.api(
            "POST",
            "/v1/deployments",
            {
                "model_id": "tiny",
                "version": "v1",
                "package_uri": tiny_package(),
                "engine": engine,
                "min_replicas": 0,
                "replicas": 1,
                "autoscale": {"enabled": True},
            },
        )
        r = cp.api("POST", "/v1/rollouts", {"model_id": "tiny", "version": "v1", "params": FAST})
        assert cp.wait_rollout(r["id"])["status"] == "succeeded", r

        # Anchor: at zero without the policy, the model leaves the routes.
        cp.api("PATCH", "/v1/deployments/tiny/v1", {"replicas": 0})
        cp.wait_for(
            "the replica drained", lambda: not [x for x in cp.replicas("tiny") if x["state"] != "stopped"]
        )
        cp.wait_for("tiny out of the routes", lambda: not _routes(cp)["models"])
        cp.wait_for("the gateway following", lambda: not _listed(gw, key))
        anchor = asyncio.run(_burst(gw.url, key, args.requests))
        anchor_statuses: dict[str, int] = {}
        for status, _ in anchor:
            anchor_statuses[str(status)] = anchor_statuses.get(str(status), 0) + 1

        # Scale to zero: the same deployment, still at zero, now with the policy.
        cp.api(
            "PATCH",
            "/v1/deployments/tiny/v1",
            {"autoscale": {"enabled": True, "scale_to_zero_after_s": args.idle_s}},
        )
        cp.wait_for(
            "tiny at zero in the routes",
            lambda: [m for m in _routes(cp)["models"] if m.get("scaled_to_zero")],
        )
        cp.wait_for("the gateway following", lambda: _listed(gw, key))
        last_id = max(e["id"] for e in cp.api("GET", "/v1/audit?limit=1000")["data"])
        results = asyncio.run(_burst(gw.url, key, args.requests))
        answered = sorted(t for status, t in results if status == 200)
        failed = [status for status, _ in results if status != 200]

        # The woken replica's own start to ready, from the control plane's audit.
        audit = cp.api("GET", f"/v1/audit?model_id=tiny&after_id={last_id}&limit=1000")["data"]
        started = [e for e in audit if e["kind"] == "scale" and e["message"].startswith("started replica")]
        ready = {e["data"].get("replica"): e for e in audit if e["kind"] == "replica.ready"}
        first = started[0]
        start_to_ready = (
            datetime.fromisoformat(ready[first["data"]["replica"]]["at"])
            - datetime.fromisoformat(first["at"])
        ).total_seconds()

        # One request's latency on the warm replica, alone.
        singles = []
        for _ in range(5):
            t0 = time.perf_counter()
            one = asyncio.run(_burst(gw.url, key, 1))
            assert one[0][0] == 200, one
            singles.append(time.perf_counter() - t0)
        one_request = statistics.median(singles)
        first_answer = answered[0] if answered else None
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        wake_calls = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("paved_gateway_wake_calls_total{") and 'model="tiny"' in line
        )
        return {
            "requests": args.requests,
            "start_delay_s": args.start_delay,
            "failed_requests": len(failed),
            "failed_statuses": sorted({str(s) for s in failed}),
            "first_answer_s": round(first_answer, 3) if first_answer is not None else None,
            "last_answer_s": round(answered[-1], 3) if answered else None,
            "start_to_ready_s": round(start_to_ready, 3),
            "one_request_s": round(one_request, 4),
            "wake_overhead_ratio": (
                round(first_answer / (start_to_ready + one_request), 3) if first_answer is not None else None
            ),
            "wake_events": len([e for e in audit if e["data"].get("mode") == "wake"]),
            "replicas_started": len(started),
            "gateway_wake_calls": wake_calls,
            "anchor_failed_requests": sum(1 for status, _ in anchor if status != 200),
            "anchor_statuses": anchor_statuses,
            "anchor_last_answer_s": round(max(t for _, t in anchor), 3),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50, help="requests in the burst (default 50)")
    parser.add_argument(
        "--start-delay", type=float, default=5.0, help="the sim engine's load time, seconds (default 5)"
    )
    parser.add_argument("--idle-s", type=float, default=60.0, help="scale_to_zero_after_s (default 60)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    if not 1 <= args.requests <= 1000:
        parser.error("--requests must be 1..1000")
    if not 0 <= args.start_delay <= 600:
        parser.error("--start-delay must be 0..600 seconds")
    if not 1 <= args.idle_s <= 86400:
        parser.error("--idle-s must be 1..86400 seconds")
    with tempfile.TemporaryDirectory(prefix="paved-bench-s2z-") as tmp:
        summary = run(args, Path(tmp))
    for k, v in summary.items():
        print(f"{k}: {v}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

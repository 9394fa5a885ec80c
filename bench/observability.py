"""Prometheus for paved: discovery lag and the analysis decisions read from Prometheus.

    tools/bazel run //bench:observability -- [--rate R] [--scrape-interval S] [--json]

One fleet (libs/tests/control_plane/fleet.py: the control-plane main with
`--prometheus-file-sd`, real launchers of the tiny package on `sim://tiny`, a gateway following
its routes) and Debian's prometheus discovering it from that file (scrape and refresh every S
seconds, default 1). The rollout bench's two scenarios run under traffic (the `openai` client at
R requests/s): promotion v1 -> v2, and v2 -> v3 whose engine refuses every request after its
second (rolled back by analysis). The gateway's `/metrics` is recorded every 0.5 s meanwhile.

  * `discovery_lag_s_*`: per replica, from its `replica.ready` audit row to the timestamp of
    its first successful scrape (`up == 1` in Prometheus' own samples), max and median.
  * `analysis_decision_agreement`: the recorded gateway metrics are replayed, one recording at
    a time, through a second Prometheus scraping an exporter serving them (the step waits until
    Prometheus has scraped it). After each step the analysis of each rollout's new version
    (GatewayAnalyzer over the scrape source and over the Prometheus source, the window from the
    rollout's start) is turned into the rollout's decision (inconclusive under min_requests,
    fail above max_error_rate or max_p99_s, else pass); agreement is the share of
    (step, rollout) decisions that match. Goal 1.0. `counters_identical` says whether every
    step's counters were the same.

With --json the last stdout line is one JSON object with every key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml
from fleet import FAST, SIM, TrafficDriver, deploy, first_deploy, make_fleet, rollout

from paved.control_plane.analysis import GatewayAnalyzer
from paved.control_plane.metrics_source import PrometheusSource, ScrapeSource
from paved.control_plane.prometheus import scrape_config
from paved.control_plane.rollout import Analysis, RolloutParams
from paved.platform.prometheus import LocalPrometheus


def decision(a: Analysis, p: RolloutParams) -> str:
    """The rollout's verdict on one analysis (paved.control_plane.rollout's order of checks)."""
    if a.requests < p.min_requests:
        return "inconclusive"
    if a.errors / a.requests > p.max_error_rate:
        return "fail"
    if p.max_p99_s is not None and a.p99_s is not None and a.p99_s > p.max_p99_s:
        return "fail"
    return "pass"


class Exporter:
    """Serves one text at /metrics (swapped between steps)."""

    def __init__(self) -> None:
        self.text = ""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = owner.text.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def record(url: str, stop: threading.Event, out: list[str]) -> None:
    with httpx.Client(timeout=5) as client:
        while not stop.is_set():
            try:
                r = client.get(url)
                if r.status_code == 200:
                    out.append(r.text)
            except httpx.HTTPError:
                pass
            stop.wait(0.5)


def discovery_lags(cp: Any, prom: LocalPrometheus) -> list[float]:
    events = cp.api("GET", "/v1/audit?limit=1000")["data"]
    lags = []
    for e in events:
        if e["kind"] != "replica.ready":
            continue
        rid = e["data"]["replica"]
        series = prom.query(f'up{{paved_replica="{rid}"}}[1h]')
        first = [float(t) for s in series for t, v in s["values"] if v == "1"]
        if first:
            lags.append(min(first) - _ts(e["at"]))
    return lags


def replay(texts: list[str], windows: list[tuple[str, set[str], RolloutParams]], tmp: Path) -> dict[str, Any]:
    exporter = Exporter()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "replay",
                "static_configs": [{"targets": [exporter.host], "labels": {"paved_role": "gateway"}}],
            }
        ],
    }
    agree = total = 0
    identical = True
    with LocalPrometheus(yaml.safe_dump(config), tmp / "replay") as prom:
        scrape_src = ScrapeSource([f"http://{exporter.host}/metrics"])
        prom_src = PrometheusSource(prom.url)
        by_scrape, by_prom = GatewayAnalyzer(source=scrape_src), GatewayAnalyzer(source=prom_src)

        async def run() -> None:
            nonlocal agree, total, identical
            baselines: dict[str, tuple[Any, Any]] = {}
            for step, text in enumerate(texts):
                exporter.text = text + f"paved_replay_step {step}\n"
                deadline = time.monotonic() + 30
                while not any(float(s["value"][1]) == step for s in prom.query("paved_replay_step")):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"prometheus did not scrape step {step}")
                    await asyncio.sleep(0.1)
                a, b = await scrape_src.gateway_counters(), await prom_src.gateway_counters()
                identical &= (a.requests, a.errors, a.buckets) == (b.requests, b.errors, b.buckets)
                assert await by_scrape.scrape_once() and await by_prom.scrape_once()
                for name, backends, params in windows:
                    if name not in baselines:
                        baselines[name] = (by_scrape.counters(backends), by_prom.counters(backends))
                        continue
                    since = time.time() - 3600
                    da = decision(by_scrape.analyze(backends, since, baselines[name][0]), params)
                    db = decision(by_prom.analyze(backends, since, baselines[name][1]), params)
                    total += 1
                    agree += da == db

        asyncio.run(run())
    exporter.server.shutdown()
    return {
        "analysis_decision_agreement": round(agree / total, 4) if total else None,
        "analysis_decisions_compared": total,
        "counters_identical": identical,
        "replayed_steps": len(texts),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=8.0, help="requests/s through the gateway (8)")
    p.add_argument("--scrape-interval", type=int, default=1, help="Prometheus' scrape and SD refresh, s (1)")
    p.add_argument("--fail-after", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not 0 < args.rate <= 100 or not 1 <= args.scrape_interval <= 15 or not 1 <= args.fail_after <= 100:
        print("observability: --rate 0..100, --scrape-interval 1..15, --fail-after 1..100", file=sys.stderr)
        return 2
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-observability-") as d:
        tmp = Path(d)
        sd = tmp / "targets.json"
        texts: list[str] = []
        with make_fleet(tmp) as make:
            cp, gw, key = make(None, "--prometheus-file-sd", str(sd))
            interval = f"{args.scrape_interval}s"
            config = scrape_config(
                file_sd=str(sd),
                scrape_interval=interval,
                evaluation_interval=interval,
                refresh_interval=interval,
            )
            with LocalPrometheus(config, tmp / "prometheus") as prom:
                stop = threading.Event()
                recorder = threading.Thread(
                    target=record, args=(gw.url + "/metrics", stop, texts), daemon=True
                )
                recorder.start()
                first_deploy(cp, gw, key)
                traffic = TrafficDriver(gw.url, key, "tiny", rate=args.rate).start()
                deploy(cp, "v2")
                promoted = cp.wait_rollout(rollout(cp, "v2")["id"])
                deploy(cp, "v3", engine=f"{SIM}&fail_after={args.fail_after}")
                rolled = cp.wait_rollout(rollout(cp, "v3", interval_s=3)["id"])
                time.sleep(2)
                traffic.stop()
                stop.set()
                recorder.join(10)
                # Replicas stopped since (v1, v2 drained) were scraped while they ran.
                lags = discovery_lags(cp, prom)
                by_version: dict[str, set[str]] = {}
                for r in cp.replicas("tiny"):
                    by_version.setdefault(r["version"], set()).add(r["url"])
        params = RolloutParams(**{k: v for k, v in FAST.items() if k in ("interval_s", "min_requests")})
        windows = [(v, by_version.get(v, set()), params) for v in ("v2", "v3")]
        out.update(
            {
                "promotion_status": promoted["status"],
                "rollback_status": rolled["status"],
                "discovery_lag_s_max": round(max(lags), 3) if lags else None,
                "discovery_lag_s_median": round(statistics.median(lags), 3) if lags else None,
                "replicas_discovered": len(lags),
                "scrape_interval_s": args.scrape_interval,
                "failed_requests": len(traffic.failures()),
            }
        )
        out.update(replay(texts, windows, tmp))
    print(
        f"discovery lag (replica ready -> first successful scrape, {out['replicas_discovered']} replicas, "
        f"scrape/refresh {args.scrape_interval}s): max {out['discovery_lag_s_max']} s, median "
        f"{out['discovery_lag_s_median']} s"
    )
    print(
        f"analysis decisions, scrape vs Prometheus source over {out['replayed_steps']} recorded steps of the "
        f"promotion ({out['promotion_status']}) and rollback ({out['rollback_status']}) scenarios: "
        f"agreement {out['analysis_decision_agreement']} over {out['analysis_decisions_compared']} decisions "
        f"(goal 1.0); counters identical: {out['counters_identical']}"
    )
    if args.json:
        print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

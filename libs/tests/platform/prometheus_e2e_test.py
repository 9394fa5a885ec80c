"""`up`'s Prometheus end to end on the simulated engine: the platform (2 replicas of the tiny
model, the XGBoost fixture) with Debian's prometheus scraping every second, traffic through the
gateway, then a rollout to a version whose engine fails every request after its second. Asserted
through Prometheus' HTTP API: every ready replica was discovered (and scraped: health up), the
recorded series of each layer exist, PavedVersionErrorRate fired for the failing version (the
gateway retried its requests on v1: callers saw no error) and resolved after the rollback,
PavedRolloutRolledBack fired for the model's first rollback; the dashboard links the model to
its graphs; nothing is left running after stop()."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from paved.platform.up import MODEL_ID, PORTS_PER_REGION, SIM_ENGINE, Config, Platform, marked_processes
from paved.testing.ports import port_block

FAILING = "v2"


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s (last: {last!r:.2000})")


def prom(p: Platform, path: str, **params: str) -> Any:
    r = httpx.get(p.prometheus_url + path, params=params, timeout=10)
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]


def query(p: Platform, promql: str) -> list[dict[str, Any]]:
    return prom(p, "/api/v1/query", query=promql)["result"]


def version_alerts(p: Platform) -> list[dict[str, Any]]:
    return [
        a
        for a in prom(p, "/api/v1/alerts")["alerts"]
        if a["labels"].get("alertname") == "PavedVersionErrorRate"
        and a["labels"].get("paved_version") == FAILING
    ]


class Traffic:
    """Chat completions through the gateway, one every 0.1 s, until stopped."""

    def __init__(self, p: Platform):
        self.p = p
        self.statuses: list[int] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stopping.is_set():
                try:
                    r = client.post(
                        self.p.gateway_url + "/v1/chat/completions",
                        headers={"Authorization": f"Bearer {self.p.api_key}"},
                        json={
                            "model": MODEL_ID,
                            "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 4,
                        },
                    )
                    self.statuses.append(r.status_code)
                except httpx.HTTPError:
                    self.statuses.append(-1)
                self.stopping.wait(0.1)

    def stop(self) -> list[int]:
        self.stopping.set()
        self.thread.join(60)
        return self.statuses


def test_prometheus_discovers_records_and_alerts_on_a_failing_rollout(tmp_path: Path) -> None:
    cfg = Config(
        work_dir=tmp_path / "work",
        port=0,
        replica_port_base=port_block(PORTS_PER_REGION)[0],
        engine="sim",
        replicas=2,
        boot_timeout_s=240,
        prometheus_interval_s=1,
    )
    cfg.validate()
    p = Platform(cfg, say=lambda line: None)
    traffic: Traffic | None = None
    try:
        p.start()
        assert any(line.startswith(f"  prometheus: {p.prometheus_url}") for line in p.summary())

        # Every ready replica discovered with its labels and scraped.
        ready = {r["id"]: r for r in [*p.replicas, *p.xgb_replicas]}

        def discovered() -> dict[str, Any]:
            active = prom(p, "/api/v1/targets", state="active")["activeTargets"]
            up = {
                t["labels"].get("paved_replica"): t
                for t in active
                if t["labels"].get("paved_role") == "replica" and t["health"] == "up"
            }
            return up if set(ready) <= set(up) else {}

        targets = wait_for("every replica scraped", discovered, 120)
        for rid, r in ready.items():
            labels = targets[rid]["labels"]
            assert (labels["paved_model"], labels["paved_version"], labels["paved_region"]) == (
                r["model_id"],
                r["version"],
                r["region"],
            )
        roles = {t["labels"].get("paved_role") for t in prom(p, "/api/v1/targets")["activeTargets"]}
        assert {"replica", "gateway", "control_plane"} <= roles

        # A failing version rolled out under traffic.
        traffic = Traffic(p)
        body = {
            "model_id": MODEL_ID,
            "version": FAILING,
            "package_uri": p.package_uri,
            "replicas": 1,
            "min_replicas": 1,
            "max_replicas": 1,
            "regions": ["local"],
            "engine": SIM_ENGINE + "&fail_after=2",
        }
        assert p.api("POST", "/v1/deployments", body).status_code in (200, 201)
        r = p.api(
            "POST", "/v1/rollouts", {"model_id": MODEL_ID, "version": FAILING, "params": {"interval_s": 20}}
        )
        assert r.status_code in (200, 201), r.text
        rollout_id = r.json()["id"]

        fired = wait_for("PavedVersionErrorRate firing for v2", lambda: version_alerts(p), 240)
        assert fired[0]["state"] in ("pending", "firing") and fired[0]["labels"]["paved_model"] == MODEL_ID
        wait_for(
            "the alert firing",
            lambda: [a for a in version_alerts(p) if a["state"] == "firing"],
            60,
        )

        def finished() -> dict[str, Any] | None:
            rec = p.api("GET", f"/v1/rollouts/{rollout_id}").json()
            return rec if rec["status"] not in ("running", "pending") else None

        assert wait_for("the rollout to end", finished, 300)["status"] == "rolled_back"
        # The model's first rollback: its rolled_back series appears (at 1) with it.
        rolled_back = f'ALERTS{{alertname="PavedRolloutRolledBack", model="{MODEL_ID}", alertstate="firing"}}'
        wait_for("PavedRolloutRolledBack firing", lambda: query(p, rolled_back), 60)

        # The recorded series of each layer exist.
        for promql in (
            f'paved:gateway_availability:ratio_rate5m{{model="{MODEL_ID}"}}',
            f'paved:gateway_requests:rate5m{{model="{MODEL_ID}"}}',
            f'paved:replica_http_errors:ratio_rate1m{{paved_model="{MODEL_ID}", paved_version="v1"}}',
            f'paved:vllm_num_requests_waiting:sum{{paved_model="{MODEL_ID}"}}',
            f'paved:fleet_replicas_ready:sum{{model="{MODEL_ID}", version="v1"}}',
            f'paved:slo_availability_errors:ratio_rate5m{{model="{MODEL_ID}"}}',
        ):
            assert wait_for(promql, lambda q=promql: query(p, q), 60), promql
        # The fleet layer follows the control plane: v1 back at its 2 ready replicas.
        ready_v1 = f'paved:fleet_replicas_ready:sum{{model="{MODEL_ID}", version="v1"}} == 2'
        wait_for("2 ready v1 replicas recorded", lambda: query(p, ready_v1), 120)

        # Rolled back: v2 gets no traffic, so the alert resolves (its 1m window empties).
        wait_for("PavedVersionErrorRate resolved", lambda: not version_alerts(p), 240)
        assert query(p, f'ALERTS{{alertname="PavedVersionErrorRate", paved_version="{FAILING}"}}') == []
        statuses = traffic.stop()
        traffic = None
        assert statuses and all(s == 200 for s in statuses), sorted(set(statuses))

        # The dashboard links the model to its graphs in this Prometheus.
        summary = httpx.get(
            p.control_plane_url + "/dashboard/api/summary",
            headers={"Authorization": f"Bearer {p.admin_key}"},
            timeout=10,
        ).json()
        link = summary["prometheus"]["graphs"][MODEL_ID]
        assert link.startswith(p.prometheus_url + "/graph?") and "paved%3Agateway_availability" in link
        assert httpx.get(link, timeout=10, follow_redirects=True).status_code == 200
    finally:
        if traffic is not None:
            traffic.stop()
        p.stop()
    assert marked_processes(p.token) == {}

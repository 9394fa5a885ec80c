"""Control-plane scenarios on the simulated engine (real launchers materializing the tiny
package, a real gateway following the control plane's routes, the official `openai` client
driving traffic through it). Each scenario asserts 0 failed requests while it runs.

Red-black: happy v1 -> v2; a new version that fails its health gate; one that starts failing
at 50 % (analysis rolls back); the control plane killed mid-rollout and restarted (it adopts
its replicas and finishes); a replica killed (replaced). Versioned v1 and v2 side by side with
pinned consumers, then GC. A three-region wave that halts in region 2.
"""

from __future__ import annotations

import json
import os
import signal
import tarfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from fleet import (
    FAST,
    SIM,
    TrafficDriver,
    audit_messages,
    deploy,
    first_deploy,
    fleet_processes,
    make_fleet,
    model_messages,
    region,
    rollout,
    tiny_package,
)


def _versions_served(results, phase=None) -> set[str]:
    return {r.version for r in results if r.ok and (phase is None or r.phase == phase)}


@pytest.fixture
def fleet(tmp_path):
    with make_fleet(tmp_path) as make:
        yield make


def test_red_black_happy_path_moves_traffic_with_no_failed_request(fleet):
    cp, gw, key = fleet()
    first_deploy(cp, gw, key)
    v1_urls = {r["url"] for r in cp.replicas("tiny") if r["state"] == "ready"}
    deploy(cp, "v2")
    traffic = TrafficDriver(gw.url, key, "tiny", rate=8, phase="rollout", structured=True).start()
    r = cp.wait_rollout(rollout(cp, "v2")["id"])
    traffic.phase = "after"
    time.sleep(2)
    results = traffic.stop()
    assert r["status"] == "succeeded", (r, audit_messages(cp, r["id"]))
    assert traffic.failures() == [], traffic.failures()[:5]
    served = _versions_served(results)
    assert served & v1_urls and served - v1_urls  # traffic moved from v1's replica to v2's
    after = _versions_served(results, "after")
    assert after and not after & v1_urls  # all on v2 at the end
    messages = audit_messages(cp, r["id"])
    assert any("50" in m for m in messages) and any("promot" in m.lower() for m in messages), messages
    deployments = {d["version"]: d for d in cp.api("GET", "/v1/deployments?model_id=tiny")["data"]}
    assert deployments["v2"]["state"] == "active" and deployments["v1"]["state"] == "inactive"
    cp.wait_for(
        "v1's replica drained",
        lambda: not [x for x in cp.replicas("tiny") if x["url"] in v1_urls and x["state"] != "stopped"],
    )


def test_a_version_failing_its_health_gate_is_rolled_back(fleet):
    cp, gw, key = fleet()
    first_deploy(cp, gw, key)
    # Its engine refuses to start: a tokenizer directory missing on the replica's host is the
    # one engine error registration cannot see (bad options are a 400 there now).
    deploy(cp, "v2", engine="sim://tiny?tokenizer=/nonexistent/tokenizer")
    traffic = TrafficDriver(gw.url, key, "tiny", rate=5).start()
    r = cp.wait_rollout(rollout(cp, "v2")["id"])
    traffic.stop()
    assert r["status"] == "rolled_back", r
    assert traffic.failures() == [], traffic.failures()[:5]
    assert any("health" in m.lower() or "failed" in m.lower() for m in audit_messages(cp, r["id"]))
    # The replica's failure says why, in the launcher's words.
    failures = [m for m in model_messages(cp) if "tiny@v2 failed: " in m]
    assert failures and all("tokenizer" in m for m in failures), failures


def test_a_version_that_starts_failing_at_50_percent_is_rolled_back_by_analysis(fleet):
    cp, gw, key = fleet()
    first_deploy(cp, gw, key)
    # Healthy through its health gate, then every request fails (503, which the gateway
    # retries on v1: clients see no failure, the analysis sees the errors).
    deploy(cp, "v2", engine=SIM + "&fail_after=2")
    traffic = TrafficDriver(gw.url, key, "tiny", rate=8).start()
    r = cp.wait_rollout(rollout(cp, "v2", interval_s=3)["id"])
    traffic.stop()
    assert r["status"] == "rolled_back", (r, audit_messages(cp, r["id"]))
    assert traffic.failures() == [], traffic.failures()[:5]
    assert any("analysis" in m.lower() and "error rate" in m.lower() for m in audit_messages(cp, r["id"])), (
        audit_messages(cp, r["id"])
    )
    table = httpx.get(
        cp.url + "/v1/routes", headers={"Authorization": f"Bearer {cp.admin_key}"}, timeout=10
    ).json()
    weights = {b["version"]: b["weight"] for m in table["table"]["models"] for b in m["backends"]}
    assert weights.get("v1") and not weights.get("v2")


def test_control_plane_killed_mid_rollout_resumes_and_leaves_no_orphans(fleet, tmp_path):
    cp, gw, key = fleet()
    first_deploy(cp, gw, key)
    deploy(cp, "v2")
    traffic = TrafficDriver(gw.url, key, "tiny", rate=5).start()
    started = rollout(cp, "v2", interval_s=4)
    cp.wait_for(
        "the rollout to reach its first shift",
        lambda: cp.api("GET", f"/v1/rollouts/{started['id']}")["phase"].startswith(("shift", "analysis")),
    )
    cp.kill()  # a crash: replicas keep running; the gateway keeps its last routes
    time.sleep(2)
    cp.start()  # the same state: adopts the replicas, resumes the rollout
    r = cp.wait_rollout(started["id"])
    traffic.stop()
    assert r["status"] == "succeeded", (r, audit_messages(cp, r["id"]))
    assert traffic.failures() == [], traffic.failures()[:5]
    kinds = [e["kind"] for e in cp.api("GET", "/v1/audit?limit=1000")["data"]]
    assert "replica.adopted" in kinds

    # No orphans: once v1 is drained, the launchers running are exactly the live replicas (one
    # launcher and one engine process each), none left over from before the crash.
    def settled() -> bool:
        live = [x for x in cp.replicas() if x["state"] in ("starting", "ready", "unhealthy", "draining")]
        procs = fleet_processes(tmp_path / "work")
        launchers = [c for c in procs.values() if "paved.launcher.main" in c]
        engines = [c for c in procs.values() if "paved.frontend.server" in c and c not in launchers]
        seen[:] = [[x["state"] for x in live], launchers, engines]
        return len(live) == 1 and len(launchers) == 1 and len(engines) == 1

    seen: list = []
    try:
        cp.wait_for("one replica and nothing else running", settled, timeout_s=120)
    except AssertionError:
        raise AssertionError(f"live replicas, launchers, engines: {seen}") from None


def test_a_killed_replica_is_replaced(fleet):
    cp, gw, key = fleet()
    first_deploy(cp, gw, key, replicas=2)
    replicas = [x for x in cp.replicas("tiny") if x["state"] == "ready"]
    assert len(replicas) == 2
    victim = replicas[0]
    traffic = TrafficDriver(gw.url, key, "tiny", rate=5).start()
    pid = _launcher_pid_for(victim["url"])
    assert pid, "could not find the replica's launcher"
    os.killpg(pid, signal.SIGKILL)  # the launcher and its engine: a crashed replica
    cp.wait_for(
        "a replacement ready",
        lambda: (
            len([x for x in cp.replicas("tiny") if x["state"] == "ready" and x["id"] != victim["id"]]) == 2
        ),
    )
    traffic.stop()
    assert traffic.failures() == [], traffic.failures()[:5]
    kinds = [e["kind"] for e in cp.api("GET", "/v1/audit?limit=1000")["data"]]
    assert "replica.replaced" in kinds or "replica.failed" in kinds


def test_versioned_side_by_side_with_pins_then_gc(fleet):
    cp, gw, key = fleet()
    deploy(cp, "v1", strategy="versioned")
    assert cp.wait_rollout(rollout(cp, "v1")["id"])["status"] == "succeeded"
    deploy(cp, "v2", strategy="versioned")
    assert cp.wait_rollout(rollout(cp, "v2")["id"])["status"] == "succeeded"
    headers = {"Authorization": f"Bearer {key}"}

    def backend_of(model: str) -> str:
        r = httpx.post(
            gw.url + "/v1/completions",
            headers=headers,
            json={"model": model, "prompt": "x", "max_tokens": 1},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return r.headers["x-paved-backend"]

    cp.wait_for(
        "both versions routed",
        lambda: (
            httpx.get(gw.url + "/v1/models", headers=headers, timeout=10).json()["data"]
            and {"tiny@v1", "tiny@v2"}
            <= {m["id"] for m in httpx.get(gw.url + "/v1/models", headers=headers, timeout=10).json()["data"]}
        ),
    )
    urls = {x["version"]: x["url"] for x in cp.replicas("tiny") if x["state"] == "ready"}
    assert {backend_of("tiny@v1") for _ in range(5)} == {urls["v1"]}
    assert {backend_of("tiny@v2") for _ in range(5)} == {urls["v2"]}
    # The bare alias follows `current` (v1, the first), until moved.
    assert {backend_of("tiny") for _ in range(5)} == {urls["v1"]}
    cp.api("PUT", "/v1/models/tiny/current", {"version": "v2"})
    cp.wait_for("the alias follows v2", lambda: backend_of("tiny") == urls["v2"])
    # v1 is no longer current. It just had traffic (its pins), so a since-last-traffic
    # retention keeps it; a since-creation one lets it go; the latest and current (v2) never go.
    cp.wait_for(
        "v1's traffic recorded",
        lambda: cp.api("GET", "/v1/deployments/tiny/v1")["last_traffic_at"],
        timeout_s=30,
    )
    kept = cp.api("POST", "/v1/gc", {"retain_s_since_traffic": 3600, "min_kept": 1, "dry_run": True})
    assert kept["removed"] == []
    gone = cp.api("POST", "/v1/gc", {"retain_s_since_created": 0, "min_kept": 1})
    assert [x["version"] for x in gone["removed"]] == ["v1"], gone
    cp.wait_for(
        "v1 unrouted",
        lambda: (
            httpx.post(
                gw.url + "/v1/completions",
                headers=headers,
                json={"model": "tiny@v1", "prompt": "x", "max_tokens": 1},
                timeout=30,
            ).status_code
            == 404
        ),
    )
    assert backend_of("tiny") == urls["v2"] and backend_of("tiny@v2") == urls["v2"]


def test_three_region_wave_halts_in_region_two(fleet):
    regions = [region("r1", 50), region("r2", 50), region("r3", 50)]
    cp, gw, key = fleet(regions=regions)
    first_deploy(cp, gw, key, regions=["r1", "r2", "r3"])
    deploy(cp, "v2", regions=["r1", "r2", "r3"])
    traffic = TrafficDriver(gw.url, key, "tiny", rate=5).start()
    started = rollout(cp, "v2", waves=[["r1"], ["r2"], ["r3"]], bake_s=1)

    def v2_in_r2():
        return [
            x
            for x in cp.replicas("tiny")
            if x["version"] == "v2" and x["region"] == "r2" and x["state"] == "starting"
        ]

    victims = cp.wait_for("v2 starting in region 2", v2_in_r2)
    # Region 2's new replica dies during its health gate.
    pid = _launcher_pid_for(victims[0]["url"])
    assert pid, "could not find region 2's launcher"
    os.killpg(pid, signal.SIGKILL)
    r = cp.wait_rollout(started["id"])
    traffic.stop()
    assert r["status"] == "halted", (r, audit_messages(cp, r["id"]))
    assert "r2" in (r["reason"] or ""), r
    assert traffic.failures() == [], traffic.failures()[:5]
    table = httpx.get(
        cp.url + "/v1/routes", headers={"Authorization": f"Bearer {cp.admin_key}"}, timeout=10
    ).json()
    weights = {
        (b["region"], b["version"]): b["weight"] for m in table["table"]["models"] for b in m["backends"]
    }
    assert not any(w for (region, version), w in weights.items() if version == "v2"), weights
    assert not any(
        x
        for x in cp.replicas("tiny")
        if x["version"] == "v2" and x["region"] == "r3" and x["state"] != "stopped"
    )


def _launcher_pid_for(url: str) -> int | None:
    port = url.rsplit(":", 1)[1]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"paved.launcher.main" in cmd and port.encode() in cmd:
                return int(proc.name)
    return None


def test_autoscaler_follows_the_queue_up_and_down(fleet):
    cp, gw, key = fleet()
    body = {
        "model_id": "tiny",
        "version": "v1",
        "package_uri": tiny_package(),
        "replicas": 1,
        "min_replicas": 1,
        "max_replicas": 3,
        "engine": "sim://tiny?tokens_per_s=20&max_num_seqs=2",
        "autoscale": {
            "enabled": True,
            "target_waiting": 1,
            "target_in_flight": 4,
            "stable_window_s": 6,
            "panic_window_s": 2,
            "scale_down_delay_s": 3,
            "interval_s": 0.5,
        },
    }
    cp.api("POST", "/v1/deployments", body)
    assert cp.wait_rollout(rollout(cp, "v1")["id"])["status"] == "succeeded"

    def decisions() -> list[dict]:
        return [
            e["data"]
            for e in cp.api("GET", "/v1/audit?model_id=tiny&limit=1000")["data"]
            if e["kind"] == "autoscale"
        ]

    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                c.post(
                    gw.url + "/v1/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json={"model": "tiny", "prompt": "x", "max_tokens": 60, "ignore_eos": True},
                )

    workers = [threading.Thread(target=load, daemon=True) for _ in range(10)]
    for w in workers:
        w.start()
    try:
        cp.wait_for("a scale-up to 3", lambda: any(d["to"] == 3 for d in decisions()), timeout_s=60)
        cp.wait_for(
            "3 ready replicas",
            lambda: len([x for x in cp.replicas("tiny") if x["state"] == "ready"]) == 3,
            timeout_s=90,
        )
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=90)
    cp.wait_for(
        "a scale-down to 1", lambda: any(d["to"] == 1 and d["from"] > 1 for d in decisions()), timeout_s=90
    )
    ups = [d for d in decisions() if d["to"] > d["from"]]
    assert ups and all(d["to"] <= 3 for d in ups)
    assert any(d["mode"] == "panic" for d in ups) or any("waiting" in d["reason"] for d in ups), ups


def test_the_paved_cli_drives_the_control_plane(fleet, capsys, monkeypatch):
    from paved.cli.main import main

    cp, _gw, _key = fleet()
    monkeypatch.setenv("PAVED_CONTROL_PLANE_URL", cp.url)
    monkeypatch.setenv("PAVED_ADMIN_KEY", cp.admin_key)
    route = '{"cache": {"exact": true}}'
    assert main(["deploy", "create", "tiny", "v1", tiny_package(), "--engine", SIM, "--route", route]) == 0
    assert "paved rollout start tiny v1" in capsys.readouterr().out
    assert main(["rollout", "start", "tiny", "v1", "--phases", "100", "--interval", "1s"]) == 0
    rollout_id = capsys.readouterr().out.split()[1].rstrip(":")
    assert cp.wait_rollout(rollout_id)["status"] == "succeeded"
    assert main(["deploy", "list", "--json"]) == 0
    listed = capsys.readouterr().out
    assert '"state": "active"' in listed and '"exact": true' in listed, listed
    assert main(["audit", "--model", "tiny"]) == 0
    assert "passed its health gate" in capsys.readouterr().out
    assert main(["rollout", "status", rollout_id]) == 0
    assert "succeeded" in capsys.readouterr().out
    # Errors: an unknown version is exit 1 with the API's message; bad phases exit 2.
    assert main(["rollout", "start", "tiny", "v9"]) == 1
    assert "no deployment tiny@v9" in capsys.readouterr().err
    assert main(["rollout", "start", "tiny", "v1", "--phases", "50,20"]) == 2
    assert main(["deploy", "create", "tiny", "v2", tiny_package(), "--route", "[1]"]) == 2
    assert "--route: must be a JSON object" in capsys.readouterr().err


def test_red_black_is_refused_when_the_io_fingerprint_changes(fleet, tmp_path):
    cp, gw, key = fleet()
    first_deploy(cp, gw, key)
    # The same model with a longer context: callers would see other limits under one alias.
    changed = tmp_path / "v2-package"
    with tarfile.open(tiny_package()) as tar:
        tar.extractall(changed, filter="data")
    manifest = json.loads((changed / "model.json").read_text())
    manifest["engine_args"]["max_model_len"] = 1024
    (changed / "model.json").write_text(json.dumps(manifest))
    body = {"model_id": "tiny", "version": "v2", "package_uri": str(changed), "engine": SIM}
    assert cp.api("POST", "/v1/deployments", body)["fingerprint"]["max_model_len"] == 1024
    r = httpx.post(
        cp.url + "/v1/rollouts",
        headers={"Authorization": f"Bearer {cp.admin_key}"},
        json={"model_id": "tiny", "version": "v2", "params": FAST},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "fingerprint_changed" and "versioned" in error["message"]
    assert "max_model_len" in error["message"]
    forced = rollout(cp, "v2", force=True)
    assert cp.wait_rollout(forced["id"])["status"] == "succeeded"

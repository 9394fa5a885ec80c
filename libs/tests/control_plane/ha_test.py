"""Two control planes on one PostgreSQL (started from the machine's binaries): one leads (an
advisory lock) and runs the controller, both serve the API and the routes. The leader is killed
mid-rollout; the follower takes the lock, adopts the replicas and finishes the rollout, with 0
failed requests through a gateway that follows the follower's routes."""

from __future__ import annotations

import secrets

import httpx
from fleet import (
    ControlPlaneProcess,
    TrafficDriver,
    audit_messages,
    deploy,
    first_deploy,
    free_port,
    gateway_for,
    reap_replicas,
    region,
    rollout,
)

from paved.testing.postgres import create_database, postgres_server


def test_follower_takes_over_mid_rollout_and_finishes_it(tmp_path):
    key = "adm-" + secrets.token_hex(16)
    gateway_port = free_port()
    local = region(n=50)  # one range: the follower drives the leader's replicas
    made = []
    with postgres_server() as pg:
        state = create_database(pg, "cp")
        try:

            def control_plane() -> ControlPlaneProcess:
                cp = ControlPlaneProcess(
                    "--gateway-metrics",
                    f"http://127.0.0.1:{gateway_port}/metrics",
                    admin_key=key,
                    state=state,
                    work_dir=tmp_path / "work",
                    regions=[local],
                )
                made.append(cp)
                return cp

            leader = control_plane()
            follower = control_plane()
            assert httpx.get(leader.url + "/health/ready", timeout=10).json()["leader"] is True
            assert httpx.get(follower.url + "/health/ready", timeout=10).json()["leader"] is False
            gw = gateway_for(follower, tmp_path, "--port", str(gateway_port))
            made.append(gw)
            gw.tenant("team")
            api_key = gw.key("team")
            first_deploy(leader, gw, api_key)
            deploy(follower, "v2")  # either replica serves the API
            traffic = TrafficDriver(gw.url, api_key, "tiny", rate=5).start()
            started = rollout(leader, "v2", interval_s=4)
            leader.wait_for(
                "the first shift",
                lambda: leader.api("GET", f"/v1/rollouts/{started['id']}")["phase"].startswith(
                    ("shift", "analysis")
                ),
            )
            leader.kill()
            follower.wait_for(
                "the follower to lead",
                lambda: httpx.get(follower.url + "/health/ready", timeout=10).json()["leader"],
            )
            done = follower.wait_rollout(started["id"])
            traffic.stop()
            assert done["status"] == "succeeded", (done, audit_messages(follower, started["id"]))
            assert traffic.failures() == [], traffic.failures()[:5]
            kinds = [e["kind"] for e in follower.api("GET", "/v1/audit?limit=1000")["data"]]
            assert kinds.count("leader") == 2 and "replica.adopted" in kinds
        finally:
            for thing in reversed(made):
                thing.stop()
            reap_replicas(tmp_path / "work")

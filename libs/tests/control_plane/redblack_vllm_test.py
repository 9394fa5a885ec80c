"""The core red-black scenario on the real tiny vLLM model: the control plane deploys v1 from the
tiny package through the launcher (vLLM in the replica's frontend), then rolls v1 -> v2 while the
official `openai` client sends structured-output requests through the gateway at a fixed rate:
0 failed requests, every answer valid JSON of its schema, all traffic on v2 at the end, v1
drained."""

from __future__ import annotations

import time

import pytest
from fleet import TrafficDriver, audit_messages, deploy, first_deploy, make_fleet, rollout


@pytest.fixture
def fleet(tmp_path):
    with make_fleet(tmp_path) as make:
        yield make


def test_red_black_on_vllm_with_structured_outputs_and_no_failed_request(fleet):
    cp, gw, key = fleet(None, "--health-timeout", "600")
    first_deploy(cp, gw, key, engine="package")
    v1 = {r["url"] for r in cp.replicas("tiny") if r["state"] == "ready"}
    deploy(cp, "v2", engine="package")
    traffic = TrafficDriver(gw.url, key, "tiny", rate=2, phase="rollout", structured=True).start()
    r = cp.wait_rollout(rollout(cp, "v2", interval_s=5, health_timeout_s=600)["id"], timeout_s=900)
    traffic.phase = "after"
    time.sleep(3)
    results = traffic.stop()
    assert r["status"] == "succeeded", (r, audit_messages(cp, r["id"]))
    assert traffic.failures() == [], traffic.failures()[:5]
    assert len(results) > 20
    served = {x.version for x in results if x.ok}
    assert served & v1 and served - v1
    assert {x.version for x in results if x.phase == "after"}.isdisjoint(v1)
    cp.wait_for(
        "v1 drained",
        lambda: not [x for x in cp.replicas("tiny") if x["url"] in v1 and x["state"] != "stopped"],
        timeout_s=120,
    )

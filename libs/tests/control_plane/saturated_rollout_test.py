"""A new version that is saturated, not failing, is promoted (issue 22).

The red-black scenario on the simulated engine (real launchers, a real gateway following the
control plane's routes, the official `openai` client driving traffic): v2's engine runs one
sequence and queues one more, so at half the traffic it pushes back (`503 overloaded` +
Retry-After, as paved's frontend answers a full engine queue) on many requests, which the
gateway holds and retries; rollout analysis must not read that as errors. Its twin, v2 refusing
every request with the simulated engine's injected 503 `unavailable` (`fail_after`), is rolled
back by analysis in scenarios_test."""

from __future__ import annotations

import httpx
import pytest
from fleet import TrafficDriver, audit_messages, deploy, first_deploy, make_fleet, model_messages, rollout

SATURATED = "sim://tiny?tokens_per_s=40&max_num_seqs=1&max_waiting=1"


@pytest.fixture
def fleet(tmp_path):
    with make_fleet(tmp_path) as make:
        yield make


def _pushback(gw) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("paved_gateway_pushback_total{")
    )


def test_a_saturated_version_is_promoted_not_rolled_back(fleet):
    cp, gw, key = fleet()
    first_deploy(cp, gw, key)
    deploy(cp, "v2", engine=SATURATED)
    traffic = TrafficDriver(gw.url, key, "tiny", rate=8).start()
    r = cp.wait_rollout(rollout(cp, "v2")["id"])
    traffic.stop()
    messages = audit_messages(cp, r["id"])
    # The analysis saw a busy version, not a failing one ...
    # (a string, which pytest prints whole: the events say why a replica failed)
    assert r["status"] == "succeeded", "\n".join([str(r), *model_messages(cp)])
    assert not any("rolling back" in m for m in messages), messages
    # ... and it did push back (the scenario is not vacuous).
    assert _pushback(gw) > 0, messages
    assert traffic.failures() == [], traffic.failures()[:5]

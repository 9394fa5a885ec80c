"""Scale to zero with real processes: the control-plane main (local driver, launchers of the tiny
package on the simulated engine) and gateway mains following its routes, the official `openai`
client and httpx as callers.

1. An idle deployment goes to zero, its alias stays in /v1/models and in the routes (marked),
   a burst through two gateway replicas at once is held, wakes it, and is answered in full: one
   wake event, one replica started.
2. A gateway holding requests for a model at zero (a routes file: nothing wakes it): a full
   queue and an expired wait are 503 with Retry-After and an OpenAI error body, never a 404 or
   a hang; a client that leaves is removed from the queue at once.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time

import httpx
import openai
import pytest
from fleet import FAST, SIM, gateway_for, make_fleet, tiny_package
from gateway_proc import GatewayProcess, write_routes

from paved.gateway.routing.routes import parse_routes


@pytest.fixture
def fleet(tmp_path):
    with make_fleet(tmp_path) as make:
        yield make


def _metric(gw: GatewayProcess, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if match is None:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def _routes(cp) -> dict:
    r = httpx.get(cp.url + "/v1/routes", headers={"Authorization": f"Bearer {cp.admin_key}"}, timeout=10)
    return r.json()


def _has_table(gw: GatewayProcess, revision: str) -> bool:
    return gw.admin("GET", "/admin/v1/routes").json()["revision"] == revision


async def _burst(url: str, key: str, n: int) -> list[int | str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)

    async def one(i: int) -> int | str:
        try:
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=4
            )
            return 200
        except openai.APIStatusError as e:
            return e.status_code
        except Exception as e:  # noqa: BLE001 - every failure is a result
            return f"{type(e).__name__}: {e}"

    try:
        return list(await asyncio.gather(*(one(i) for i in range(n))))
    finally:
        await client.close()


def test_an_idle_model_goes_to_zero_and_a_burst_through_two_gateways_wakes_it_once(fleet, tmp_path):
    cp, gw, key = fleet()
    gw2 = gateway_for(cp, tmp_path / "gw2")
    try:
        gw2.tenant("team")
        key2 = gw2.key("team")
        cp.api(
            "POST",
            "/v1/deployments",
            {
                "model_id": "tiny",
                "version": "v1",
                "package_uri": tiny_package(),
                "engine": SIM,
                "min_replicas": 0,
                "replicas": 1,
                "autoscale": {"enabled": True, "scale_to_zero_after_s": 2},
            },
        )
        r = cp.api("POST", "/v1/rollouts", {"model_id": "tiny", "version": "v1", "params": FAST})
        assert cp.wait_rollout(r["id"])["status"] == "succeeded"

        # Idle: scaled to zero, drained, the alias kept in the routes with no backend.
        cp.wait_for(
            "tiny at zero in the routes",
            lambda: [m for m in _routes(cp)["table"]["models"] if m.get("scaled_to_zero")],
        )
        cp.wait_for(
            "its replica drained", lambda: not [x for x in cp.replicas("tiny") if x["state"] != "stopped"]
        )
        audit = cp.api("GET", "/v1/audit?model_id=tiny&limit=1000")["data"]
        (to_zero,) = [e for e in audit if e["data"].get("mode") == "to_zero"]
        table = _routes(cp)["table"]
        (model,) = table["models"]
        assert model["backends"] == [] and model["scaled_to_zero"] and "waking" not in model
        revision = parse_routes(table).revision
        for g in (gw, gw2):
            cp.wait_for("the gateway following the table at zero", lambda g=g: _has_table(g, revision))
        models = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert "tiny" in {m["id"] for m in models.json()["data"]}, models.text

        # A burst through both gateways at once: held, one wake, every request answered.
        async def both() -> list[int | str]:
            a, b = await asyncio.gather(_burst(gw.url, key, 12), _burst(gw2.url, key2, 12))
            return a + b

        results = asyncio.run(both())
        assert results == [200] * 24, results
        audit = cp.api("GET", f"/v1/audit?model_id=tiny&after_id={to_zero['id']}&limit=1000")["data"]
        wakes = [e for e in audit if e["data"].get("mode") == "wake"]
        started = [e for e in audit if e["kind"] == "scale" and e["message"].startswith("started replica")]
        assert len(wakes) == 1 and len(started) == 1, [e["message"] for e in audit]
        for g in (gw, gw2):
            assert _metric(g, "paved_gateway_wake_calls_total", model="tiny", outcome="ok") >= 1, g.tail()
            assert _metric(g, "paved_gateway_held_requests", model="tiny") == 0
    finally:
        gw2.stop()


def test_requests_held_for_a_model_at_zero_are_refused_with_503_when_full_or_late(tmp_path):
    routes = write_routes(tmp_path / "routes.json", [{"alias": "tiny", "scaled_to_zero": True}])
    admin = "adm-" + secrets.token_hex(16)
    # A routes file: no control plane to wake the model, so nothing ever releases the queue.
    short = GatewayProcess(
        routes, "--queue-size", "2", "--wake-max-wait", "2", admin_key=admin, state_dir=tmp_path
    )
    (tmp_path / "long").mkdir()
    long = GatewayProcess(routes, "--wake-max-wait", "600", admin_key=admin, state_dir=tmp_path / "long")
    try:
        short.tenant("team")
        key = short.key("team")
        models = httpx.get(short.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert [m["id"] for m in models.json()["data"]] == ["tiny"], models.text

        async def three() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                return list(
                    await asyncio.gather(
                        *(
                            client.post(
                                short.url + "/v1/chat/completions",
                                headers={"Authorization": f"Bearer {key}"},
                                json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
                            )
                            for _ in range(3)
                        )
                    )
                )

        answers = asyncio.run(three())
        codes = sorted(r.json()["error"]["code"] for r in answers)
        assert codes == ["queue_full", "queue_timeout", "queue_timeout"], [r.text for r in answers]
        for r in answers:
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
            error = r.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"}
        late = [r.json()["error"]["message"] for r in answers if r.json()["error"]["code"] == "queue_timeout"]
        assert all("scaled to zero" in m for m in late), late
        assert _metric(short, "paved_gateway_held_requests", model="tiny") == 0

        # A client that leaves while held is out of the queue at once (its wait is 600 s).
        long.tenant("team")
        key = long.key("team")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                long.url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
                timeout=httpx.Timeout(10, read=1),
            )
        deadline = time.monotonic() + 60
        while _metric(long, "paved_gateway_held_requests", model="tiny") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _metric(long, "paved_gateway_held_requests", model="tiny") == 0, long.tail()
        assert _metric(long, "paved_gateway_queue_depth", model="tiny") == 0
        assert _metric(long, "paved_gateway_client_disconnects_total", model="tiny") == 1
    finally:
        short.stop()
        long.stop()

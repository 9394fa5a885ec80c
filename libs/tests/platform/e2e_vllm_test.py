"""End to end on the real tiny vLLM model: `up`'s `Platform` (control plane, gateway, tiny@v1 on
vLLM, 1 replica) driven only through its public surfaces.

  * request ids: a known `x-request-id` and `traceparent` sent through the gateway with the
    official `openai` client and the key the gateway created; the response echoes the id, the
    gateway's access log (WORK/logs/gateway.log) has it with the client's trace_id, and so has
    a JSON line of the replica's log (the frontend's access log, paved.frontend.access);
  * metrics: every replica's metrics proxy (its launcher's metrics port, the replica's
    `metrics_url`: the engine's multiprocess files merged with the frontend's /metrics) shows
    vLLM's `vllm:` gauges, for v1 and, after the rollout, for v2;
  * a red-black rollout v1 -> v2 (v2 registered from the same package) started through the
    control plane's API under a steady load of two client threads, half of their requests with
    a `response_format` JSON schema: 0 failed requests, every structured answer valid against its
    schema (jsonschema), both versions served, only v2 after, v1 drained;
  * nothing marked with the platform's token is left once it stops.

  * KServe v2 through the gateway with the same key: `tritonclient` (gRPC and HTTP) scores the
    XGBoost fixture (a kserve-mode package the control plane deployed) exactly as xgboost itself
    does, and generates with the tiny LLM over gRPC (its package declares `engine_args.kserve`,
    so its replica serves KServe gRPC beside the OpenAI API), its x-request-id and trace id in
    the gateway's and the replica's access lines, and both replicas' metrics proxies count those
    calls (paved_kserve_request_success_total by protocol);

One platform for the module (a vLLM boot costs minutes on a 2-core machine): the tests run in
file order and the rollout comes last.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from paved.platform.up import PORTS_PER_REGION, Config, Platform, marked_processes
from paved.testing.ports import port_block

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
# Short phases, and room for v2's vLLM boot on a loaded 2-core machine.
ROLLOUT_PARAMS = {
    "phases": [50, 100],
    "interval_s": 5,
    "health_timeout_s": 600,
    "fast_rollback_window_s": 1,
    "min_requests": 3,
}


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    work = tmp_path_factory.mktemp("e2e") / "work"
    lines: list[str] = []
    cfg = Config(
        work_dir=work,
        port=0,
        replica_port_base=port_block(PORTS_PER_REGION)[0],
        engine="vllm",
        replicas=1,
        boot_timeout_s=900,
    )
    p = Platform(cfg, say=lines.append)
    try:
        p.start()
        yield p
    finally:
        p.stop()
        left = marked_processes(p.token)
        assert left == {}, (left, lines)


def client(p: Platform) -> openai.OpenAI:
    return openai.OpenAI(base_url=p.gateway_url + "/v1", api_key=p.api_key, max_retries=0, timeout=120)


def replicas(p: Platform) -> list[dict[str, Any]]:
    r = p.api("GET", f"/v1/replicas?model_id={MODEL}")
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def ready_replicas(p: Platform) -> list[dict[str, Any]]:
    return [x for x in replicas(p) if x["state"] == "ready"]


def wait_for(what: str, predicate: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


def json_lines_with(path: Path, needle: str) -> list[dict[str, Any]]:
    """The JSON objects on the lines of `path` that contain `needle` (a log formatter may put a
    prefix before the object)."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        if needle in line and "{" in line:
            try:
                value = json.loads(line[line.index("{") :])
            except ValueError:
                continue
            if isinstance(value, dict):
                out.append(value)
    return out


def traced_request(p: Platform) -> tuple[str, str, Any]:
    request_id = "e2e-" + secrets.token_hex(8)
    trace_id = secrets.token_hex(16)
    raw = client(p).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        extra_headers={"x-request-id": request_id, "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
    )
    return request_id, trace_id, raw


def test_request_id_is_echoed_and_in_the_gateway_access_log(platform: Platform) -> None:
    request_id, trace_id, raw = traced_request(platform)
    assert raw.http_response.status_code == 200
    assert raw.parse().choices[0].message.content is not None
    assert raw.headers["x-request-id"] == request_id
    log = platform.cfg.work_dir / "logs" / "gateway.log"
    lines = wait_for(
        "the request id in the gateway's access log",
        lambda: [x for x in json_lines_with(log, request_id) if x.get("request_id") == request_id],
        30,
    )
    assert [x.get("trace_id") for x in lines] == [trace_id], lines


def test_the_replica_log_carries_the_request_and_trace_ids(platform: Platform) -> None:
    request_id, trace_id, raw = traced_request(platform)
    assert raw.http_response.status_code == 200
    (replica,) = ready_replicas(platform)
    # The frontend's access log (paved.frontend.access) goes to the replica's log, which the
    # local driver keeps in WORK/replicas/<region>/<replica id>/log.
    log = platform.cfg.work_dir / "replicas" / replica["region"] / replica["id"] / "log"
    lines = wait_for(
        f"a JSON line with request_id {request_id} in {log}",
        lambda: [x for x in json_lines_with(log, request_id) if x.get("request_id") == request_id],
        30,
    )
    assert [x.get("trace_id") for x in lines] == [trace_id] * len(lines), lines


def test_tritonclient_scores_xgboost_and_the_llm_through_the_gateway(platform: Platform) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    import xgboost
    from tritonclient.utils import InferenceServerException

    from paved.runfiles import runfile

    p = platform
    headers = {"authorization": f"Bearer {p.api_key}"}
    x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    expected = xgboost.Booster(model_file=runfile("models/xgb/model.ubj")).inplace_predict(x)
    g = grpcclient.InferenceServerClient(p.kserve_grpc)
    h = httpclient.InferenceServerClient(p.gateway_url.removeprefix("http://"), network_timeout=120)
    try:
        for module, c in ((grpcclient, g), (httpclient, h)):
            t = module.InferInput("input__0", [3, 32], "FP32")
            t.set_data_from_numpy(x)
            # A copy: tritonclient.http adds its own headers to the dict it is given.
            scores = c.infer("xgb_scorer", [t], headers=dict(headers)).as_numpy("output__0")
            assert np.array_equal(scores, expected), (module.__name__, scores, expected)
        prompt = grpcclient.InferInput("text_input", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([b"once upon"], dtype=object))
        params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
        params.set_data_from_numpy(
            np.array(
                [json.dumps({"max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()], dtype=object
            )
        )
        request_id, trace_id = "e2e-kserve-" + secrets.token_hex(6), secrets.token_hex(16)
        traced = {
            **headers,
            "x-request-id": request_id,
            "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01",
        }
        text = g.infer(MODEL, [prompt, params], headers=traced).as_numpy("text_output")
        assert text is not None and len(text) == 1 and isinstance(text[0], bytes), text
        # The ids reach both hops' access logs: the gateway's, and the replica's KServe server's.
        gateway_log = p.cfg.work_dir / "logs" / "gateway.log"
        lines = wait_for(
            "the KServe call in the gateway's access log",
            lambda: [
                x for x in json_lines_with(gateway_log, request_id) if x.get("request_id") == request_id
            ],
            30,
        )
        assert [(x.get("trace_id"), x.get("protocol"), x.get("status")) for x in lines] == [
            (trace_id, "kserve-grpc", "OK")
        ], lines
        (replica,) = ready_replicas(p)
        replica_log = p.cfg.work_dir / "replicas" / replica["region"] / replica["id"] / "log"
        lines = wait_for(
            "the KServe call in the replica's access log",
            lambda: [
                x for x in json_lines_with(replica_log, request_id) if x.get("request_id") == request_id
            ],
            30,
        )
        assert {x.get("trace_id") for x in lines} == {trace_id}, lines
        t = grpcclient.InferInput("input__0", [3, 32], "FP32")
        t.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException, match=r"(?i)unauthenticated"):
            g.infer("xgb_scorer", [t], headers={"authorization": "Bearer pvd_aaaaaaaaaaaa_nope"})
    finally:
        g.close()
        h.close()


def vllm_gauges(replica: dict[str, Any]) -> set[str]:
    """vLLM's gauges as the replica's metrics proxy (its launcher's metrics port) shows them."""
    assert replica["metrics_url"] != replica["url"] + "/metrics", replica
    text = httpx.get(replica["metrics_url"], timeout=10).text
    assert 'paved_metrics_proxy_up{source="frontend"} 1.0' in text, text[:2000]
    return {
        line.split()[2]
        for line in text.splitlines()
        if line.startswith("# TYPE vllm:") and line.split()[-1] == "gauge"
    }


def kserve_successes(metrics_url: str, model: str) -> dict[str, float]:
    """paved_kserve_request_success_total for `model` by protocol, as a replica's metrics proxy
    shows it."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=10).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "paved_kserve_request_success_total" and sample.labels.get("model") == model:
                protocol = sample.labels["protocol"]
                counts[protocol] = counts.get(protocol, 0.0) + sample.value
    return counts


def test_kserve_requests_are_counted_on_each_replicas_metrics_proxy(platform: Platform) -> None:
    """The KServe calls of the test above, counted by each replica's paved.kserve metrics and
    visible through its launcher's metrics port: the XGBoost replica's gRPC and HTTP scorings,
    the LLM replica's gRPC generation."""
    (xgb,) = platform.xgb_replicas
    scored = wait_for(
        "the XGBoost scorings on its replica's metrics proxy",
        lambda: (c := kserve_successes(xgb["metrics_url"], "xgb_scorer")).get("grpc") and c.get("http") and c,
        30,
    )
    assert scored["grpc"] >= 1 and scored["http"] >= 1, scored
    (llm,) = ready_replicas(platform)
    generated = kserve_successes(llm["metrics_url"], MODEL)
    assert generated.get("grpc", 0) >= 1, generated


def test_every_replica_shows_vllm_gauges(platform: Platform) -> None:
    replicas = ready_replicas(platform)
    assert len(replicas) == 1, replicas
    for replica in replicas:
        gauges = vllm_gauges(replica)
        assert "vllm:num_requests_running" in gauges, (replica, gauges)
        assert "vllm:num_requests_waiting" in gauges, (replica, gauges)


@dataclass
class Sent:
    phase: str
    structured: bool
    ok: bool
    backend: str | None
    error: str = ""


class Load:
    """`threads` clients, each sending one chat request after another until stopped; every other
    request asks for `SCHEMA`, and its answer must parse and validate."""

    def __init__(self, p: Platform, threads: int = 2):
        self.phase = "rollout"
        self.sent: list[Sent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(p,), daemon=True) for _ in range(threads)]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[Sent]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)
        assert not any(t.is_alive() for t in self._threads)
        return self.sent

    def _run(self, p: Platform) -> None:
        c = client(p)
        structured = False
        while not self._stop.is_set():
            structured = not structured
            self._one(c, structured)

    def _one(self, c: openai.OpenAI, structured: bool) -> None:
        phase = self.phase
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": "Is the sky blue? Answer in JSON." if structured else "hi"}
            ],
            "max_tokens": 40 if structured else 8,
        }
        if structured:
            kwargs["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "r", "schema": SCHEMA},
            }
        try:
            raw = c.chat.completions.with_raw_response.create(**kwargs)
            content = raw.parse().choices[0].message.content
            if structured:
                jsonschema.validate(json.loads(content or ""), SCHEMA)
            sent = Sent(phase, structured, True, raw.headers.get("x-paved-backend"))
        except Exception as e:  # noqa: BLE001 - every failure is a recorded result
            sent = Sent(phase, structured, False, None, f"{type(e).__name__}: {e}"[:300])
        with self._lock:
            self.sent.append(sent)


def why_failed(p: Platform, rollout: dict[str, Any], audit: list[dict[str, Any]]) -> str:
    """What a failed rollout's assertion prints: the audit, every replica's state and reason, and
    the tail of each failed replica's log (the work dir is gone once the test ends)."""
    lines = [f"rollout {rollout.get('status')}: {rollout.get('reason')}"]
    lines += [e["message"] for e in audit]
    for x in replicas(p):
        lines.append(f"replica {x['id']} {x['version']} {x['state']}: {x.get('reason')}")
        if x["state"] in ("failed", "unhealthy", "stopped"):
            log = p.cfg.work_dir / "replicas" / x["region"] / x["id"] / "log"
            try:
                lines += ["  " + t for t in log.read_text(errors="replace").splitlines()[-40:]]
            except OSError as e:
                lines.append(f"  (no log: {e})")
    return "\n".join(lines)


def test_red_black_rollout_under_load_fails_no_request(platform: Platform) -> None:
    p = platform
    v1 = {x["url"] for x in ready_replicas(p)}
    r = p.api(
        "POST",
        "/v1/deployments",
        {
            "model_id": MODEL,
            "version": "v2",
            "package_uri": p.package_uri,
            "strategy": "red_black",
            "replicas": 1,
            "min_replicas": 1,
            "max_replicas": 1,
            "engine": "package",
        },
    )
    assert r.status_code in (200, 201), r.text
    load = Load(p).start()
    try:
        r = p.api("POST", "/v1/rollouts", {"model_id": MODEL, "version": "v2", "params": ROLLOUT_PARAMS})
        assert r.status_code in (200, 201), r.text
        rollout_id = r.json()["id"]

        def finished() -> dict[str, Any] | None:
            body = p.api("GET", f"/v1/rollouts/{rollout_id}").json()
            return body if body["status"] != "running" else None

        rollout = wait_for(f"rollout {rollout_id} finished", finished, 900)
        load.phase = "after"
        time.sleep(5)
    finally:
        sent = load.stop()
    audit = p.api("GET", f"/v1/audit?rollout_id={rollout_id}&limit=1000").json()["data"]
    assert rollout["status"] == "succeeded", why_failed(p, rollout, audit)
    failed = [x for x in sent if not x.ok]
    print(f"{len(sent)} requests, {sum(x.structured for x in sent)} structured, {len(failed)} failed")
    assert failed == [], failed[:5]
    assert sum(x.structured for x in sent) >= 5 and sum(not x.structured for x in sent) >= 5, len(sent)
    served = {x.backend for x in sent}
    assert served & v1 and served - v1, served
    after = [x for x in sent if x.phase == "after"]
    assert after and {x.backend for x in after}.isdisjoint(v1), after
    wait_for(
        "v1 drained", lambda: not [x for x in replicas(p) if x["url"] in v1 and x["state"] != "stopped"], 180
    )
    (v2,) = ready_replicas(p)
    assert v2["version"] == "v2" and v2["url"] in served, v2
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting"} <= vllm_gauges(v2)

"""The KPA autoscaler's decisions on an injected clock, and scraping a real simulated frontend."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from servers import ServerProcess

from paved.control_plane.autoscaler import Autoscaler, Decision
from paved.control_plane.types import AutoscalePolicy
from paved.metrics.gauges import ReplicaMetrics, ScrapeError, parse_metrics, scrape

POLICY = AutoscalePolicy(
    enabled=True,
    target_waiting=2.0,
    target_kv_usage=0.8,
    target_in_flight=8.0,
    stable_window_s=60.0,
    panic_window_s=6.0,
    panic_threshold=2.0,
    scale_down_delay_s=30.0,
    interval_s=2.0,
)


def load(
    in_flight: float, replicas: int = 1, *, waiting_share: float = 0.0, kv: float = 0.0
) -> list[ReplicaMetrics]:
    """`replicas` samples whose totals are `in_flight` (of which `waiting_share` waits)."""
    each = in_flight / replicas
    return [
        ReplicaMetrics(waiting=each * waiting_share, running=each * (1 - waiting_share), kv_usage=kv)
    ] * replicas


class Sim:
    """Drives one Autoscaler tick by tick (observe then decide every interval_s), applying each
    decision at once (ready follows the target) unless told otherwise."""

    def __init__(self, policy: AutoscalePolicy = POLICY, *, target: int = 1, lo: int = 1, hi: int = 10):
        self.t = 1000.0
        self.policy = policy
        self.scaler = Autoscaler(policy, clock=lambda: self.t)
        self.target, self.lo, self.hi = target, lo, hi
        self.log: list[tuple[float, Decision]] = []

    def tick(
        self, samples: list[ReplicaMetrics], *, in_flight: bool = False, ready: int | None = None
    ) -> Decision:
        self.t += self.policy.interval_s
        self.scaler.observe(samples)
        d = self.scaler.decide(
            current_target=self.target,
            ready=self.target if ready is None else ready,
            min_replicas=self.lo,
            max_replicas=self.hi,
            step_in_flight=in_flight,
        )
        self.log.append((self.t, d))
        if not in_flight:
            self.target = d.target
        return d

    def run(self, seconds: float, samples_of, **kw) -> list[Decision]:
        out = []
        for _ in range(round(seconds / self.policy.interval_s)):
            out.append(self.tick(samples_of(self.target), **kw))
        return out


def test_step_up_is_decided_within_the_panic_window_and_names_the_signal():
    sim = Sim()
    steady = sim.run(60, lambda n: load(6, n))
    assert {d.target for d in steady} == {1} and {d.mode for d in steady} == {"stable"}
    step_at = sim.t
    # Five replicas' worth of requests in flight (40 / 8): over panic_threshold x ready.
    after = sim.run(20, lambda n: load(40, n))
    first = next((t, d) for t, d in sim.log if t > step_at and d.target > 1)
    assert first[0] - step_at <= POLICY.panic_window_s
    assert first[1].mode == "panic" and "in_flight" in first[1].reason
    assert after[-1].target == 5


def test_a_rise_below_the_panic_threshold_scales_up_in_stable_mode():
    sim = Sim(target=2)
    sim.run(60, lambda n: load(16, n))
    decisions = sim.run(60, lambda n: load(24, n))  # 3 replicas' worth: 1.5x, under 2x
    assert {d.mode for d in decisions} == {"stable"}
    assert decisions[-1].target == 3 and "scale up 2 -> 3" in next(
        d.reason for d in decisions if d.target == 3
    )


def test_no_scale_down_inside_the_delay():
    policy = dataclasses.replace(POLICY, stable_window_s=10.0, scale_down_delay_s=30.0)
    sim = Sim(policy, target=4)
    sim.run(20, lambda n: load(32, n))
    assert sim.target == 4
    dropped_at = sim.t
    sim.run(80, lambda n: load(0, n))
    first_down = next(t for t, d in sim.log if t > dropped_at and d.target < 4)
    # The stable average takes up to a window to fall, then the delay runs.
    assert first_down - dropped_at >= policy.scale_down_delay_s
    assert all(d.target == 4 for t, d in sim.log if dropped_at < t < dropped_at + policy.scale_down_delay_s)
    assert sim.target == 1
    assert any("deferred" in d.reason for t, d in sim.log if t > dropped_at)


def test_a_fresh_autoscaler_waits_a_full_delay_before_its_first_scale_down():
    # A restarted control plane has no history: it must not shrink a deployment at once.
    policy = dataclasses.replace(POLICY, stable_window_s=6.0, scale_down_delay_s=30.0)
    sim = Sim(policy, target=4)
    started = sim.t
    sim.run(60, lambda n: load(0, n))
    first_down = next(t for t, d in sim.log if d.target < 4)
    assert first_down - started >= policy.scale_down_delay_s
    assert sim.target == 1


def test_a_dip_shorter_than_the_delay_never_removes_capacity():
    policy = dataclasses.replace(POLICY, stable_window_s=6.0, scale_down_delay_s=30.0)
    sim = Sim(policy, target=4)
    for _ in range(3):
        sim.run(40, lambda n: load(32, n))
        sim.run(20, lambda n: load(0, n))  # desire 1 for ~16 s, less than the 30 s delay
    assert {d.target for _, d in sim.log} == {4}


def test_panic_never_scales_down_until_a_stable_window_without_panic():
    sim = Sim()
    sim.run(60, lambda n: load(6, n))
    sim.run(10, lambda n: load(80, n))
    peak = sim.target
    assert peak >= 5
    calm_at = sim.t
    sim.run(30, lambda n: load(6, n))  # far below: panic keeps the peak
    assert all(d.target == peak and d.mode == "panic" for t, d in sim.log if t > calm_at)
    sim.run(200, lambda n: load(6, n))
    assert sim.target == 1 and sim.log[-1][1].mode == "stable"


def test_hold_while_a_step_is_in_flight_then_decide_on_the_target():
    sim = Sim(target=2)
    sim.run(60, lambda n: load(16, n))
    # The deployment was told 3 (a step) and only 2 are ready: hold, even under a burst.
    sim.target = 3
    held = [sim.tick(load(80, 2), in_flight=True, ready=2) for _ in range(5)]
    assert all(d == Decision(3, d.reason, "hold") for d in held)
    assert all("step in flight (ready 2 of target 3)" in d.reason for d in held)
    # The step lands; the burst seen during the hold decides at once, from the TARGET (3).
    d = sim.tick(load(80, 3))
    assert d.mode == "panic" and d.target == 10 and "3 -> 10" in d.reason


def test_decisions_are_on_the_target_count_not_the_ready_count():
    sim = Sim(target=3)
    sim.run(60, lambda n: load(24, n))
    # One replica of three is down and being replaced (the caller does not call it a step):
    # the desire (3) equals the target, so nothing moves, and nothing is "scaled up" to 3.
    d = sim.tick(load(24, 2), ready=2)
    assert d.target == 3 and d.reason.startswith("steady at 3")


def test_clamping():
    sim = Sim(lo=2, hi=4)
    sim.run(60, lambda n: load(0, n))
    assert sim.target == 2  # zero load: min_replicas
    d = sim.tick(load(800, 2))
    assert d.target == 4 and "clamped to 4" in d.reason
    # A target outside a range that changed under it is brought back in, even on a hold.
    sim.target, sim.hi = 7, 4
    d = sim.tick(load(800, 4), in_flight=True, ready=4)
    assert d.target == 4 and d.mode == "hold" and "clamped to max_replicas 4" in d.reason


@pytest.mark.parametrize(
    ("samples", "signal", "target"),
    [
        (load(10, 2, waiting_share=1.0), "waiting", 5),  # 10 waiting / 2: 5; in flight 10 / 8: 2
        (load(4, 3, kv=0.9), "kv_usage", 4),  # 2.7 / 0.8: 4; in flight 4 / 8: 1
        (load(30, 3, waiting_share=0.1), "in_flight", 4),  # 30 / 8: 4; waiting 3 / 2: 2
    ],
)
def test_the_reason_names_the_signal_that_drove_the_decision(samples, signal, target):
    sim = Sim(target=1)
    for _ in range(30):
        d = sim.tick(samples)
    assert d.target == target
    driving = d.reason.split(": ", 1)[1]
    assert driving.startswith(signal + " ")


def test_no_metrics_holds():
    scaler = Autoscaler(POLICY, clock=lambda: 0.0)
    d = scaler.decide(current_target=2, ready=2, min_replicas=1, max_replicas=4, step_in_flight=False)
    assert d == Decision(2, "hold: no metrics observed in the window", "hold")


def test_invalid_inputs_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="panic_window_s"):
        Autoscaler(dataclasses.replace(POLICY, panic_window_s=120.0))
    with pytest.raises(ValueError, match="target_waiting"):
        Autoscaler(dataclasses.replace(POLICY, target_waiting=0))
    with pytest.raises(ValueError, match="panic_threshold"):
        Autoscaler(dataclasses.replace(POLICY, panic_threshold=0.5))
    with pytest.raises(ValueError, match="waiting"):
        ReplicaMetrics(waiting=float("nan"), running=0, kv_usage=0)
    with pytest.raises(ValueError, match="kv_usage"):
        ReplicaMetrics(waiting=0, running=0, kv_usage=3.0)
    scaler = Autoscaler(POLICY)
    with pytest.raises(ValueError, match="max_replicas"):
        scaler.decide(current_target=1, ready=1, min_replicas=3, max_replicas=2, step_in_flight=False)
    with pytest.raises(ValueError, match="current_target"):
        scaler.decide(current_target=-1, ready=1, min_replicas=1, max_replicas=2, step_in_flight=False)


policies = st.builds(
    lambda stable, panic_frac, thr, delay, tw, tk, ti: AutoscalePolicy(
        enabled=True,
        target_waiting=tw,
        target_kv_usage=tk,
        target_in_flight=ti,
        stable_window_s=stable,
        panic_window_s=max(0.1, stable * panic_frac),
        panic_threshold=thr,
        scale_down_delay_s=delay,
        interval_s=1.0,
    ),
    st.floats(1, 120),
    st.floats(0.01, 1),
    st.floats(1, 5),
    st.floats(0, 60),
    st.floats(0.1, 10),
    st.floats(0.05, 1),
    st.floats(0.1, 20),
)
steps = st.lists(
    st.tuples(
        st.floats(0, 10),  # seconds since the previous step
        st.lists(
            st.builds(ReplicaMetrics, st.floats(0, 1e4), st.floats(0, 1e4), st.floats(0, 1)), max_size=6
        ),
        st.integers(0, 30),  # current_target
        st.integers(0, 30),  # ready
        st.booleans(),  # step in flight
        st.integers(0, 8),  # min_replicas
        st.integers(0, 12),  # max_replicas - max(min, 1)
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(policies, steps)
def test_the_target_is_always_within_min_and_max(policy, script):
    now = 0.0
    scaler = Autoscaler(policy, clock=lambda: now)
    for dt, samples, current, ready, in_flight, lo, extra in script:
        now += dt
        hi = max(lo, 1) + extra
        scaler.observe(samples)
        d = scaler.decide(
            current_target=current, ready=ready, min_replicas=lo, max_replicas=hi, step_in_flight=in_flight
        )
        assert lo <= d.target <= hi
        assert d.mode in ("stable", "panic", "hold") and d.reason
        if in_flight:
            assert d.target == min(max(current, lo), hi)


METRICS = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="a"} 3.0
vllm:num_requests_waiting{engine="1",model_name="a"} 1.0
vllm:num_requests_waiting{engine="0",model_name="b"} 50.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 2.0
vllm:num_requests_running{engine="1",model_name="a"} 2.0
vllm:num_requests_running{engine="0",model_name="b"} 9.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.25
vllm:kv_cache_usage_perc{engine="0",model_name="b"} 1.0
"""


def test_parse_metrics_sums_engines_and_filters_by_model():
    assert parse_metrics(METRICS, model_id="a") == ReplicaMetrics(waiting=4.0, running=4.0, kv_usage=0.375)
    assert parse_metrics(METRICS) == ReplicaMetrics(waiting=54.0, running=13.0, kv_usage=1.75 / 3)
    with pytest.raises(ScrapeError, match="model_name='c'"):
        parse_metrics(METRICS, model_id="c")
    with pytest.raises(ScrapeError, match="vllm:kv_cache_usage_perc"):
        parse_metrics(METRICS.split("# TYPE vllm:kv")[0])


ADMISSION = """# HELP paved_queued_sequences Sequences admitted and not yet finished, per model.
# TYPE paved_queued_sequences gauge
paved_queued_sequences{model="a"} 8.0
paved_queued_sequences{model="b"} 2.0
# HELP paved_max_queued_sequences Admission bound per model (beyond it: 503).
# TYPE paved_max_queued_sequences gauge
paved_max_queued_sequences{model="a"} 8.0
paved_max_queued_sequences{model="b"} 64.0
# HELP vllm:time_to_first_token_seconds a histogram the parse skips
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="a"} 3.0
"""


def test_parse_metrics_reads_the_frontends_admission_bound():
    a = parse_metrics(METRICS + ADMISSION, model_id="a")
    assert (a.queued, a.max_queued, a.full) == (8.0, 8.0, True)
    b = parse_metrics(METRICS + ADMISSION, model_id="b")
    assert (b.queued, b.max_queued, b.full) == (2.0, 64.0, False)
    # Not a paved frontend (or only half the pair): no bound, so never full.
    bare = parse_metrics(METRICS, model_id="a")
    assert (bare.queued, bare.max_queued, bare.full) == (None, None, False)
    half = parse_metrics(METRICS + ADMISSION.split("# HELP paved_max")[0], model_id="a")
    assert (half.queued, half.max_queued, half.full) == (None, None, False)
    with pytest.raises(ValueError, match="go together"):
        ReplicaMetrics(waiting=0, running=0, kv_usage=0, queued=1)
    # A malformed sample of a family read here is an error; one of another family is not read.
    with pytest.raises(ScrapeError, match="unparsable"):
        parse_metrics(METRICS + 'vllm:num_requests_waiting{model_name="a"} lots\n')
    assert parse_metrics(METRICS + "vllm:other_family{ garbage\n", model_id="a") == bare


@pytest.fixture(scope="module")
def frontend():
    # One sequence at a time, two tokens a second: requests queue and stay queued.
    server = ServerProcess("--engine", "sim://tiny?tokens_per_s=2&max_num_seqs=1", ready_timeout_s=120)
    try:
        yield server
    finally:
        server.terminate()


def test_scrape_reads_a_real_frontends_gauges_under_load(frontend):
    async def run() -> tuple[ReplicaMetrics, ReplicaMetrics]:
        idle = await scrape(frontend.url + "/metrics", model_id="tiny")
        async with httpx.AsyncClient(timeout=30) as client:

            async def one() -> None:
                body = {
                    "model": "tiny",
                    "prompt": "hello",
                    "max_tokens": 400,
                    "ignore_eos": True,
                    "stream": True,
                }
                async with client.stream("POST", frontend.url + "/v1/completions", json=body) as response:
                    async for _ in response.aiter_bytes():
                        pass

            tasks = [asyncio.create_task(one()) for _ in range(3)]
            try:
                busy = idle
                for _ in range(200):  # bounded: the three requests are admitted in well under this
                    busy = await scrape(frontend.url + "/metrics", model_id="tiny")
                    if busy.running == 1 and busy.waiting == 2:
                        break
                    await asyncio.sleep(0.05)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return idle, busy

    idle, busy = asyncio.run(run())
    # The engine's gauges and the frontend's admission (its default bound, 1024 sequences).
    assert idle == ReplicaMetrics(waiting=0.0, running=0.0, kv_usage=0.0, queued=0.0, max_queued=1024.0)
    assert (busy.running, busy.waiting, busy.queued) == (1.0, 2.0, 3.0)
    assert not busy.full
    assert 0 < busy.kv_usage <= 1


def test_scrape_errors_are_clear(frontend):
    with pytest.raises(ScrapeError, match="model_name='other'"):
        asyncio.run(scrape(frontend.url + "/metrics", model_id="other"))
    with pytest.raises(ScrapeError, match="HTTP 404"):
        asyncio.run(scrape(frontend.url + "/no-such-path"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(ScrapeError, match=rf"127\.0\.0\.1:{closed}"):
            asyncio.run(scrape(f"http://127.0.0.1:{closed}/metrics", timeout_s=2))
    with pytest.raises(ValueError, match="http"):
        asyncio.run(scrape("ftp://127.0.0.1/metrics"))


def test_scrape_reads_a_metrics_page_that_arrives_in_pieces():
    """A /metrics page bigger than what has arrived at the first read (other families first,
    vLLM's gauges at its end): one read() answered one chunk, and the gauges read as missing."""
    import time
    from http.server import BaseHTTPRequestHandler

    from paved.testing.http_stub import LoopbackHTTPServer

    filler = "".join(f'other_metric_total{{i="{i}"}} {i}\n' for i in range(12000)).encode()
    gauges = (
        b'vllm:num_requests_running{model_name="m"} 3\n'
        b'vllm:num_requests_waiting{model_name="m"} 5\n'
        b'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
    )
    page = filler + gauges

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page[:65536])
            self.wfile.flush()
            time.sleep(0.2)  # the rest arrives after the first read has returned
            self.wfile.write(page[65536:])

        def log_message(self, *args):
            pass

    server = LoopbackHTTPServer(Metrics)
    try:
        got = asyncio.run(scrape(server.url + "/metrics", model_id="m"))
    finally:
        server.close()
    assert len(page) > 300_000
    assert (got.running, got.waiting, got.kv_usage) == (3, 5, 0.25)

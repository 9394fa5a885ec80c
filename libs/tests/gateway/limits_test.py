"""InProcessLimiter: requests/min, tokens/min and concurrency per key and per tenant, all or
nothing, reconciliation, idempotent finish, headers. Time is an injected clock, so refill is
tested by moving it, never by sleeping."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paved.gateway.access.limits import (
    InProcessLimiter,
    RedisLimiter,
    Reservation,
    format_duration,
    make_limiter,
)
from paved.gateway.errors import GatewayError, RateLimitedError
from paved.gateway.types import Limits, Principal, Tenant


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def principal(key: Limits | None = None, tenant: Limits | None = None, key_id: str = "k1") -> Principal:
    return Principal(
        key_id, "name", Tenant("t1", "Tenant", limits=tenant or Limits()), key_limits=key or Limits()
    )


def run(coro):
    return asyncio.run(coro)


def limiter() -> tuple[InProcessLimiter, Clock]:
    clock = Clock()
    return InProcessLimiter(clock=clock), clock


def refused(lim: InProcessLimiter, p: Principal, tokens: int) -> RateLimitedError:
    with pytest.raises(RateLimitedError) as info:
        run(lim.acquire(p, tokens))
    return info.value


# ---- requests/min ---------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["key", "tenant"])
def test_requests_per_min_bucket_refills_continuously(side):
    lim, clock = limiter()
    limits = Limits(requests_per_min=3)
    p = principal(key=limits) if side == "key" else principal(tenant=limits)
    for _ in range(3):
        run(lim.acquire(p, 0))
    err = refused(lim, p, 0)
    assert err.status == 429 and err.code == "rate_limit_exceeded"
    assert f"{side} '{'k1' if side == 'key' else 'Tenant'}'" in err.message  # its name, not its id
    assert "requests per minute" in err.message
    # 3/min refills one request every 20 s.
    assert err.headers["Retry-After"] == "20"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    clock.now += 19.9
    refused(lim, p, 0)
    clock.now += 0.1
    run(lim.acquire(p, 0))
    refused(lim, p, 0)


# ---- tokens/min -----------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["key", "tenant"])
def test_tokens_per_min_bucket(side):
    lim, clock = limiter()
    limits = Limits(tokens_per_min=600)  # 10 tokens/s
    p = principal(key=limits) if side == "key" else principal(tenant=limits)
    run(lim.acquire(p, 500))
    err = refused(lim, p, 200)
    assert "tokens per minute" in err.message and "remaining 100" in err.message
    assert err.retry_after_s == pytest.approx(10.0)
    run(lim.acquire(p, 100))  # exactly what is left
    clock.now += 5
    refused(lim, p, 51)
    run(lim.acquire(p, 50))


def test_oversize_request_is_refused_without_retry_after():
    lim, _ = limiter()
    p = principal(key=Limits(tokens_per_min=1000), tenant=Limits(tokens_per_min=100))
    with pytest.raises(GatewayError) as info:
        run(lim.acquire(p, 101))
    err = info.value
    assert not isinstance(err, RateLimitedError)
    assert err.status == 429 and err.code == "tokens_exceed_limit"
    assert "Retry-After" not in err.headers
    assert "tenant 'Tenant'" in err.message and "max_tokens" in err.message
    # Nothing was taken: the full capacity is still there.
    run(lim.acquire(p, 100))


def test_zero_limits_admit_nothing():
    lim, _ = limiter()
    assert refused(lim, principal(key=Limits(requests_per_min=0)), 0).headers["Retry-After"] == "60"
    assert refused(lim, principal(tenant=Limits(max_concurrent=0)), 0).headers["Retry-After"] == "60"
    # tokens/min 0 admits a request needing no tokens, and refuses any other as oversize.
    p = principal(key=Limits(tokens_per_min=0))
    run(lim.acquire(p, 0))
    with pytest.raises(GatewayError) as info:
        run(lim.acquire(p, 1))
    assert info.value.code == "tokens_exceed_limit"


# ---- tokens only (the gateway's own calls on a request's behalf) ---------------------------------
def test_tokens_only_takes_tokens_but_no_request_or_slot():
    lim, _ = limiter()
    p = principal(
        key=Limits(tokens_per_min=1000),
        tenant=Limits(requests_per_min=1, tokens_per_min=600, max_concurrent=1),
    )
    held = run(lim.acquire(p, 100))  # the request: its one request/min and its one slot
    # A summary for it still runs, and is charged to both subjects' tokens/min.
    summary = run(lim.acquire(p, 300, tokens_only=True))
    snap = run(lim.snapshot(p))
    assert snap["key"]["tokens_per_min"]["remaining"] == 600
    assert snap["tenant"]["tokens_per_min"]["remaining"] == 200
    assert snap["tenant"]["requests_per_min"]["remaining"] == 0
    assert snap["tenant"]["max_concurrent"]["in_use"] == 1
    run(lim.finish(summary, 250))  # settled with the call's reported usage
    assert run(lim.snapshot(p))["tenant"]["tokens_per_min"]["remaining"] == 250
    # Refused all-or-nothing on tokens like any request; oversize is tokens_exceed_limit.
    err = refused_tokens_only(lim, p, 251)
    assert "tenant 'Tenant'" in err.message and "remaining 250" in err.message
    with pytest.raises(GatewayError) as info:
        run(lim.acquire(p, 601, tokens_only=True))
    assert info.value.code == "tokens_exceed_limit"
    run(lim.finish(held, 100))
    assert run(lim.snapshot(p))["key"]["tokens_per_min"]["remaining"] == 650


def refused_tokens_only(lim: InProcessLimiter, p: Principal, tokens: int) -> RateLimitedError:
    with pytest.raises(RateLimitedError) as info:
        run(lim.acquire(p, tokens, tokens_only=True))
    return info.value


def test_tokens_only_without_a_tokens_limit_touches_nothing():
    lim, _ = limiter()
    p = principal(tenant=Limits(requests_per_min=1, max_concurrent=1))
    for _ in range(3):
        r = run(lim.acquire(p, 10, tokens_only=True))
        assert r.headers == {}
        run(lim.finish(r, 10))
    run(lim.acquire(p, 0))  # the request/min is still there


# ---- concurrency ----------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["key", "tenant"])
def test_concurrency_slots_free_on_finish(side):
    lim, _ = limiter()
    limits = Limits(max_concurrent=2)
    p = principal(key=limits) if side == "key" else principal(tenant=limits)
    a = run(lim.acquire(p, 0))
    run(lim.acquire(p, 0))
    err = refused(lim, p, 0)
    assert "concurrent requests" in err.message and "2 of 2" in err.message
    run(lim.finish(a, 0))
    run(lim.acquire(p, 0))
    refused(lim, p, 0)


def test_concurrency_lease_expires():
    clock = Clock()
    lim = InProcessLimiter(clock=clock, lease_s=30)
    p = principal(key=Limits(max_concurrent=1, tokens_per_min=6000))  # 100 tokens/s
    lost = run(lim.acquire(p, 5000))
    refused(lim, p, 0)
    clock.now += 30  # the request never finished: its slot frees itself
    run(lim.acquire(p, 0))
    # A finish after the lease is a no-op: the reserved tokens stay charged.
    before = run(lim.snapshot(p))["key"]["tokens_per_min"]["remaining"]
    run(lim.finish(lost, None))
    assert run(lim.snapshot(p))["key"]["tokens_per_min"]["remaining"] == before


# ---- all or nothing -------------------------------------------------------------------------------
def test_refusal_by_tenant_takes_nothing_from_key():
    lim, _ = limiter()
    p = principal(
        key=Limits(requests_per_min=10, tokens_per_min=1000, max_concurrent=5),
        tenant=Limits(tokens_per_min=100),
    )
    run(lim.acquire(p, 100))
    for _ in range(5):
        err = refused(lim, p, 50)
        assert "tenant 'Tenant'" in err.message and "key 'k1'" not in err.message
    snap = run(lim.snapshot(p))["key"]
    assert snap["requests_per_min"]["remaining"] == 9
    assert snap["tokens_per_min"]["remaining"] == 900
    assert snap["max_concurrent"]["in_use"] == 1


def test_refusal_by_key_takes_nothing_from_tenant():
    lim, _ = limiter()
    p = principal(key=Limits(max_concurrent=1), tenant=Limits(requests_per_min=10, tokens_per_min=100))
    run(lim.acquire(p, 10))
    refused(lim, p, 10)
    snap = run(lim.snapshot(p))["tenant"]
    assert snap["requests_per_min"]["remaining"] == 9
    assert snap["tokens_per_min"]["remaining"] == 90


def test_both_subjects_charged_and_other_keys_share_the_tenant():
    lim, _ = limiter()
    tenant = Limits(tokens_per_min=100)
    run(lim.acquire(principal(key=Limits(tokens_per_min=80), tenant=tenant, key_id="a"), 60))
    # Key b has its own key bucket but the same tenant: 40 left there.
    b = principal(key=Limits(tokens_per_min=80), tenant=tenant, key_id="b")
    err = refused(lim, b, 50)
    assert "tenant 'Tenant'" in err.message
    run(lim.acquire(b, 40))


# ---- finish ---------------------------------------------------------------------------------------
def test_finish_refunds_unused_tokens_once():
    lim, _ = limiter()
    p = principal(key=Limits(tokens_per_min=100, max_concurrent=1))
    res = run(lim.acquire(p, 100))
    run(lim.finish(res, 30))
    run(lim.finish(res, 30))  # a second finish is a no-op
    run(lim.finish(res, None))
    assert run(lim.snapshot(p))["key"]["tokens_per_min"]["remaining"] == 70
    assert run(lim.snapshot(p))["key"]["max_concurrent"]["in_use"] == 0


def test_finish_on_a_copy_of_the_reservation_counts_once():
    lim, _ = limiter()
    p = principal(key=Limits(tokens_per_min=100))
    res = run(lim.acquire(p, 100))
    copy = Reservation(res.id, res.tokens, res.headers, _held=res._held)
    run(lim.finish(res, 70))
    run(lim.finish(copy, 70))
    assert run(lim.snapshot(p))["key"]["tokens_per_min"]["remaining"] == 30


def test_finish_none_refunds_everything():
    lim, _ = limiter()
    p = principal(key=Limits(tokens_per_min=100), tenant=Limits(tokens_per_min=200))
    res = run(lim.acquire(p, 100))
    run(lim.finish(res, None))
    snap = run(lim.snapshot(p))
    assert snap["key"]["tokens_per_min"]["remaining"] == 100
    assert snap["tenant"]["tokens_per_min"]["remaining"] == 200


def test_finish_charges_extra_usage_into_debt():
    lim, clock = limiter()
    p = principal(key=Limits(tokens_per_min=60))  # 1 token/s
    res = run(lim.acquire(p, 50))
    run(lim.finish(res, 80))  # 30 more than reserved: level 60 - 80 = -20
    assert run(lim.snapshot(p))["key"]["tokens_per_min"]["remaining"] == 0
    err = refused(lim, p, 1)
    assert err.retry_after_s == pytest.approx(21.0)
    clock.now += 21
    run(lim.acquire(p, 1))


def test_refund_never_fills_beyond_capacity():
    lim, clock = limiter()
    p = principal(key=Limits(tokens_per_min=60))
    res = run(lim.acquire(p, 60))
    clock.now += 60  # refilled meanwhile
    run(lim.finish(res, 0))
    assert run(lim.snapshot(p))["key"]["tokens_per_min"]["remaining"] == 60
    run(lim.acquire(p, 60))
    refused(lim, p, 1)


def test_invalid_inputs_are_clear_errors():
    lim, _ = limiter()
    p = principal(key=Limits(tokens_per_min=10))
    for bad in (-1, 1.5, True, "3", None):
        with pytest.raises(ValueError, match="tokens must be an int"):
            run(lim.acquire(p, bad))  # type: ignore[arg-type]
    res = run(lim.acquire(p, 1))
    with pytest.raises(ValueError, match="used_tokens"):
        run(lim.finish(res, -3))
    with pytest.raises(ValueError, match="lease_s"):
        InProcessLimiter(lease_s=0)


# ---- unlimited ------------------------------------------------------------------------------------
def test_unlimited_principal_has_no_headers_and_finish_is_free():
    lim, _ = limiter()
    res = run(lim.acquire(principal(), 10**9))
    assert res.headers == {} and res.tokens == 10**9
    run(lim.finish(res, 5))
    assert run(lim.snapshot(principal())) == {"key": {"id": "k1"}, "tenant": {"id": "t1"}}


def test_unlimited_principal_never_touches_redis():
    # Port 1 on loopback refuses connections: any round trip would be a 503.
    lim = RedisLimiter("redis://127.0.0.1:1/0", timeout_s=0.2)

    async def go():
        res = await lim.acquire(principal(), 100)
        await lim.finish(res, 100)
        await lim.close()
        return res

    assert run(go()).headers == {}


def test_make_limiter():
    assert isinstance(make_limiter(None), InProcessLimiter)
    assert isinstance(make_limiter(""), InProcessLimiter)
    assert isinstance(make_limiter("redis://127.0.0.1:6379/0"), RedisLimiter)
    with pytest.raises(ValueError, match="redis://"):
        make_limiter("http://127.0.0.1:6379")


# ---- headers --------------------------------------------------------------------------------------
def test_headers_report_the_tighter_subject_and_omit_unlimited_kinds():
    lim, _ = limiter()
    p = principal(key=Limits(requests_per_min=10, tokens_per_min=600), tenant=Limits(tokens_per_min=6000))
    res = run(lim.acquire(p, 300))
    assert res.headers == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "6s",
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "300",
        "x-ratelimit-reset-tokens": "30s",
    }
    # The tenant is tighter on tokens when it has fewer left than the key (300 < 500).
    q = principal(key=Limits(tokens_per_min=600), tenant=Limits(tokens_per_min=400), key_id="k2")
    res = run(lim.acquire(q, 100))
    assert res.headers["x-ratelimit-limit-tokens"] == "400"
    assert res.headers["x-ratelimit-remaining-tokens"] == "300"
    assert "x-ratelimit-limit-requests" not in res.headers


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (-1, "0s"), (0.25, "250ms"), (0.0001, "1ms"), (1, "1s"), (1.2, "2s"), (59, "59s"),
     (60, "1m0s"), (360, "6m0s"), (3723, "1h2m3s")],
)  # fmt: skip
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


# ---- property: never over the bound -----------------------------------------------------------
ops = st.lists(
    st.one_of(
        # Small amounts hit the buckets' exact edges often; large ones the oversize refusal.
        st.tuples(st.just("acquire"), st.one_of(st.integers(0, 6), st.integers(0, 120))),
        st.tuples(st.just("finish"), st.integers(0, 50), st.one_of(st.none(), st.integers(0, 200))),
        st.tuples(st.just("wait"), st.floats(0, 30)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, tpm=st.integers(1, 40), conc=st.integers(1, 4), rpm=st.integers(1, 20))
def test_property_admitted_within_bucket_bound(ops, tpm, conc, rpm):
    """Net admitted tokens (reserved minus refunds) never exceed capacity + rate * elapsed,
    admitted requests never exceed rpm + rpm/60 * elapsed, live slots never exceed the limit."""
    clock = Clock()
    lim = InProcessLimiter(clock=clock)
    p = principal(key=Limits(tokens_per_min=tpm, max_concurrent=conc), tenant=Limits(requests_per_min=rpm))
    start = clock.now
    live: list[Reservation] = []
    net_tokens = 0
    requests = 0

    async def go():
        nonlocal net_tokens, requests
        for op in ops:
            if op[0] == "acquire":
                try:
                    res = await lim.acquire(p, op[1])
                except GatewayError:
                    continue
                live.append(res)
                net_tokens += res.tokens
                requests += 1
            elif op[0] == "finish" and live:
                res = live.pop(op[1] % len(live))
                await lim.finish(res, op[2])
                used = op[2]
                net_tokens -= res.tokens if used is None else max(0, res.tokens - used)
            elif op[0] == "wait":
                clock.now += op[1]
            elapsed = clock.now - start
            assert net_tokens <= tpm + tpm / 60 * elapsed + 1e-6
            assert requests <= rpm + rpm / 60 * elapsed + 1e-6
            assert len(live) <= conc

    run(go())

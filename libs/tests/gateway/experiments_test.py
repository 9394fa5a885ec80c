"""A/B experiments (paved.gateway.experiments): validation, assignment, the recorder, feedback,
results and the HTTP routes, on SQLite and on a real PostgreSQL 15.

Covers: every 400 (naming the field), 404 and 409 of the registry; the one-running-per-alias
rule under concurrent creates from two replicas; the running_for cache over an injected clock
(at most one read per cache_s, shared by concurrent callers, the last snapshot kept while the
store is down); assignment deterministic, identical across replicas, equal to the documented
hash, split within 4 binomial sigma over 1,000 users (50/50, 90/10, 1/2/7), independent across
salts; the interval functions against published and independently computed values; Welford/Chan
moments against a direct computation (including a large offset that sums of squares lose);
two recorders on one database (= two replicas) adding up, a failed flush kept for the next,
bounded pending ids, bad samples ignored; feedback (before a flush, from another replica,
duplicate and concurrent 409, another tenant's and unknown 404 alike, expired, bad ratings);
results' numbers against a direct computation over the recorded samples; the admin and feedback
routes over httpx's ASGI transport (401 before the body is read, 400/404/409 bodies).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import random
import statistics
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from paved.gateway.access.auth import AdminAuth, Authenticator
from paved.gateway.access.state import GatewayStore
from paved.gateway.errors import GatewayError
from paved.gateway.experiments import experiments as ex
from paved.gateway.experiments.experiments import (
    Arm,
    Experiment,
    ExperimentRecorder,
    ExperimentRegistry,
    Moments,
    assign,
    experiments_router,
    feedback_router,
    mean_interval,
    newcombe_interval,
    t_cdf,
    t_quantile,
    unit_key,
    welch_interval,
    wilson_interval,
)
from paved.http.errors import error_body, validation_message
from paved.testing.postgres import create_database, postgres_server

ADMIN_KEY = "pvd_admin_test-key"
TWO_ARMS = [{"name": "a", "weight": 50}, {"name": "b", "weight": 50, "version": "v2"}]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'gw.db'}"


async def _store(url: str) -> GatewayStore:
    store = GatewayStore(url)
    await store.start()
    return store


def _raises(status: int, coro_fn, *args, **kwargs) -> GatewayError:
    """Await coro_fn(*args, **kwargs) expecting GatewayError(status); returns it."""

    async def go():
        with pytest.raises(GatewayError) as err:
            await coro_fn(*args, **kwargs)
        return err.value

    return go()


def _fixed_experiment(weights: list[float], salt: str, name: str = "exp") -> Experiment:
    return Experiment(
        name=name,
        model="llama",
        arms=tuple(Arm(name=f"arm{i}", weight=w) for i, w in enumerate(weights)),
        unit="user",
        tenants=("*",),
        status="running",
        salt=salt,
        created_at=datetime.now(UTC),
    )


# -- statistics against known values ----------------------------------------------------------


# Student's t 0.975 quantiles: the classic table (1..30, 100), and for real df (Welch) values
# from an independent implementation (scipy.stats.t.ppf).
@pytest.mark.parametrize(
    ("df", "expected"),
    [
        (1, 12.706204736174694),
        (2, 4.302652729749462),
        (3, 3.1824463052837078),
        (5, 2.5705818356363146),
        (10, 2.228138851986274),
        (29, 2.045229642132703),
        (30, 2.0422724563012378),
        (100, 1.9839715185235518),
        (1000, 1.9623390808264083),
        (2.5, 3.5746548420036817),
        (7.3, 2.345066736547703),
        (1e6, 1.959966356814107),
        (1e9, 1.959963986912325),
    ],
)
def test_t_quantile_matches_the_table(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, rel=1e-10)
    assert t_cdf(expected, df) == pytest.approx(0.975, abs=1e-9)
    assert t_cdf(-expected, df) == pytest.approx(0.025, abs=1e-9)


def test_t_quantile_other_levels_and_bad_arguments():
    # 0.95 quantiles of the table: 6.3138 (1), 1.8125 (10), 1.6449 (normal).
    assert t_quantile(0.95, 1) == pytest.approx(6.313751514675, rel=1e-9)
    assert t_quantile(0.95, 10) == pytest.approx(1.812461122811, rel=1e-9)
    assert t_quantile(0.5, 4) == 0.0
    for p, df in [(0.4, 5), (1.0, 5), (0.975, 0.5), (0.975, math.nan)]:
        with pytest.raises(ValueError):
            t_quantile(p, df)


# Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I, the
# score method (Wilson), to 4 decimals.
@pytest.mark.parametrize(
    ("x", "n", "lo", "hi"),
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)],
)
def test_wilson_interval_matches_newcombe(x, n, lo, hi):
    got = wilson_interval(x, n)
    assert got is not None
    assert round(got[0], 4) == lo and round(got[1], 4) == hi


def test_wilson_interval_edges():
    z2 = ex.Z95**2
    # 0 of n: exactly [0, z^2 / (n + z^2)]; n of n mirrors it.
    assert wilson_interval(0, 10) == (0.0, pytest.approx(z2 / (10 + z2), rel=1e-12))
    lo, hi = wilson_interval(10, 10)  # type: ignore[misc]
    assert hi == 1.0 and lo == pytest.approx(10 / (10 + z2), rel=1e-12)
    assert wilson_interval(0, 0) is None
    for x in range(0, 51):
        lo, hi = wilson_interval(x, 50)  # type: ignore[misc]
        assert 0.0 <= lo <= x / 50 <= hi <= 1.0


# Newcombe (1998), "Interval estimation for the difference between independent proportions",
# Table II, method 10 (hybrid score), to 4 decimals.
@pytest.mark.parametrize(
    ("x1", "n1", "x2", "n2", "lo", "hi"),
    [
        (56, 70, 48, 80, 0.0524, 0.3339),
        (9, 10, 3, 10, 0.1705, 0.8090),
        (6, 7, 2, 7, 0.0582, 0.8062),
        (5, 56, 0, 29, -0.0381, 0.1926),
    ],
)
def test_newcombe_difference_matches_the_paper(x1, n1, x2, n2, lo, hi):
    d, got_lo, got_hi = newcombe_interval(x1, n1, x2, n2)  # type: ignore[misc]
    assert d == pytest.approx(x1 / n1 - x2 / n2)
    assert round(got_lo, 4) == lo and round(got_hi, 4) == hi
    assert newcombe_interval(1, 0, 1, 2) is None


_A = [12.1, 14.3, 11.8, 15.2, 13.9, 12.7, 14.8]
_B = [16.4, 15.9, 17.8, 14.6, 18.3, 16.2, 17.1, 15.5, 19.0]


def _moments(xs) -> Moments:
    m = Moments()
    for x in xs:
        m.add(x)
    return m


def test_mean_and_welch_intervals_match_an_independent_implementation():
    # Reference values: scipy.stats.t.interval(0.95, 6, mean, sem) and
    # scipy.stats.ttest_ind(B, A, equal_var=False).confidence_interval() (df 13.3543).
    lo, hi = mean_interval(_moments(_A))  # type: ignore[misc]
    assert lo == pytest.approx(12.298768128071538, rel=1e-10)
    assert hi == pytest.approx(14.78694615764275, rel=1e-10)
    d, lo, hi = welch_interval(_moments(_B), _moments(_A))  # type: ignore[misc]
    assert d == pytest.approx(3.2126984126984084, rel=1e-10)
    assert lo == pytest.approx(1.71837011851441, rel=1e-9)
    assert hi == pytest.approx(4.707026706882407, rel=1e-9)
    # Too few observations: no interval; equal constant samples: a zero-width one.
    assert mean_interval(_moments([3.0])) is None
    assert welch_interval(_moments([1.0]), _moments(_A)) is None
    assert welch_interval(_moments([2.0, 2.0]), _moments([1.0, 1.0])) == (1.0, 1.0, 1.0)


def test_moments_merge_equals_one_pass_and_survives_a_large_offset():
    rng = random.Random(7)
    xs = [rng.lognormvariate(0, 1) for _ in range(1000)]
    parts = [Moments() for _ in range(7)]
    for x in xs:
        parts[rng.randrange(7)].add(x)
    merged = Moments()
    for p in rng.sample(parts, len(parts)):
        merged.merge(p)
    assert merged.n == 1000
    assert merged.mean == pytest.approx(statistics.fmean(xs), rel=1e-12)
    assert merged.variance == pytest.approx(statistics.variance(xs), rel=1e-10)
    # 1e9 + small noise: sum-of-squares would cancel to garbage (1e18 vs a variance of ~1).
    offset = [1e9 + x for x in xs]
    m = _moments(offset)
    assert m.variance == pytest.approx(statistics.variance(xs), rel=1e-6)
    assert Moments(1, 5.0, 0.0).variance is None


# -- validation -------------------------------------------------------------------------------


def _arm(**kw: Any) -> dict[str, Any]:
    return {"name": "a", "weight": 1, **kw}


_BAD_CREATES: list[tuple[dict[str, Any], str]] = [
    ({"name": ""}, "name"),
    ({"name": "UPPER"}, "name"),
    ({"name": "a" * 64}, "name"),
    ({"name": 7}, "name"),
    ({"model": ""}, "model"),
    ({"model": "llama@v2"}, "model"),
    ({"model": " llama"}, "model"),
    ({"model": None}, "model"),
    ({"arms": "a,b"}, "arms"),
    ({"arms": [_arm()]}, "arms"),
    ({"arms": [_arm(name=f"a{i}") for i in range(17)]}, "arms"),
    ({"arms": [_arm(), "b"]}, "arms[1]"),
    ({"arms": [_arm(colour="red"), _arm(name="b")]}, "arms[0]"),
    ({"arms": [{"weight": 1}, _arm(name="b")]}, "arms[0].name"),
    ({"arms": [_arm(name="-x"), _arm(name="b")]}, "arms[0].name"),
    ({"arms": [_arm(), _arm()]}, "arms[1].name"),
    ({"arms": [_arm(weight=0), _arm(name="b")]}, "arms[0].weight"),
    ({"arms": [_arm(weight=-1), _arm(name="b")]}, "arms[0].weight"),
    ({"arms": [_arm(weight=math.nan), _arm(name="b")]}, "arms[0].weight"),
    ({"arms": [_arm(weight=math.inf), _arm(name="b")]}, "arms[0].weight"),
    ({"arms": [_arm(weight=True), _arm(name="b")]}, "arms[0].weight"),
    ({"arms": [_arm(weight="1"), _arm(name="b")]}, "arms[0].weight"),
    ({"arms": [_arm(weight=1e10), _arm(name="b")]}, "arms[0].weight"),
    ({"arms": [_arm(version="v 1"), _arm(name="b")]}, "arms[0].version"),
    ({"arms": [_arm(version=""), _arm(name="b")]}, "arms[0].version"),
    ({"arms": [_arm(version=2), _arm(name="b")]}, "arms[0].version"),
    ({"arms": [_arm(template="Bad Name"), _arm(name="b")]}, "arms[0].template"),
    ({"arms": [_arm(template="t@0"), _arm(name="b")]}, "arms[0].template"),
    ({"arms": [_arm(template="t@latest"), _arm(name="b")]}, "arms[0].template"),
    ({"arms": [_arm(), _arm(name="b", params=[1])]}, "arms[1].params"),
    ({"arms": [_arm(), _arm(name="b", params={"logprobs": True})]}, "arms[1].params.logprobs"),
    ({"arms": [_arm(), _arm(name="b", params={"model": "other"})]}, "arms[1].params.model"),
    *(
        ({"arms": [_arm(), _arm(name="b", params={key: value})]}, f"arms[1].params.{key}")
        for key, value in [
            ("temperature", "hot"),
            ("temperature", 2.5),
            ("temperature", -0.1),
            ("temperature", math.nan),
            ("temperature", True),
            ("temperature", None),
            ("top_p", 0),
            ("top_p", 1.5),
            ("presence_penalty", 2.5),
            ("frequency_penalty", -3),
            ("max_tokens", 0),
            ("max_tokens", 1.5),
            ("max_tokens", True),
            ("max_tokens", 2**31),
            ("max_completion_tokens", "10"),
            ("seed", 2**63),
            ("seed", 1.0),
            ("stop", ""),
            ("stop", []),
            ("stop", ["a"] * 5),
            ("stop", [1]),
            ("stop", "x" * 257),
            ("stop", {"a": 1}),
        ]
    ),
    ({"unit": "session"}, "unit"),
    ({"tenants": "acme"}, "tenants"),
    ({"tenants": []}, "tenants"),
    ({"tenants": ["Bad Tenant"]}, "tenants"),
    ({"tenants": [3]}, "tenants"),
    ({"tenants": [f"t{i}" for i in range(1001)]}, "tenants"),
]


@pytest.mark.parametrize(("override", "param"), _BAD_CREATES)
def test_create_refuses_bad_input_naming_the_field(db_url, override, param):
    async def go():
        store = await _store(db_url)
        reg = ExperimentRegistry(store)
        await reg.start()
        kwargs: dict[str, Any] = {"name": "exp", "model": "llama", "arms": TWO_ARMS, **override}
        name, model, arms = kwargs.pop("name"), kwargs.pop("model"), kwargs.pop("arms")
        err = await _raises(400, reg.create, name, model, arms, **kwargs)
        assert err.status == 400 and err.param == param and err.code == "invalid_request"
        assert param.split(".")[-1].split("[")[0] in err.message
        assert await reg.list() == []  # nothing half-written
        await store.close()

    run(go())


def test_create_normalises_and_reads_back_identically(db_url):
    async def go():
        store = await _store(db_url)
        reg = ExperimentRegistry(store)
        await reg.start()
        arms = [
            {"name": "control", "weight": 3},
            {
                "name": "Treat-1",
                "weight": 1.5,
                "version": "v2.1",
                "template": "support@3",
                "params": {
                    "temperature": 0,
                    "top_p": 0.9,
                    "max_tokens": 64,
                    "stop": ["###", "\n\n"],
                    "seed": -5,
                },
            },
            {
                "name": "t2",
                "weight": 0.5,
                "template": "support",
                "params": {"stop": "END", "presence_penalty": -2},
            },
        ]
        exp = await reg.create("exp-1", "meta-llama/Llama-3.1-8B", arms, unit="key", tenants=["acme", "beta"])
        assert exp.status == "running" and exp.unit == "key" and exp.tenants == ("acme", "beta")
        assert [a.weight for a in exp.arms] == [3.0, 1.5, 0.5]
        assert exp.arms[1].params["stop"] == ("###", "\n\n") and exp.arms[2].params["stop"] == "END"
        assert len(exp.salt) == 32 and exp.created_at.tzinfo is not None
        assert exp.control.name == "control" and exp.arm("t2") is exp.arms[2] and exp.arm("zz") is None
        # The stored form is the same experiment, on this replica and on another.
        assert await reg.get("exp-1") == exp
        other = ExperimentRegistry(await _store(db_url))
        assert await other.get("exp-1") == exp
        d = exp.to_dict()
        assert d["arms"][1]["params"]["stop"] == ["###", "\n\n"] and d["tenants"] == ["acme", "beta"]
        assert d["status"] == "running" and d["stopped_at"] is None

        star = await reg.create("exp-2", "qwen", TWO_ARMS, tenants=("acme", "*"))
        assert star.tenants == ("*",) and star.unit == "user"
        assert [e.name for e in await reg.list()] == ["exp-2", "exp-1"]  # newest first
        await store.close()

    run(go())


def test_conflicts_and_not_found(db_url, monkeypatch):
    async def go():
        store = await _store(db_url)
        reg = ExperimentRegistry(store)
        await reg.start()
        first = await reg.create("one", "llama", TWO_ARMS)
        err = await _raises(409, reg.create, "two", "llama", TWO_ARMS)
        assert err.param == "model" and err.code == "experiment_running" and "'one'" in err.message
        err = await _raises(409, reg.create, "one", "qwen", TWO_ARMS)
        assert err.param == "name" and err.code == "experiment_exists"
        await reg.create("other-model", "qwen", TWO_ARMS)

        stopped = await reg.stop("one")
        assert stopped.status == "stopped" and stopped.stopped_at is not None
        again = await reg.stop("one")  # idempotent: the first stop time stays
        assert again.stopped_at == stopped.stopped_at and again.status == "stopped"
        # The alias is free again; the name stays taken.
        second = await reg.create("two", "llama", TWO_ARMS)
        assert second.salt != first.salt
        err = await _raises(409, reg.create, "one", "mistral", TWO_ARMS)
        assert err.param == "name"

        for name in ("ghost", "Bad Name", "x" * 300):
            for fn in (reg.get, reg.stop):
                err = await _raises(404, fn, name)
                assert err.code == "experiment_not_found"
        recorder = ExperimentRecorder(store)
        err = await _raises(404, recorder.results, "ghost")
        assert err.code == "experiment_not_found"

        monkeypatch.setattr(ex, "MAX_RUNNING", 3)  # two are running: one more, then no more
        await reg.create("three", "gemma", TWO_ARMS)
        err = await _raises(409, reg.create, "four", "phi", TWO_ARMS)
        assert err.code == "too_many_experiments"
        await store.close()

    run(go())


def test_two_replicas_creating_on_one_alias_at_once_one_wins(db_url):
    async def go():
        stores = [await _store(db_url) for _ in range(2)]
        regs = [ExperimentRegistry(s) for s in stores]
        for r in regs:
            await r.start()
        for round_ in range(5):
            results = await asyncio.gather(
                *(regs[i % 2].create(f"r{round_}-{i}", "llama", TWO_ARMS) for i in range(6)),
                return_exceptions=True,
            )
            wins = [r for r in results if isinstance(r, Experiment)]
            losses = [r for r in results if isinstance(r, GatewayError)]
            assert len(wins) == 1 and len(losses) == 5, results
            assert all(e.status == 409 and e.param == "model" for e in losses)
            await regs[0].stop(wins[0].name)
        for s in stores:
            await s.close()

    run(go())


# -- running_for and its cache ----------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_running_for_filters_by_tenant_and_alias(db_url):
    async def go():
        store = await _store(db_url)
        reg = ExperimentRegistry(store)
        await reg.start()
        exp = await reg.create("exp", "llama", TWO_ARMS, tenants=["acme"])
        assert await reg.running_for("acme", "llama") == exp  # this replica: at once
        assert await reg.running_for("beta", "llama") is None
        assert await reg.running_for("acme", "qwen") is None
        assert await reg.running_for("acme", "llama@v2") is None
        await reg.stop("exp")
        assert await reg.running_for("acme", "llama") is None
        await store.close()

    run(go())


def test_running_for_reads_at_most_once_per_cache_s_and_sees_other_replicas(db_url):
    async def go():
        clock = FakeClock()
        a_store, b_store = await _store(db_url), await _store(db_url)
        a = ExperimentRegistry(a_store, cache_s=1.0, clock=clock)
        b = ExperimentRegistry(b_store)
        await a.start()
        await b.start()
        reads = a.db_reads
        assert await a.running_for("acme", "llama") is None
        exp = await b.create("exp", "llama", TWO_ARMS)
        # Within cache_s, A answers from its snapshot: 1,000 calls, no read.
        for _ in range(1000):
            assert await a.running_for("acme", "llama") is None
        assert a.db_reads == reads
        clock.now += 1.0
        # Expired: fifty concurrent callers share one read.
        got = await asyncio.gather(*(a.running_for("acme", "llama") for _ in range(50)))
        assert got == [exp] * 50 and a.db_reads == reads + 1
        await b.stop("exp")
        assert await a.running_for("acme", "llama") == exp  # still cached
        clock.now += 1.0
        assert await a.running_for("acme", "llama") is None
        assert a.db_reads == reads + 2
        await a_store.close()
        await b_store.close()

    run(go())


def test_running_for_keeps_the_last_snapshot_while_the_store_is_down(db_url, monkeypatch):
    async def go():
        clock = FakeClock()
        store = await _store(db_url)
        reg = ExperimentRegistry(store, cache_s=0.5, clock=clock)
        await reg.start()
        exp = await reg.create("exp", "llama", TWO_ARMS)

        async def down(*_args):
            raise GatewayError(503, "the gateway's state store is unavailable", code="store_unavailable")

        monkeypatch.setattr(store, "run", down)
        clock.now += 1.0
        assert await reg.running_for("acme", "llama") == exp
        reads = reg.db_reads
        assert await reg.running_for("acme", "llama") == exp  # no retry storm within cache_s
        assert reg.db_reads == reads
        monkeypatch.undo()
        clock.now += 1.0
        assert await reg.running_for("acme", "llama") == exp and reg.db_reads == reads + 1
        await store.close()

    run(go())


def test_registry_start_fails_loudly_when_the_store_is_unreachable(tmp_path):
    async def go():
        store = GatewayStore(f"sqlite:///{tmp_path / 'missing-dir' / 'gw.db'}")
        reg = ExperimentRegistry(store)
        with pytest.raises(Exception):  # noqa: B017 - any failure, as long as start() raises
            await reg.start()

    run(go())


# -- assignment -------------------------------------------------------------------------------


def _reference_assign(exp: Experiment, key: str) -> str:
    """The documented rule, written out independently."""
    digest = hashlib.sha256((exp.salt + "\0" + key).encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    total = sum(a.weight for a in exp.arms)
    edge = 0.0
    for arm in exp.arms:
        edge += arm.weight / total
        if u < edge:
            return arm.name
    return exp.arms[-1].name


def test_assignment_is_the_documented_hash_and_deterministic():
    exp = _fixed_experiment([1, 2, 7], salt="s" * 32)
    for i in range(2000):
        key = f"acme\0user\0u{i}"
        arm = assign(exp, key)
        assert arm.name == _reference_assign(exp, key)
        assert assign(exp, key) is arm
    # Independent of the Experiment object: a copy (as another replica reads it) agrees.
    copy = _fixed_experiment([1, 2, 7], salt="s" * 32)
    assert all(assign(copy, f"k{i}") == assign(exp, f"k{i}") for i in range(500))


@pytest.mark.parametrize("weights", [[50, 50], [90, 10], [1, 2, 7]])
@pytest.mark.parametrize("salt", ["5a1f", "0" * 32, "experiment-salt-3"])
def test_split_over_1000_users_is_within_4_sigma(weights, salt):
    exp = _fixed_experiment(weights, salt=salt)
    n = 1000
    counts = dict.fromkeys((a.name for a in exp.arms), 0)
    for i in range(n):
        counts[assign(exp, unit_key(exp, tenant="acme", key_id="key1", user=f"user-{i}")).name] += 1
    total = sum(weights)
    for arm, w in zip(exp.arms, weights, strict=True):
        p = w / total
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(counts[arm.name] - n * p) <= 4 * sigma, (counts, weights)


def test_experiments_with_different_salts_assign_independently():
    n = 1000
    for seed in range(3):
        e1 = _fixed_experiment([1, 1], salt=f"first-{seed}", name="e1")
        e2 = _fixed_experiment([1, 1], salt=f"second-{seed}", name="e2")
        both = sum(
            1 for i in range(n) if assign(e1, f"u{i}").name == "arm0" and assign(e2, f"u{i}").name == "arm0"
        )
        # Independent halves: both-in-arm0 ~ Binomial(n, 1/4).
        assert abs(both - n / 4) <= 4 * math.sqrt(n * 0.25 * 0.75), both
    # The same salt is the same split: the test above would catch a salt that is ignored.
    same = _fixed_experiment([1, 1], salt="first-0", name="other-name")
    e1 = _fixed_experiment([1, 1], salt="first-0", name="e1")
    assert all(assign(same, f"u{i}").name == assign(e1, f"u{i}").name for i in range(n))


def test_unit_key_sticks_to_the_user_or_the_key():
    by_user = _fixed_experiment([1, 1], salt="x")
    by_key = Experiment(
        name="k", model="llama", arms=by_user.arms, unit="key", tenants=("*",), status="running",
        salt="x", created_at=datetime.now(UTC),
    )  # fmt: skip
    # unit "user": the user field decides, whatever key sends it; no user -> the key id.
    assert unit_key(by_user, tenant="acme", key_id="k1", user="alice") == unit_key(
        by_user, tenant="acme", key_id="k2", user="alice"
    )
    assert unit_key(by_user, tenant="acme", key_id="k1", user=None) == unit_key(
        by_user, tenant="acme", key_id="k1", user=""
    )
    assert unit_key(by_user, tenant="acme", key_id="k1", user=None) != unit_key(
        by_user, tenant="acme", key_id="k2", user=None
    )
    # unit "key": the user is ignored.
    assert unit_key(by_key, tenant="acme", key_id="k1", user="alice") == unit_key(
        by_key, tenant="acme", key_id="k1", user="bob"
    )
    # Users are per tenant.
    assert unit_key(by_user, tenant="acme", key_id="k", user="alice") != unit_key(
        by_user, tenant="beta", key_id="k", user="alice"
    )
    # A user named like a key id is not that key.
    assert unit_key(by_user, tenant="acme", key_id="k", user="k") != unit_key(
        by_user, tenant="acme", key_id="k", user=None
    )


def test_assignment_is_identical_on_two_replicas_reading_the_store(db_url):
    async def go():
        a_store, b_store = await _store(db_url), await _store(db_url)
        a, b = ExperimentRegistry(a_store), ExperimentRegistry(b_store)
        await a.start()
        await a.create("exp", "llama", [{"name": "a", "weight": 90}, {"name": "b", "weight": 10}])
        await b.start()  # reads the running experiments from the store
        ea, eb = await a.running_for("acme", "llama"), await b.running_for("acme", "llama")
        assert ea is not None and eb is not None and ea is not eb
        keys = [unit_key(ea, tenant="acme", key_id="key", user=f"user{i}") for i in range(1000)]
        assert [assign(ea, k).name for k in keys] == [assign(eb, k).name for k in keys]
        await a_store.close()
        await b_store.close()

    run(go())


# -- the recorder -----------------------------------------------------------------------------


def _sample(rng: random.Random) -> dict[str, Any]:
    error = rng.random() < 0.1
    return {
        "latency_s": rng.lognormvariate(-1.0, 0.5),
        "prompt_tokens": rng.randint(5, 400),
        "completion_tokens": None if error else rng.randint(1, 200),
        "error": error,
    }


def _t_interval(xs: list[float]) -> list[float] | None:
    if len(xs) < 2:
        return None
    half = t_quantile(0.975, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    m = statistics.fmean(xs)
    return [m - half, m + half]


def _welch(xs: list[float], ys: list[float]) -> list[float]:
    """Welch's interval of mean(xs) - mean(ys), computed from the raw samples."""
    vx, vy = statistics.variance(xs) / len(xs), statistics.variance(ys) / len(ys)
    df = (vx + vy) ** 2 / (vx**2 / (len(xs) - 1) + vy**2 / (len(ys) - 1))
    d = statistics.fmean(xs) - statistics.fmean(ys)
    half = t_quantile(0.975, df) * math.sqrt(vx + vy)
    return [d, d - half, d + half]


def _check_results(
    results: dict[str, Any], samples: dict[str, list[dict[str, Any]]], ratings: dict[str, list[float]]
):
    """Every number of `results` against a direct computation over the recorded samples."""
    arms = {a["name"]: a for a in results["arms"]}
    assert set(arms) == set(samples)
    raw: dict[str, dict[str, list[float]]] = {}
    for name, recorded in samples.items():
        ok = [s for s in recorded if not s["error"]]
        raw[name] = {
            "latency_ms": [s["latency_s"] * 1000 for s in ok],
            "completion_tokens": [float(s["completion_tokens"]) for s in ok],
            "prompt_tokens": [float(s["prompt_tokens"]) for s in ok],
            "rating": ratings.get(name, []),
        }
        got = arms[name]
        errors = sum(1 for s in recorded if s["error"])
        assert got["requests"] == len(recorded) and got["errors"] == errors
        assert got["error_rate"]["value"] == pytest.approx(errors / len(recorded))
        assert got["error_rate"]["ci95"] == pytest.approx(list(wilson_interval(errors, len(recorded))))
        for metric in ("latency_ms", "completion_tokens", "rating"):
            xs = raw[name][metric]
            assert got[metric]["n"] == len(xs)
            if xs:
                assert got[metric]["mean"] == pytest.approx(statistics.fmean(xs), rel=1e-9)
            interval = _t_interval(xs)
            if interval is None:
                assert got[metric]["ci95"] is None
            else:
                assert got[metric]["ci95"] == pytest.approx(interval, rel=1e-9)
        assert got["prompt_tokens"]["n"] == len(raw[name]["prompt_tokens"])
        assert got["prompt_tokens"]["mean"] == pytest.approx(
            statistics.fmean(raw[name]["prompt_tokens"]), rel=1e-9
        )
    control = results["control"]
    assert arms[control]["control"] is True
    for name, got in arms.items():
        if name == control:
            assert "comparison" not in got
            continue
        cmp = got["comparison"]
        assert cmp["control"] == control
        x1, n1 = got["errors"], got["requests"]
        x2, n2 = arms[control]["errors"], arms[control]["requests"]
        d, lo, hi = newcombe_interval(x1, n1, x2, n2)  # type: ignore[misc]
        assert cmp["error_rate"]["difference"] == pytest.approx(x1 / n1 - x2 / n2)
        assert cmp["error_rate"]["ci95"] == pytest.approx([lo, hi])
        for metric in ("latency_ms", "completion_tokens", "prompt_tokens", "rating"):
            xs, ys = raw[name][metric], raw[control][metric]
            if len(xs) < 2 or len(ys) < 2:
                assert cmp[metric] == {"difference": None, "ci95": None}
                continue
            d, lo, hi = _welch(xs, ys)
            assert cmp[metric]["difference"] == pytest.approx(d, rel=1e-9, abs=1e-9)
            assert cmp[metric]["ci95"] == pytest.approx([lo, hi], rel=1e-8, abs=1e-9)


def _record(recorder: ExperimentRecorder, exp: Experiment, arm: str, sample: dict[str, Any], **kw: Any):
    recorder.record(
        exp,
        exp.arm(arm),  # type: ignore[arg-type]
        tenant=kw.get("tenant", "acme"),
        request_id=kw.get("request_id", "r"),
        **sample,
    )


def test_two_replicas_flush_additively_and_results_match_a_direct_computation(db_url):
    async def go():
        stores = [await _store(db_url) for _ in range(2)]
        reg = ExperimentRegistry(stores[0])
        await reg.start()
        exp = await reg.create(
            "exp",
            "llama",
            [{"name": "a", "weight": 1}, {"name": "b", "weight": 1}, {"name": "c", "weight": 1}],
        )
        # flush_s far away: every flush here is an explicit one (or stop()'s).
        recorders = [ExperimentRecorder(s, flush_s=3600) for s in stores]
        for r in recorders:
            await r.start()
        rng = random.Random(11)
        samples: dict[str, list[dict[str, Any]]] = {"a": [], "b": [], "c": []}
        for i in range(900):
            arm = rng.choice("abc")
            s = _sample(rng)
            samples[arm].append(s)
            _record(recorders[i % 2], exp, arm, s, request_id=f"req-{i}")
            if i % 97 == 0:
                await recorders[rng.randrange(2)].flush()  # interleaved flushes, both replicas
        await recorders[1].stop()  # stop() flushes what is pending
        results = await recorders[0].results("exp")  # flushes replica 0's own pending data first
        _check_results(results, samples, {})
        assert results["experiment"]["name"] == "exp" and results["confidence"] == 0.95
        # Another replica sees the same totals.
        other = await ExperimentRecorder(stores[1]).results("exp")
        assert [a["requests"] for a in other["arms"]] == [a["requests"] for a in results["arms"]]
        await recorders[0].stop()
        for s in stores:
            await s.close()

    run(go())


def test_concurrent_flushes_from_two_replicas_add_up(db_url):
    async def go():
        stores = [await _store(db_url) for _ in range(2)]
        reg = ExperimentRegistry(stores[0])
        await reg.start()
        exp = await reg.create("exp", "llama", TWO_ARMS)
        recorders = [ExperimentRecorder(s, flush_s=3600) for s in stores]
        rng = random.Random(3)
        samples: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        ids = itertools.count()
        for _ in range(10):
            for r in recorders:
                for _ in range(30):
                    arm = rng.choice("ab")
                    s = _sample(rng)
                    samples[arm].append(s)
                    _record(r, exp, arm, s, request_id=f"q{next(ids)}")
            await asyncio.gather(*(r.flush() for r in recorders))
        _check_results(await recorders[0].results("exp"), samples, {})
        for s in stores:
            await s.close()

    run(go())


def test_results_include_data_not_yet_flushed_and_empty_arms(db_url):
    async def go():
        store = await _store(db_url)
        reg = ExperimentRegistry(store)
        await reg.start()
        exp = await reg.create("exp", "llama", TWO_ARMS)
        recorder = ExperimentRecorder(store, flush_s=3600)
        empty = await recorder.results("exp")
        for arm in empty["arms"]:
            assert arm["requests"] == 0 and arm["error_rate"] == {"value": None, "ci95": None}
            assert arm["latency_ms"] == {"n": 0, "mean": None, "ci95": None}
        assert empty["arms"][1]["comparison"]["error_rate"] == {"difference": None, "ci95": None}
        one = {"latency_s": 0.25, "prompt_tokens": 10, "completion_tokens": 4, "error": False}
        _record(recorder, exp, "b", one, request_id="x1")
        got = await recorder.results("exp")  # no flush before: results flushes
        b = got["arms"][1]
        assert b["requests"] == 1 and b["latency_ms"]["mean"] == pytest.approx(250.0)
        assert b["latency_ms"]["ci95"] is None  # one observation: no interval
        await store.close()

    run(go())


def test_record_ignores_bad_samples_and_errors_do_not_count_in_latency(db_url):
    async def go():
        store = await _store(db_url)
        reg = ExperimentRegistry(store)
        await reg.start()
        exp = await reg.create("exp", "llama", TWO_ARMS)
        recorder = ExperimentRecorder(store, flush_s=3600)
        arm = exp.arms[0]
        bad_samples = [
            {"latency_s": math.nan, "prompt_tokens": -1, "completion_tokens": True},
            {"latency_s": -0.5, "prompt_tokens": None, "completion_tokens": None},
            {"latency_s": math.inf, "prompt_tokens": 2.5, "completion_tokens": "7"},
        ]
        for i, s in enumerate(bad_samples):
            recorder.record(exp, arm, tenant="acme", request_id=f"bad-{i}", error=False, **s)  # type: ignore[arg-type]
        recorder.record(
            exp,
            arm,
            tenant="acme",
            request_id="err",
            latency_s=9.0,
            prompt_tokens=5,
            completion_tokens=0,
            error=True,
        )
        # Request ids that cannot have come from the proxy are counted but not kept for feedback.
        for rid in ("", "has space", "x" * 129, None):
            recorder.record(
                exp, arm, tenant="acme", request_id=rid, latency_s=0.1, prompt_tokens=1,  # type: ignore[arg-type]
                completion_tokens=1, error=False,
            )  # fmt: skip
        recorder.record(
            exp, arm, tenant="Not A Tenant" * 10, request_id="odd-tenant", latency_s=0.1, prompt_tokens=1,
            completion_tokens=1, error=False,
        )  # fmt: skip
        a = (await recorder.results("exp"))["arms"][0]
        assert a["requests"] == 9 and a["errors"] == 1
        assert a["latency_ms"]["n"] == 5 and a["latency_ms"]["mean"] == pytest.approx(100.0)
        assert a["prompt_tokens"]["n"] == 5 and a["completion_tokens"]["n"] == 5
        with store.engine.connect() as conn:
            ids = sorted(conn.execute(sa.select(ex.experiment_requests_table.c.request_id)).scalars())
        assert ids == ["bad-0", "bad-1", "bad-2", "err"]
        await store.close()

    run(go())


def test_pending_request_ids_are_bounded_but_aggregates_keep_counting(db_url):
    async def go():
        store = await _store(db_url)
        reg = ExperimentRegistry(store)
        await reg.start()
        exp = await reg.create("exp", "llama", TWO_ARMS)
        recorder = ExperimentRecorder(store, flush_s=0.01, max_pending=3)
        s = {"latency_s": 0.1, "prompt_tokens": 1, "completion_tokens": 1, "error": False}
        for i in range(5):
            _record(recorder, exp, "a", s, request_id=f"r{i}")
        _record(recorder, exp, "a", s, request_id="r0")  # a duplicate id takes no new slot
        assert recorder.dropped == 2
        assert (await recorder.results("exp"))["arms"][0]["requests"] == 6
        for rid in ("r0", "r1", "r2"):
            assert (await recorder.feedback("acme", rid, 1))["arm"] == "a"
        for rid in ("r3", "r4"):
            err = await _raises(404, recorder.feedback, "acme", rid, 1)
            assert err.code == "request_not_found"
        # After a flush the room is back.
        _record(recorder, exp, "b", s, request_id="r9")
        assert (await recorder.feedback("acme", "r9", 0))["arm"] == "b"
        await store.close()

    run(go())


def test_a_failed_flush_keeps_its_data_for_the_next(db_url, monkeypatch):
    async def go():
        store = await _store(db_url)
        reg = ExperimentRegistry(store)
        await reg.start()
        exp = await reg.create("exp", "llama", TWO_ARMS)
        recorder = ExperimentRecorder(store, flush_s=3600)
        rng = random.Random(5)
        samples: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}

        def some(n: int, prefix: str) -> None:
            for i in range(n):
                arm = rng.choice("ab")
                s = _sample(rng)
                samples[arm].append(s)
                _record(recorder, exp, arm, s, request_id=f"{prefix}{i}")

        some(50, "first")
        real_run = store.run

        async def down(*_args):
            raise GatewayError(503, "the gateway's state store is unavailable", code="store_unavailable")

        monkeypatch.setattr(store, "run", down)
        err = await _raises(503, recorder.flush)
        assert err.code == "store_unavailable" and recorder.flush_failures == 1
        some(30, "second")
        monkeypatch.setattr(store, "run", real_run)
        _check_results(await recorder.results("exp"), samples, {})
        assert (await recorder.feedback("acme", "first7", 1))["request_id"] == "first7"
        await store.close()

    run(go())


def test_the_background_task_flushes_and_stop_flushes_the_rest(db_url):
    async def go():
        store = await _store(db_url)
        reg = ExperimentRegistry(store)
        await reg.start()
        exp = await reg.create("exp", "llama", TWO_ARMS)
        recorder = ExperimentRecorder(store, flush_s=0.02)
        await recorder.start()
        s = {"latency_s": 0.1, "prompt_tokens": 1, "completion_tokens": 1, "error": False}
        _record(recorder, exp, "a", s, request_id="bg")
        reader = ExperimentRecorder(await _store(db_url))  # another replica: sees only what is flushed
        deadline = time.monotonic() + 30
        while (await reader.results("exp"))["arms"][0]["requests"] != 1:
            assert time.monotonic() < deadline, "the background flush never ran"
            await asyncio.sleep(0.02)
        # stop(): no waiting for the next tick; what is pending is written.
        slow = ExperimentRecorder(store, flush_s=3600)
        await slow.start()
        _record(slow, exp, "b", s, request_id="late")
        await slow.stop()
        await recorder.stop()
        assert (await reader.results("exp"))["arms"][1]["requests"] == 1
        await store.close()

    run(go())


# -- feedback ---------------------------------------------------------------------------------


def test_feedback_rules(db_url):
    async def go():
        stores = [await _store(db_url) for _ in range(2)]
        reg = ExperimentRegistry(stores[0])
        await reg.start()
        exp = await reg.create("exp", "llama", TWO_ARMS)
        r1 = ExperimentRecorder(stores[0], flush_s=0.01)
        r2 = ExperimentRecorder(stores[1], flush_s=0.01)
        s = {"latency_s": 0.1, "prompt_tokens": 1, "completion_tokens": 1, "error": False}
        _record(r1, exp, "b", s, request_id="req-1")
        # Before any flush: works (the recorder flushes that request first).
        got = await r1.feedback("acme", "req-1", 1)
        assert got == {"request_id": "req-1", "experiment": "exp", "arm": "b", "rating": 1.0}
        err = await _raises(409, r1.feedback, "acme", "req-1", 0)
        assert err.code == "already_rated"
        err = await _raises(409, r2.feedback, "acme", "req-1", 0.5)  # from another replica too
        assert err.code == "already_rated"

        # Another tenant's request reads exactly like one never recorded.
        other = await _raises(404, r1.feedback, "beta", "req-2", 1)
        _record(r1, exp, "a", s, request_id="req-2")
        await r1.flush()
        other_tenant = await _raises(404, r2.feedback, "beta", "req-2", 1)
        assert (
            other_tenant.message == other.message and other_tenant.code == other.code == "request_not_found"
        )
        assert other_tenant.param == "request_id"
        # Recorded and flushed on one replica, rated through the other.
        assert (await r2.feedback("acme", "req-2", 0))["arm"] == "a"

        for bad in (-0.1, 1.01, math.nan, math.inf, True, "1", None):
            err = await _raises(400, r1.feedback, "acme", "req-3", bad)
            assert err.param == "rating"
        for bad_id in ("", "has space", "x" * 129, 5):
            err = await _raises(400, r1.feedback, "acme", bad_id, 1)
            assert err.param == "request_id"

        # Two replicas rating one request at once: exactly one wins.
        for i in range(5):
            _record(r1, exp, "a", s, request_id=f"race-{i}")
        await r1.flush()
        for i in range(5):
            outcome = await asyncio.gather(
                r1.feedback("acme", f"race-{i}", 1),
                r2.feedback("acme", f"race-{i}", 0),
                return_exceptions=True,
            )
            assert sorted(type(o).__name__ for o in outcome) == ["GatewayError", "dict"], outcome
            assert next(o for o in outcome if isinstance(o, GatewayError)).status == 409

        results = await r1.results("exp")
        assert [a["rating"]["n"] for a in results["arms"]] == [6, 1]
        for st in stores:
            await st.close()

    run(go())


def test_feedback_on_an_expired_request_is_404(db_url):
    async def go():
        store = await _store(db_url)
        reg = ExperimentRegistry(store)
        await reg.start()
        exp = await reg.create("exp", "llama", TWO_ARMS)
        recorder = ExperimentRecorder(store, flush_s=0.01, request_ttl_s=0.05)
        s = {"latency_s": 0.1, "prompt_tokens": 1, "completion_tokens": 1, "error": False}
        _record(recorder, exp, "a", s, request_id="old")
        await recorder.flush()
        await asyncio.sleep(0.2)
        err = await _raises(404, recorder.feedback, "acme", "old", 1)
        assert err.code == "request_not_found"
        await store.close()

    run(go())


def test_ratings_aggregate_per_arm_like_a_direct_computation(db_url):
    async def go():
        store = await _store(db_url)
        reg = ExperimentRegistry(store)
        await reg.start()
        exp = await reg.create("exp", "llama", TWO_ARMS)
        recorder = ExperimentRecorder(store, flush_s=3600)
        rng = random.Random(2)
        samples: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        ratings: dict[str, list[float]] = {"a": [], "b": []}
        for i in range(120):
            arm = "ab"[i % 2]
            s = _sample(rng)
            samples[arm].append(s)
            _record(recorder, exp, arm, s, request_id=f"r{i}")
        for i in range(0, 120, 3):
            arm = "ab"[i % 2]
            value = rng.choice([0, 1, 1, 0.5, 0.8])  # thumbs and finer ratings mixed
            await recorder.feedback("acme", f"r{i}", value)
            ratings[arm].append(float(value))
        _check_results(await recorder.results("exp"), samples, ratings)
        await store.close()

    run(go())


# -- the HTTP routes --------------------------------------------------------------------------


def _app(registry: ExperimentRegistry, recorder: ExperimentRecorder, authenticator: Authenticator) -> FastAPI:
    # The error rendering of paved.gateway.app's create_app.
    app = FastAPI()
    app.include_router(experiments_router(registry, recorder, AdminAuth(ADMIN_KEY)))
    app.include_router(feedback_router(recorder, authenticator))

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.status, exc.message, exc.param, exc.code), exc.status, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return JSONResponse(error_body(400, message, param), 400)

    return app


def test_admin_routes(db_url):
    async def go():
        store = await _store(db_url)
        registry, recorder = ExperimentRegistry(store), ExperimentRecorder(store, flush_s=3600)
        await registry.start()
        app = _app(registry, recorder, Authenticator(store))
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        body = {"name": "exp", "model": "llama", "arms": TWO_ARMS}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            # The admin key first: a missing or wrong key is a 401 even for a broken body.
            for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic x"}):
                for method, path, payload in [
                    ("POST", "/admin/v1/experiments", body),
                    ("POST", "/admin/v1/experiments", {"junk": 1}),
                    ("GET", "/admin/v1/experiments", None),
                    ("GET", "/admin/v1/experiments/exp", None),
                    ("POST", "/admin/v1/experiments/exp/stop", None),
                    ("GET", "/admin/v1/experiments/exp/results", None),
                ]:
                    r = await c.request(method, path, json=payload, headers=headers)
                    assert r.status_code == 401, (method, path, r.text)
                    assert r.headers["www-authenticate"] == "Bearer"
            assert await registry.list() == []

            r = await c.post("/admin/v1/experiments", json=body, headers=admin)
            assert r.status_code == 201, r.text
            created = r.json()
            assert created["name"] == "exp" and created["status"] == "running" and len(created["arms"]) == 2
            assert created["arms"][1]["version"] == "v2"

            for bad, param in [
                ({**body, "name": "x2", "model": "qwen", "arms": TWO_ARMS[:1]}, "arms"),
                (
                    {
                        **body,
                        "name": "x2",
                        "model": "qwen",
                        "arms": [TWO_ARMS[0], {"name": "b", "weight": 0}],
                    },
                    "arms[1].weight",
                ),
                ({**body, "name": "x2", "model": "qwen", "unit": "team"}, "unit"),
                ({**body, "name": "x2", "extra": True}, "extra"),
                ({"name": "x2", "model": "qwen"}, "arms"),
                ({**body, "name": 5}, "name"),
            ]:
                r = await c.post("/admin/v1/experiments", json=bad, headers=admin)
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == param, r.json()
            r = await c.post("/admin/v1/experiments", content=b"{not json", headers=admin)
            assert r.status_code == 400
            r = await c.post("/admin/v1/experiments", json={**body, "name": "exp2"}, headers=admin)
            assert r.status_code == 409 and r.json()["error"]["code"] == "experiment_running"
            r = await c.post("/admin/v1/experiments", json={**body, "model": "qwen"}, headers=admin)
            assert r.status_code == 409 and r.json()["error"]["code"] == "experiment_exists"

            r = await c.get("/admin/v1/experiments", headers=admin)
            assert r.status_code == 200 and [e["name"] for e in r.json()["data"]] == ["exp"]
            r = await c.get("/admin/v1/experiments/exp", headers=admin)
            assert r.status_code == 200 and r.json() == created
            for path in ("/admin/v1/experiments/ghost", "/admin/v1/experiments/ghost/results"):
                r = await c.get(path, headers=admin)
                assert r.status_code == 404 and r.json()["error"]["code"] == "experiment_not_found"
            r = await c.post("/admin/v1/experiments/ghost/stop", headers=admin)
            assert r.status_code == 404

            exp = await registry.get("exp")
            recorder.record(
                exp, exp.arms[0], tenant="acme", request_id="q", latency_s=0.2, prompt_tokens=3,
                completion_tokens=2, error=False,
            )  # fmt: skip
            r = await c.get("/admin/v1/experiments/exp/results", headers=admin)
            assert r.status_code == 200 and r.json()["arms"][0]["requests"] == 1
            assert r.json()["arms"][1]["comparison"]["control"] == "a"
            r = await c.post("/admin/v1/experiments/exp/stop", headers=admin)
            assert r.status_code == 200 and r.json()["status"] == "stopped"
        await store.close()

    run(go())


def test_feedback_route_with_a_tenant_key(db_url):
    async def go():
        store = await _store(db_url)
        await store.create_tenant("acme")
        await store.create_tenant("beta")
        _, acme_key = await store.create_key("acme", name="app")
        _, beta_key = await store.create_key("beta", name="app")
        registry, recorder = ExperimentRegistry(store), ExperimentRecorder(store, flush_s=0.01)
        await registry.start()
        exp = await registry.create("exp", "llama", TWO_ARMS)
        recorder.record(
            exp, exp.arms[1], tenant="acme", request_id="chat-1", latency_s=0.2, prompt_tokens=3,
            completion_tokens=2, error=False,
        )  # fmt: skip
        app = _app(registry, recorder, Authenticator(store, cache_s=0))
        acme = {"authorization": f"Bearer {acme_key}"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            for headers in (
                {},
                {"authorization": "Bearer pvd_abcdefgh2345_" + "A" * 32},
                {"authorization": f"Bearer {ADMIN_KEY}"},
            ):
                r = await c.post("/v1/feedback", json={"request_id": "chat-1", "rating": 1}, headers=headers)
                assert r.status_code == 401, r.text
                r = await c.post("/v1/feedback", json={"junk": True}, headers=headers)
                assert r.status_code == 401  # the key is checked before the body

            for bad, param in [
                ({"request_id": "chat-1"}, "rating"),
                ({"rating": 1}, "request_id"),
                ({"request_id": "chat-1", "rating": "good"}, "rating"),
                ({"request_id": "chat-1", "rating": True}, "rating"),
                ({"request_id": "chat-1", "rating": 2}, "rating"),
                ({"request_id": "chat-1", "rating": -1}, "rating"),
                ({"request_id": "bad id", "rating": 1}, "request_id"),
                ({"request_id": "chat-1", "rating": 1, "comment": "x"}, "comment"),
            ]:
                r = await c.post("/v1/feedback", json=bad, headers=acme)
                assert r.status_code == 400, (bad, r.text)
                assert r.json()["error"]["param"] == param, (bad, r.json())
            json_headers = {**acme, "content-type": "application/json"}
            for raw in (
                b"[",
                b'{"request_id": "chat-1", "rating": NaN}',
                b'{"request_id": "chat-1", "rating": 1e999}',
            ):
                r = await c.post("/v1/feedback", content=raw, headers=json_headers)
                assert r.status_code == 400, (raw, r.text)

            r = await c.post(
                "/v1/feedback",
                json={"request_id": "chat-1", "rating": 1},
                headers={"authorization": f"Bearer {beta_key}"},
            )
            assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"
            r = await c.post("/v1/feedback", json={"request_id": "chat-1", "rating": 1}, headers=acme)
            assert r.status_code == 200, r.text
            assert r.json() == {"request_id": "chat-1", "experiment": "exp", "arm": "b", "rating": 1.0}
            r = await c.post("/v1/feedback", json={"request_id": "chat-1", "rating": 0}, headers=acme)
            assert r.status_code == 409 and r.json()["error"]["code"] == "already_rated"
            r = await c.post("/v1/feedback", json={"request_id": "never", "rating": 0}, headers=acme)
            assert r.status_code == 404
        assert (await recorder.results("exp"))["arms"][1]["rating"] == {"n": 1, "mean": 1.0, "ci95": None}
        await store.close()

    run(go())


# -- bound to the gateway: routes and templates in force ------------------------------------------


def _routes(*versions: str, template: str | None = None):
    from paved.gateway.routing.routes import parse_routes

    backends = [{"id": f"b-{v}", "url": "http://127.0.0.1:9", "version": v} for v in versions]
    route: dict[str, Any] = {"alias": "llama", "backends": backends}
    if template is not None:
        route["template"] = template
    return parse_routes({"models": [route]})


async def _orchestrator(store: GatewayStore, table) -> Any:
    """An Orchestrator as paved.gateway.server wires one, over `table`; nothing is forwarded."""
    from paved.gateway.metrics import GatewayMetrics
    from paved.gateway.orchestration.orchestrate import InternalClient, Orchestrator
    from paved.gateway.orchestration.templates import TemplateRegistry
    from paved.gateway.orchestration.tokens import TokenCounter
    from paved.gateway.routing.router import Router

    router, metrics = Router(table), GatewayMetrics()
    orchestrator = Orchestrator(
        router=router,
        tokens=TokenCounter(),
        metrics=metrics,
        internal=InternalClient(router, lambda: None, metrics),  # type: ignore[arg-type, return-value]
        templates=TemplateRegistry(store, cache_s=0),
        experiments=ExperimentRegistry(store, cache_s=0),
        recorder=ExperimentRecorder(store, flush_s=3600),
    )
    await orchestrator.start()
    await orchestrator.templates.create("greet", [{"role": "system", "content": "be brief"}])
    return orchestrator


def _misconfigured(orchestrator, kind: str) -> float:
    value = orchestrator.metrics.registry.get_sample_value(
        "paved_gateway_misconfigured_total", {"kind": kind, "model": "llama"}
    )
    return value or 0.0


def _principal(key_id: str = "k1"):
    from paved.gateway.types import Principal, Tenant

    return Principal(key_id, "app", Tenant("t1", "acme"))


async def _prepare(orchestrator, body: dict[str, Any], endpoint: str = "chat", key_id: str = "k1"):
    route = orchestrator.router.route(body["model"])
    return await orchestrator.prepare(_principal(key_id), endpoint, body, body["model"], route, {}, "r1")


def test_create_refuses_models_versions_and_templates_the_gateway_does_not_have(db_url):
    async def go():
        store = await _store(db_url)
        orchestrator = await _orchestrator(store, _routes("v1", "v2"))
        registry = orchestrator.experiments
        for model, arms, status, param in [
            ("nosuch", TWO_ARMS, 400, "model"),
            ("llama", [_arm(name="a", version="v9"), _arm(name="b")], 400, "arms[0].version"),
            ("llama", [_arm(name="a"), _arm(name="b", version="v9")], 400, "arms[1].version"),
            ("llama", [_arm(name="a"), _arm(name="b", template="nosuch")], 404, "arms[1].template"),
            ("llama", [_arm(name="a"), _arm(name="b", template="greet@2")], 404, "arms[1].template"),
        ]:
            err = await _raises(status, registry.create, "exp", model, arms)
            assert err.param == param, (model, arms, err.message)
            if status == 404:
                assert err.code == "template_not_found"
        assert await registry.list() == []  # nothing refused was stored
        arms = [
            _arm(name="a", version="v1", template="greet@1"),
            _arm(name="b", version="v2", template="greet"),
        ]
        exp = await registry.create("exp", "llama", arms)
        assert [a.version for a in exp.arms] == ["v1", "v2"]

        # The same over HTTP: OpenAI error bodies, 201 for the good one.
        app = _app(registry, orchestrator.recorder, Authenticator(store, cache_s=0))
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            body = {"name": "ex1", "model": "llama", "arms": [{"name": "a", "weight": 1, "version": "v9"},
                                                               {"name": "b", "weight": 1}]}  # fmt: skip
            r = await c.post("/admin/v1/experiments", json=body, headers=admin)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "arms[0].version" and "v9" in error["message"], error
            assert error["type"] == "invalid_request_error"
            r = await c.post("/admin/v1/experiments", json={**body, "model": "nosuch"}, headers=admin)
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        await orchestrator.templates.close()
        await orchestrator.stop()
        await store.close()

    run(go())


def test_an_arm_whose_version_left_the_routes_serves_the_alias_and_is_counted(db_url, caplog):
    async def go():
        store = await _store(db_url)
        orchestrator = await _orchestrator(store, _routes("v1", "v2"))
        arms = [_arm(name="old", version="v1"), _arm(name="new", version="v2", params={"max_tokens": 7})]
        await orchestrator.experiments.create("exp", "llama", arms, unit="key")
        keys = [f"k{i}" for i in range(40)]
        before = {}
        for key in keys:
            plan = await _prepare(orchestrator, {"model": "llama", "prompt": "hi"}, "completions", key)
            before[key] = plan.experiment[1].name
            assert plan.model == {"old": "llama@v1", "new": "llama@v2"}[before[key]]
        assert set(before.values()) == {"old", "new"}

        orchestrator.router.set_table(_routes("v2"))  # v1 retired while the experiment runs
        for key in keys:
            body = {"model": "llama", "prompt": "hi"}
            plan = await _prepare(orchestrator, body, "completions", key)
            if before[key] == "old":
                # Not a 404: the alias as usual, outside the experiment (not recorded for it).
                assert plan.experiment is None and plan.model == "llama", plan
                assert "x-paved-experiment" not in plan.headers
            else:
                assert plan.experiment[1].name == "new" and plan.model == "llama@v2"
                assert body["max_tokens"] == 7
        stale = sum(1 for arm in before.values() if arm == "old")
        assert _misconfigured(orchestrator, "arm_version") == stale
        warnings = [r for r in caplog.records if "llama@v1" in r.getMessage()]
        assert len(warnings) == 1  # once per replica, then only counted
        await orchestrator.templates.close()
        await orchestrator.stop()
        await store.close()

    run(go())


def test_a_route_template_that_does_not_exist_is_skipped_not_a_client_error(db_url, caplog):
    async def go():
        store = await _store(db_url)
        orchestrator = await _orchestrator(store, _routes("v1", template="nosuchtpl"))
        messages = [{"role": "user", "content": "hi"}]
        for _ in range(3):
            body = {"model": "llama", "messages": list(messages)}
            plan = await _prepare(orchestrator, body)
            assert body["messages"] == messages and plan.template is None
            assert "x-paved-template" not in plan.headers
        assert _misconfigured(orchestrator, "route_template") == 3
        assert len([r for r in caplog.records if "nosuchtpl" in r.getMessage()]) == 1

        # The next configured template, the tenant's default, is what the route falls back to.
        await store.create_tenant("acme")
        await orchestrator.templates.set_tenant_prompting(
            "acme", system_prompt=None, default_template="greet"
        )
        body = {"model": "llama", "messages": list(messages)}
        plan = await _prepare(orchestrator, body)
        assert plan.template == "greet@1"
        assert body["messages"] == [{"role": "system", "content": "be brief"}, *messages]

        # A template the client names itself is still the client's 404.
        body = {"model": "llama", "messages": list(messages), "template": "nosuchtpl"}
        err = await _raises(404, _prepare, orchestrator, body)
        assert err.code == "template_not_found" and err.param == "template"
        await orchestrator.templates.close()
        await orchestrator.stop()
        await store.close()

    run(go())


# -- PostgreSQL: two replicas on one database --------------------------------------------------

_pg_names = itertools.count()


@pytest.fixture(scope="module")
def pg_server() -> Iterator[str]:
    with postgres_server() as url:
        yield url


@pytest.fixture
def pg_url(pg_server) -> str:
    return create_database(pg_server, f"exp_{next(_pg_names)}")


def test_postgres_replicas_create_record_rate_and_add_up(pg_url):
    async def go():
        stores = [await _store(pg_url) for _ in range(2)]
        regs = [ExperimentRegistry(s) for s in stores]
        await asyncio.gather(*(r.start() for r in regs))
        results = await asyncio.gather(
            *(regs[i % 2].create(f"e{i}", "llama", TWO_ARMS) for i in range(6)), return_exceptions=True
        )
        wins = [r for r in results if isinstance(r, Experiment)]
        assert len(wins) == 1 and all(
            isinstance(r, GatewayError) and r.status == 409 for r in results if r not in wins
        )
        exp = wins[0]
        assert await regs[1].get(exp.name) == exp

        recorders = [ExperimentRecorder(s, flush_s=3600) for s in stores]
        rng = random.Random(17)
        samples: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        ids = itertools.count()
        for _ in range(8):
            for r in recorders:
                for _ in range(40):
                    arm = rng.choice("ab")
                    s = _sample(rng)
                    samples[arm].append(s)
                    _record(r, exp, arm, s, request_id=f"p{next(ids)}")
            await asyncio.gather(*(r.flush() for r in recorders))  # concurrent additive flushes

        ratings: dict[str, list[float]] = {"a": [], "b": []}
        for r in recorders:
            await r.flush()
        for i in range(0, 640, 5):
            outcome = await asyncio.gather(
                recorders[0].feedback("acme", f"p{i}", 1),
                recorders[1].feedback("acme", f"p{i}", 0),
                return_exceptions=True,
            )
            winner = [o for o in outcome if isinstance(o, dict)]
            assert len(winner) == 1, outcome
            assert all(o.status == 409 for o in outcome if isinstance(o, GatewayError))
            ratings[winner[0]["arm"]].append(winner[0]["rating"])
        _check_results(await recorders[1].results(exp.name), samples, ratings)
        err = await _raises(404, ExperimentRecorder(stores[0], flush_s=0.01).feedback, "beta", "p0", 1)
        assert err.code == "request_not_found"
        for s in stores:
            await s.close()

    run(go())

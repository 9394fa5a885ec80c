"""The routes table's validation and the router's choices: version pins, sticky splits,
strategies (weighted, least outstanding, prefix affinity with bounded load), passive ejection
and table swaps. Pure logic over an injectable clock and seeded randomness; no servers."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paved.gateway.errors import GatewayError, ModelNotAllowedError, NoBackendError
from paved.gateway.routing.router import HOLDER_FRESH_REQUESTS, PREFIX_BOUND, Router
from paved.gateway.routing.routes import (
    MAX_BACKENDS,
    RoutesError,
    RoutesTable,
    parse_routes,
    parse_routes_bytes,
)


def backend(port: int, version: str = "v1", weight: float = 1.0, **extra: Any) -> dict[str, Any]:
    return {"url": f"http://127.0.0.1:{port}", "version": version, "weight": weight, **extra}


def table(*models: dict[str, Any]) -> RoutesTable:
    return parse_routes({"models": list(models)})


def model(alias: str = "tiny", backends: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"alias": alias, "backends": [backend(8001)] if backends is None else backends, **extra}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- parsing --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "path", "fragment"),
    [
        ({"models": [], "extra": 1}, "routes.extra", "unknown key"),
        ({"models": {}}, "models", "must be a list"),
        ({"models": [model(colour="red")]}, "models[0].colour", "unknown key"),
        (
            {"models": [model(backends=[backend(8001, zone="a")])]},
            "models[0].backends[0].zone",
            "unknown key",
        ),
        ({"models": [model(alias="a@b")]}, "models[0].alias", "'@'"),
        ({"models": [model(alias="")]}, "models[0].alias", "must match"),
        ({"models": [model(alias="has space")]}, "models[0].alias", "must match"),
        ({"models": [model(), model()]}, "models[1].alias", "duplicate alias"),
        ({"models": [model(strategy="random")]}, "models[0].strategy", "must be one of"),
        ({"models": [model(kind="chat")]}, "models[0].kind", "must be one of"),
        ({"models": [model(backends=[])]}, "models[0].backends", "non-empty"),
        (
            {"models": [model(backends=[{"url": "https://127.0.0.1:1", "version": "v1"}])]},
            "models[0].backends[0].url",
            "http://",
        ),
        (
            {"models": [model(backends=[{"url": "http://10.0.0.1:1", "version": "v1"}])]},
            "models[0].backends[0].url",
            "loopback",
        ),
        (
            {"models": [model(backends=[{"url": "http://127.0.0.1:1/v1", "version": "v1"}])]},
            "models[0].backends[0].url",
            "without path",
        ),
        (
            {"models": [model(backends=[{"url": "http://u:p@127.0.0.1:1", "version": "v1"}])]},
            "models[0].backends[0].url",
            "credentials",
        ),
        (
            {"models": [model(backends=[{"url": "http://bad_host!:1", "version": "v1"}])]},
            "models[0].backends[0].url",
            "hostname",
        ),
        (
            {"models": [model(backends=[{"url": "http://127.0.0.1:99999", "version": "v1"}])]},
            "models[0].backends[0].url",
            "not a valid URL",
        ),
        (
            {"models": [model(backends=[{"url": "http://127.0.0.1:1"}])]},
            "models[0].backends[0].version",
            "required",
        ),
        ({"models": [model(backends=[{"version": "v1"}])]}, "models[0].backends[0].url", "required"),
        ({"models": [model(backends=[backend(8001, "v@1")])]}, "models[0].backends[0].version", "'@'"),
        ({"models": [model(backends=[backend(8001, weight=-1)])]}, "models[0].backends[0].weight", ">= 0"),
        (
            {"models": [model(backends=[backend(8001, weight=True)])]},
            "models[0].backends[0].weight",
            "number",
        ),
        (
            {"models": [model(backends=[backend(8001), backend(8001)])]},
            "models[0].backends[1].id",
            "duplicate backend id",
        ),
        (
            {"models": [model(backends=[backend(8001, id="a"), backend(8002, id="a")])]},
            "models[0].backends[1].id",
            "duplicate backend id",
        ),
        (
            {"models": [model("a", [backend(8001, id="x")]), model("b", [backend(8002, id="x")])]},
            "models[1].backends[0].id",
            "different urls",
        ),
        ({"models": [model(split={"v9": 1})]}, "models[0].split.v9", "no backend serves"),
        ({"models": [model(split={"v1": -1})]}, "models[0].split.v1", ">= 0"),
        ({"models": [model(split={"v1": 0})]}, "models[0].split", "all be 0"),
        ({"models": [model(current="v9")]}, "models[0].current", "v9"),
        ({"models": [model(affinity_prefix_tokens=0)]}, "models[0].affinity_prefix_tokens", "1.."),
        (
            {"models": [model(strategy="prefix_affinity", bounded_load=0.9)]},
            "models[0].bounded_load",
            "1..100",
        ),
        (
            {"models": [model(strategy="prefix_affinity", bounded_load=True)]},
            "models[0].bounded_load",
            "number",
        ),
        (
            {"models": [model(strategy="prefix_affinity", bounded_load="2")]},
            "models[0].bounded_load",
            "number",
        ),
        (
            {"models": [model(strategy="prefix_affinity", bounded_load=math.inf)]},
            "models[0].bounded_load",
            "1..100",
        ),
        ({"models": [model(bounded_load=1.5)]}, "models[0].bounded_load", "only to strategy prefix_affinity"),
        (
            {"models": [model(strategy="prefix_affinity", bounded_load_slack=-1)]},
            "models[0].bounded_load_slack",
            "0..100000",
        ),
        (
            {"models": [model(strategy="prefix_affinity", bounded_load_slack=1.5)]},
            "models[0].bounded_load_slack",
            "integer",
        ),
        ({"models": [model(bounded_load_slack=2)]}, "models[0].bounded_load_slack", "only to strategy"),
        (
            {"models": [model(kind="kserve")]},
            "models[0].backends[0]",
            "kserve_grpc or kserve_http",
        ),
        (
            {"models": [model(backends=[backend(8001, kserve_grpc="127.0.0.1")])]},
            "models[0].backends[0].kserve_grpc",
            "host:port",
        ),
        (
            {"models": [model(backends=[backend(8001, metrics_url="https://127.0.0.1:9/metrics")])]},
            "models[0].backends[0].metrics_url",
            "http://",
        ),
        (
            {"models": [model(backends=[backend(8001, metrics_url="http://127.0.0.1:9/metrics?x=1")])]},
            "models[0].backends[0].metrics_url",
            "without query",
        ),
        (
            {"models": [model(backends=[backend(8001, metrics_url="http://u:p@127.0.0.1:9/metrics")])]},
            "models[0].backends[0].metrics_url",
            "credentials",
        ),
        (
            {"models": [model(backends=[backend(8001, metrics_url="http://10.0.0.1:9/metrics")])]},
            "models[0].backends[0].metrics_url",
            "loopback",
        ),
        (
            {"models": [model(backends=[backend(8001, metrics_url="http://127.0.0.1:9")])]},
            "models[0].backends[0].metrics_url",
            "path",
        ),
        (
            {"models": [model(backends=[backend(8001, metrics_url=9)])]},
            "models[0].backends[0].metrics_url",
            "string",
        ),
        (
            {
                "models": [
                    model("a", [backend(8001, id="x", metrics_url="http://127.0.0.1:9/metrics")]),
                    model("b", [backend(8001, id="x")]),
                ]
            },
            "models[1].backends[0].id",
            "different urls",
        ),
        ({"models": [model(template="Bad Name")]}, "models[0].template", "name@version"),
        ({"models": [model(template="t@0")]}, "models[0].template", "name@version"),
        ({"models": [model(max_model_len=0)]}, "models[0].max_model_len", "1.."),
        ({"models": [model(max_model_len=True)]}, "models[0].max_model_len", "integer"),
        ({"models": [model(summarizer="a b")]}, "models[0].summarizer", "alias"),
        ({"models": [model(summarizer_temperature=0.5)]}, "models[0].summarizer_temperature", "summarizer"),
        (
            {"models": [model(summarizer="s", summarizer_temperature=3)]},
            "models[0].summarizer_temperature",
            "0..2",
        ),
        ({"models": [model(cache=[])]}, "models[0].cache", "object"),
        ({"models": [model(cache={"exact": 1})]}, "models[0].cache.exact", "true or false"),
        ({"models": [model(cache={"semantic": True})]}, "models[0].cache.embedding_model", "required"),
        ({"models": [model(cache={"threshold": 1.5})]}, "models[0].cache.threshold", "(0, 1]"),
        ({"models": [model(cache={"threshold": 0})]}, "models[0].cache.threshold", "(0, 1]"),
        ({"models": [model(cache={"ttl_s": 0})]}, "models[0].cache.ttl_s", "seconds"),
        ({"models": [model(cache={"ttl_s": 10**7})]}, "models[0].cache.ttl_s", ""),
        ({"models": [model(cache={"lru": True})]}, "models[0].cache.lru", "unknown key"),
    ],
)
def test_parse_errors_name_the_field(obj: dict[str, Any], path: str, fragment: str) -> None:
    with pytest.raises(RoutesError) as e:
        parse_routes(obj)
    assert str(e.value).startswith(path + ":"), str(e.value)
    assert fragment in str(e.value)
    assert isinstance(e.value, ValueError)


def test_orchestration_fields_round_trip() -> None:
    obj = {
        "models": [
            model(
                template="support@2",
                max_model_len=4096,
                summarizer="tiny",
                summarizer_temperature=0.5,
                cache={"semantic": True, "embedding_model": "minilm", "threshold": 0.95, "ttl_s": 60},
            )
        ]
    }
    table = parse_routes(obj)
    route = next(iter(table.models.values()))
    assert (route.template, route.max_model_len, route.summarizer) == ("support@2", 4096, "tiny")
    assert route.cache is not None and route.cache.exact and route.cache.semantic
    assert (route.cache.threshold, route.cache.ttl_s, route.cache.embedding_model) == (0.95, 60.0, "minilm")
    assert parse_routes(table.to_obj()) == table
    assert parse_routes({"models": [model()]}).revision != table.revision


def test_parse_rejects_too_many_backends() -> None:
    many = [backend(1 + i % 60000, id=f"b{i}") for i in range(MAX_BACKENDS + 1)]
    with pytest.raises(RoutesError, match="more than"):
        parse_routes({"models": [model(backends=many)]})


def test_parse_bytes_rejects_bad_json_duplicate_keys_and_nan() -> None:
    with pytest.raises(RoutesError, match="invalid JSON"):
        parse_routes_bytes(b"{", "json")
    with pytest.raises(RoutesError, match="duplicate key"):
        parse_routes_bytes(b'{"models": [], "models": []}', "json")
    with pytest.raises(RoutesError, match="NaN"):
        parse_routes_bytes(
            b'{"models": [{"alias": "a", "backends": '
            b'[{"url": "http://127.0.0.1:1", "version": "v", "weight": NaN}]}]}',
            "json",
        )
    with pytest.raises(RoutesError, match="larger than"):
        parse_routes_bytes(b" " * (4 * 1024 * 1024 + 1), "json")


def test_parse_defaults_and_revision() -> None:
    t = table(model(backends=[backend(8001), {"url": "http://localhost:8002/", "version": "v2", "id": "b2"}]))
    route = t.models["tiny"]
    assert route.strategy == "least_outstanding" and route.kind == "generate"
    a, b = route.backends
    assert a.id == a.url == "http://127.0.0.1:8001" and a.upstream_model == "tiny"
    assert b.id == "b2" and b.url == "http://localhost:8002" and b.weight == 1.0
    # Same content in another key order -> same revision; any change -> another.
    again = parse_routes(
        {
            "models": [
                {
                    "backends": [
                        backend(8001),
                        {"id": "b2", "version": "v2", "url": "http://localhost:8002"},
                    ],
                    "alias": "tiny",
                }
            ]
        }
    )
    assert again.revision == t.revision
    assert RoutesTable.of(t.models.values()).revision == t.revision
    assert parse_routes(t.to_obj()) == t
    changed = table(
        model(
            backends=[backend(8001, weight=2), {"url": "http://localhost:8002", "version": "v2", "id": "b2"}]
        )
    )
    assert changed.revision != t.revision


def test_metrics_url_defaults_to_the_frontends_own_and_round_trips() -> None:
    plain = table(model(backends=[backend(8001)]))
    (b,) = plain.models["tiny"].backends
    assert b.metrics_url is None and b.metrics_endpoint == "http://127.0.0.1:8001/metrics"
    # A table without it keeps its file form (and so its revision) as before.
    assert "metrics_url" not in plain.to_obj()["models"][0]["backends"][0]
    proxied = table(model(backends=[backend(8001, metrics_url="http://127.0.0.1:9100/metrics")]))
    (p,) = proxied.models["tiny"].backends
    assert p.metrics_endpoint == "http://127.0.0.1:9100/metrics"
    assert parse_routes(proxied.to_obj()) == proxied and proxied.revision != plain.revision


# -- versions -------------------------------------------------------------------------------


def two_versions(**extra: Any) -> RoutesTable:
    return table(model(backends=[backend(8001, "v1"), backend(8002, "v2")], **extra))


def test_version_pin_and_current() -> None:
    r = Router(two_versions(current="v1"))
    assert Router.split_model("tiny@v2") == ("tiny", "v2")
    assert Router.split_model("tiny") == ("tiny", None)
    assert {r.pick("tiny", sticky_key=str(i)).version for i in range(50)} == {"v1"}
    pinned = {r.pick("tiny@v2", sticky_key=str(i)) for i in range(50)}
    assert {(p.alias, p.version, p.backend.url) for p in pinned} == {("tiny", "v2", "http://127.0.0.1:8002")}
    # No current, no split: both versions serve the bare alias.
    r.set_table(two_versions())
    assert {r.pick("tiny", sticky_key=str(i)).version for i in range(200)} == {"v1", "v2"}


@pytest.mark.parametrize("name", ["tiny@v3", "nope", "nope@v1", "tiny@", "tiny@v1@v1"])
def test_unknown_model_or_version_is_404_worded_like_not_allowed(name: str) -> None:
    r = Router(two_versions())
    with pytest.raises(GatewayError) as e:
        r.pick(name, sticky_key="k")
    expected = ModelNotAllowedError(name)
    got = e.value
    assert (got.status, got.message, got.code, got.param, got.headers) == (
        expected.status,
        expected.message,
        expected.code,
        expected.param,
        expected.headers,
    )
    with pytest.raises(GatewayError):
        r.route(name)


def test_sticky_split_is_stable_and_shared_by_replicas() -> None:
    t = two_versions(split={"v1": 0.7, "v2": 0.3})
    a, b = Router(t, rng=random.Random(1)), Router(t, rng=random.Random(2))
    for key in ("alice", "bob", "tenant-7", ""):
        first = a.pick("tiny", sticky_key=key).version
        assert {a.pick("tiny", sticky_key=key).version for _ in range(1000)} == {first}
        assert b.pick("tiny", sticky_key=key).version == first


def test_split_shares_over_many_keys() -> None:
    r = Router(two_versions(split={"v1": 0.8, "v2": 0.2}))
    counts = Counter(r.pick("tiny", sticky_key=f"user-{i}").version for i in range(10_000))
    # Binomial sd = sqrt(10000 * 0.8 * 0.2) = 40: five sd either side.
    assert abs(counts["v2"] - 2000) < 200, counts
    # A version with share 0 gets nobody; current overrides the split.
    r.set_table(two_versions(split={"v1": 1, "v2": 0}))
    assert {r.pick("tiny", sticky_key=f"u{i}").version for i in range(500)} == {"v1"}
    r.set_table(two_versions(split={"v1": 1, "v2": 0}, current="v2"))
    assert {r.pick("tiny", sticky_key=f"u{i}").version for i in range(100)} == {"v2"}


def test_chosen_version_down_is_503_not_another_version() -> None:
    r = Router(two_versions(current="v2"))
    r.set_ready("http://127.0.0.1:8002", False)
    with pytest.raises(NoBackendError) as e:
        r.pick("tiny", sticky_key="k")
    assert e.value.status == 503 and e.value.headers["Retry-After"]
    assert "none of its 1 backend is healthy" in e.value.message


# -- strategies ---------------------------------------------------------------------------


def test_weighted_shares() -> None:
    t = table(
        model(
            strategy="weighted",
            backends=[backend(8001, weight=3), backend(8002, weight=1), backend(8003, weight=0)],
        )
    )
    r = Router(t, rng=random.Random(7))
    counts = Counter(r.pick("tiny", sticky_key="k").backend.url for _ in range(10_000))
    assert "http://127.0.0.1:8003" not in counts
    # Expected 7500; sd = sqrt(10000 * .75 * .25) ~ 43.
    assert abs(counts["http://127.0.0.1:8001"] - 7500) < 250, counts


def test_least_outstanding_picks_the_idle_backend() -> None:
    r = Router(table(model(backends=[backend(8001), backend(8002), backend(8003)])), rng=random.Random(3))
    for url in ("http://127.0.0.1:8001", "http://127.0.0.1:8003"):
        r.begin(url)
        r.begin(url)
    assert {r.pick("tiny", sticky_key="k").backend.url for _ in range(50)} == {"http://127.0.0.1:8002"}
    # Ties break randomly: with all idle, every backend gets picked.
    r2 = Router(table(model(backends=[backend(8001), backend(8002), backend(8003)])), rng=random.Random(3))
    assert len({r2.pick("tiny", sticky_key="k").backend.url for _ in range(100)}) == 3


def affinity_table(n: int = 4, **extra: Any) -> RoutesTable:
    return table(model(strategy="prefix_affinity", backends=[backend(8001 + i) for i in range(n)], **extra))


def test_prefix_affinity_same_prefix_same_backend() -> None:
    r = Router(affinity_table())
    for i in range(50):
        key = f"system prompt {i}".encode()
        first = r.pick("tiny", sticky_key="k", affinity=key).backend.id
        assert {r.pick("tiny", sticky_key=str(j), affinity=key).backend.id for j in range(20)} == {first}
    spread = {r.pick("tiny", sticky_key="k", affinity=f"p{i}".encode()).backend.id for i in range(200)}
    assert len(spread) == 4


def test_prefix_affinity_bounded_load_spreads_a_hot_prefix() -> None:
    c = 1.25
    r = Router(affinity_table(), bounded_load=c, bounded_load_slack=0)
    hot = b"the one hot system prompt"
    held = []
    for _ in range(40):
        p = r.pick("tiny", sticky_key="k", affinity=hot)
        r.begin(p.backend.id)
        held.append(p.backend.id)
    loads = Counter(held)
    assert len(loads) == 4, loads
    bound = math.ceil(c * 40 / 4) + 1
    assert max(loads.values()) <= bound, loads
    home = Router(affinity_table()).pick("tiny", sticky_key="k", affinity=hot).backend.id
    assert held[0] == home and loads[home] == max(loads.values())
    for backend_id in held:
        r.end(backend_id, ok=True)
    # Once the load is gone the hot prefix goes home again.
    assert r.pick("tiny", sticky_key="k", affinity=hot).backend.id == home


def test_prefix_affinity_slack_keeps_a_small_swing_home() -> None:
    # The request cap alone (load_weight 0: no load score; hit_cost 1: every request costs
    # one, so the load cap counts requests): 2 backends, the 20th request (19 in flight, fair
    # share 20 / 2): c = 1.25 caps the home at ceil(1.25 * 10) = 13, a slack of 8 at 10 + 8 =
    # 18, and the home fills to its cap.
    held = {}
    for slack in (0, 8):
        r = Router(
            affinity_table(2), bounded_load=1.25, bounded_load_slack=slack, load_weight=0, hit_cost=1.0
        )
        picks = []
        for _ in range(20):
            p = r.pick("tiny", sticky_key="k", affinity=b"hot")
            r.begin(p.backend.id)
            picks.append(p.backend.id)
        held[slack] = max(Counter(picks).values())
    assert held[0] == 13 and held[8] == 18, held
    with pytest.raises(ValueError, match="bounded_load_slack"):
        Router(affinity_table(2), bounded_load_slack=-1)


def test_prefix_affinity_removing_a_backend_remaps_only_its_keys() -> None:
    r = Router(affinity_table(4))
    keys = [f"prefix-{i}".encode() for i in range(4000)]
    before = {k: r.pick("tiny", sticky_key="s", affinity=k).backend.id for k in keys}
    gone = "http://127.0.0.1:8004"
    assert 0.2 <= sum(1 for v in before.values() if v == gone) / len(keys) <= 0.3
    # A retry excluding it sends its keys elsewhere for that request only; the others stay.
    excluded = {k: r.pick("tiny", sticky_key="s", affinity=k, exclude=[gone]).backend.id for k in keys}
    assert all(excluded[k] == before[k] for k in keys if before[k] != gone)
    assert gone not in excluded.values()
    assert {k: r.pick("tiny", sticky_key="s", affinity=k).backend.id for k in keys} == before
    # Removing it from the table reassigns exactly its keys, spread over the rest.
    r.set_table(affinity_table(3))
    after = {k: r.pick("tiny", sticky_key="s", affinity=k).backend.id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert {before[k] for k in moved} == {gone}
    assert len(moved) == sum(1 for v in before.values() if v == gone)
    fair = len(keys) / 3
    assert max(Counter(after.values()).values()) <= math.ceil(fair) + math.floor((PREFIX_BOUND - 1) * fair)


def test_prefix_affinity_fresh_routers_mostly_agree() -> None:
    # Gateway replicas assign prefixes independently: hashing places almost every prefix, and
    # only the ones the prefix bound moves off a full backend depend on arrival order.
    keys = [f"prefix-{i}".encode() for i in range(2000)]
    a, b = Router(affinity_table(4)), Router(affinity_table(4))
    in_order = {k: a.pick("tiny", sticky_key="s", affinity=k).backend.id for k in keys}
    reverse = {k: b.pick("tiny", sticky_key="s", affinity=k).backend.id for k in reversed(keys)}
    agree = sum(1 for k in keys if in_order[k] == reverse[k]) / len(keys)
    assert agree >= 0.8, agree


@pytest.mark.parametrize(("n_keys", "n_backends"), [(16, 2), (16, 4), (5, 2), (3, 3), (40, 7)])
def test_prefix_affinity_balances_few_prefixes(n_keys: int, n_backends: int) -> None:
    # Hashing 16 prefixes onto 2 backends is often 10/6 or worse; below 10 per backend the
    # prefix bound makes it as even as the counts allow, and each prefix stays where it was put.
    for seed in range(20):
        r = Router(affinity_table(n_backends))
        keys = [f"system prompt {seed}-{i}".encode() for i in range(n_keys)]
        owner = {k: r.pick("tiny", sticky_key="s", affinity=k).backend.id for k in keys}
        counts = Counter(owner.values())
        assert max(counts.values()) <= math.ceil(n_keys / n_backends), counts
        assert len(counts) == min(n_keys, n_backends)
        for k in keys:
            assert r.pick("tiny", sticky_key="other", affinity=k).backend.id == owner[k]


def test_prefix_affinity_prefix_bound_follows_weights() -> None:
    backends = [backend(8001, weight=1), backend(8002, weight=1), backend(8003, weight=2)]
    r = Router(table(model(strategy="prefix_affinity", backends=backends)))
    owner = [r.pick("tiny", sticky_key="s", affinity=f"k{i}".encode()).backend.id for i in range(40)]
    assert sorted(Counter(owner).values()) == [10, 10, 20]


def test_prefix_affinity_forgets_idle_prefixes() -> None:
    clock = Clock()
    r = Router(affinity_table(2), clock=clock, affinity_key_ttl_s=60)
    keys = [f"k{i}".encode() for i in range(16)]
    for k in keys:
        r.pick("tiny", sticky_key="s", affinity=k)
    assert sum(s["affinity_prefixes"] for s in r.snapshot().values()) == 16
    clock.now += 30
    r.pick("tiny", sticky_key="s", affinity=keys[0])
    clock.now += 31
    r.pick("tiny", sticky_key="s", affinity=b"new")
    # Only the prefix seen 31 s ago and the new one are still live.
    assert sum(s["affinity_prefixes"] for s in r.snapshot().values()) == 2
    bounded = Router(affinity_table(2), max_affinity_keys=5)
    for k in keys:
        bounded.pick("tiny", sticky_key="s", affinity=k)
    assert sum(s["affinity_prefixes"] for s in bounded.snapshot().values()) == 5
    with pytest.raises(ValueError, match="affinity_key_ttl_s"):
        Router(affinity_table(2), affinity_key_ttl_s=0)
    with pytest.raises(ValueError, match="max_affinity_keys"):
        Router(affinity_table(2), max_affinity_keys=0)


def test_prefix_affinity_route_bounded_load_overrides_the_default() -> None:
    t = affinity_table(4, bounded_load=2.0, bounded_load_slack=0)
    assert t.models["tiny"].bounded_load == 2.0 and t.models["tiny"].bounded_load_slack == 0
    assert parse_routes(t.to_obj()) == t
    assert t.revision != affinity_table(4).revision and affinity_table(4).models["tiny"].bounded_load is None
    loads = {}
    for name, tbl in (("route", t), ("default", affinity_table(4))):
        # The cap alone: the load score would spread the hot prefix before either cap.
        r = Router(tbl, bounded_load=1.25, bounded_load_slack=0, load_weight=0)
        held = []
        for _ in range(40):
            p = r.pick("tiny", sticky_key="k", affinity=b"hot")
            r.begin(p.backend.id)
            held.append(p.backend.id)
        loads[name] = max(Counter(held).values())
    assert loads["default"] <= math.ceil(1.25 * 40 / 4) + 1
    assert math.ceil(1.25 * 40 / 4) + 1 < loads["route"] <= math.ceil(2.0 * 40 / 4) + 1


A, B = "http://127.0.0.1:8001", "http://127.0.0.1:8002"


def owned_by(r: Router, backend_id: str, tag: str = "") -> bytes:
    """A prefix the router assigns to `backend_id` (assigned by this call, both idle)."""
    for i in range(1000):
        key = f"system prompt {tag}{i}".encode()
        if r.pick("tiny", sticky_key="s", affinity=key).backend.id == backend_id:
            return key
    raise AssertionError(f"no prefix lands on {backend_id}")


def test_prefix_affinity_with_equal_load_the_owner_wins() -> None:
    r = Router(affinity_table(2))
    keys = [owned_by(r, A), owned_by(r, B)]
    for load in (0, 1, 5, 30):
        for backend_id in (A, B):
            while r.snapshot()[backend_id]["outstanding"] < load:
                r.begin(backend_id)
        for _ in range(3):
            assert r.pick("tiny", sticky_key="x", affinity=keys[0]).backend.id == A
            assert r.pick("tiny", sticky_key="x", affinity=keys[1]).backend.id == B
    # Equal engine gauges change nothing either.
    for backend_id in (A, B):
        r.observe_load(backend_id, waiting=4, kv_usage=0.9)
    assert r.pick("tiny", sticky_key="x", affinity=keys[0]).backend.id == A


def test_prefix_affinity_moves_off_a_loaded_owner_to_the_idle_backend() -> None:
    r = Router(affinity_table(2))
    key = owned_by(r, A)
    # A few more in flight on the owner are within its margin (a spill costs a prefill).
    for _ in range(3):
        r.begin(A)
    assert r.pick("tiny", sticky_key="x", affinity=key).backend.id == A
    # 12 of ours in flight on the owner, none on the other: below the request cap
    # (max(ceil(1.25 * 6.5), 7 + 8) = 15), so only the load score moves the request.
    for _ in range(9):
        r.begin(A)
    assert r.pick("tiny", sticky_key="x", affinity=key).backend.id == B
    # The prefix stays assigned to A: once the load is gone it goes home.
    for _ in range(12):
        r.end(A, ok=True)
    assert r.pick("tiny", sticky_key="x", affinity=key).backend.id == A


def test_prefix_affinity_weighs_the_engines_queue_and_kv_gauges() -> None:
    clock = Clock()
    r = Router(affinity_table(2), clock=clock, load_gauge_ttl_s=10)
    queued, full = owned_by(r, A, "q"), owned_by(r, A, "f")
    # Nothing of ours in flight (another gateway's requests fill A): its waiting queue moves it.
    r.observe_load(A, waiting=12, kv_usage=0.5)
    r.observe_load(B, waiting=0, kv_usage=0.5)
    assert r.pick("tiny", sticky_key="x", affinity=queued).backend.id == B
    # A gauge older than load_gauge_ttl_s no longer counts.
    clock.now += 10
    assert r.pick("tiny", sticky_key="x", affinity=queued).backend.id == A
    # KV usage: a full cache on the owner vs an empty one tips a request over a small
    # in-flight lead that the load score alone keeps home.
    for _ in range(3):
        r.begin(A)
    r.observe_load(A, waiting=0, kv_usage=0.4)
    r.observe_load(B, waiting=0, kv_usage=0.4)
    assert r.pick("tiny", sticky_key="x", affinity=full).backend.id == A
    r.observe_load(A, waiting=0, kv_usage=1.0)
    r.observe_load(B, waiting=0, kv_usage=0.0)
    assert r.pick("tiny", sticky_key="x", affinity=full).backend.id == B
    # Bad gauges are refused; unknown ids ignored.
    for bad in ({"waiting": -1}, {"waiting": math.nan}, {"waiting": True}, {"waiting": 0, "kv_usage": 1.5}):
        with pytest.raises(ValueError):
            r.observe_load(A, **bad)
    r.observe_load("http://127.0.0.1:9999", waiting=1)
    for name in ("prefix_weight", "load_weight", "kv_weight"):
        with pytest.raises(ValueError, match=name):
            Router(affinity_table(2), **{name: -1})
    with pytest.raises(ValueError, match="load_smoothing"):
        Router(affinity_table(2), load_smoothing=0)
    with pytest.raises(ValueError, match="load_gauge_ttl_s"):
        Router(affinity_table(2), load_gauge_ttl_s=math.inf)


def test_saturated_only_when_every_candidate_reports_a_full_admission_queue() -> None:
    clock = Clock()
    a, b = "http://127.0.0.1:8001", "http://127.0.0.1:8002"
    r = Router(table(model(backends=[backend(8001), backend(8002)])), clock=clock, load_gauge_ttl_s=10)
    # No gauges: unknown room is room.
    assert not r.saturated("tiny", sticky_key="k")
    r.observe_load(a, waiting=3, queued=4, max_queued=4)
    assert not r.saturated("tiny", sticky_key="k")
    # The full one is not picked while the other has room.
    assert {r.pick("tiny", sticky_key="k").backend.id for _ in range(8)} == {b}
    r.observe_load(b, waiting=9, queued=5, max_queued=4)
    assert r.saturated("tiny", sticky_key="k")
    assert r.snapshot()[b]["gauges"] == {
        "waiting": 9.0,
        "kv_usage": None,
        "queued": 5.0,
        "max_queued": 4.0,
        "age_s": 0.0,
        "full": True,
    }
    # Both full: pick still answers (the caller decides to hold or to forward).
    assert r.pick("tiny", sticky_key="k").backend.id in (a, b)
    # Only candidates count: one excluded or not ready leaves the full other.
    assert r.saturated("tiny", sticky_key="k", exclude={a})
    # Our own traffic moves the estimate between scrapes: a request we began there before
    # the scrape ending frees a place on `a` at once; one more begun fills it again.
    r.begin(a)
    r.observe_load(a, waiting=3, queued=4, max_queued=4)
    r.end(a, ok=True)
    assert not r.saturated("tiny", sticky_key="k")
    assert r.pick("tiny", sticky_key="k").backend.id == a
    r.begin(a)
    assert r.saturated("tiny", sticky_key="k")
    # Stale gauges never hold a request.
    clock.now += 10
    assert not r.saturated("tiny", sticky_key="k")
    assert r.snapshot()[a]["gauges"]["full"] is False
    # Gauges without the frontend's admission pair (not a paved frontend): never full.
    r.observe_load(a, waiting=1000, kv_usage=1.0)
    r.observe_load(b, waiting=1000, kv_usage=1.0)
    assert not r.saturated("tiny", sticky_key="k")
    # No candidate at all is not "saturated" (pick raises its own error).
    r.set_ready(a, False)
    r.set_ready(b, False)
    assert not r.saturated("tiny", sticky_key="k")
    with pytest.raises(GatewayError):
        r.saturated("nope", sticky_key="k")
    for bad in (
        {"waiting": 0, "queued": 1},
        {"waiting": 0, "queued": -1, "max_queued": 1},
        {"waiting": 0, "queued": 1, "max_queued": math.inf},
        {"waiting": 0, "queued": True, "max_queued": 1},
    ):
        with pytest.raises(ValueError):
            r.observe_load(a, **bad)


def test_saturated_reads_the_version_pick_would_serve() -> None:
    r = Router(two_versions())
    r.observe_load("http://127.0.0.1:8001", waiting=0, queued=2, max_queued=2)
    assert r.saturated("tiny@v1", sticky_key="k")
    assert not r.saturated("tiny@v2", sticky_key="k")
    assert not r.saturated("tiny", sticky_key="k")  # both versions eligible: v2 has room


def test_prefix_affinity_spills_a_prefix_to_where_it_spilled_before() -> None:
    # Once a request of the prefix went to B, B's cache holds it for a while: the next spill of
    # that prefix needs half the owner's lead, while another of A's prefixes still stays home.
    r = Router(affinity_table(2))
    spilled, other = owned_by(r, A, "s"), owned_by(r, A, "o")
    for _ in range(12):
        r.begin(A)
    assert r.pick("tiny", sticky_key="x", affinity=spilled).backend.id == B
    for _ in range(9):
        r.end(A, ok=True)
    # A leads by 3: the held prefix goes to B, the other stays on its owner.
    assert r.pick("tiny", sticky_key="x", affinity=spilled).backend.id == B
    assert r.pick("tiny", sticky_key="x", affinity=other).backend.id == A
    # B has begun many requests since: the prefix is likely evicted there, so it stays home.
    for _ in range(HOLDER_FRESH_REQUESTS + 1):
        r.begin(B)
        r.end(B, ok=True)
    assert r.pick("tiny", sticky_key="x", affinity=spilled).backend.id == A


def test_prefix_affinity_weighs_work_not_requests() -> None:
    # 12 requests of A's prefix in flight on A, each a prefix-cache hit there (its Pick.cost,
    # hit_cost 0.2): 2.4 of work against the other's 0, within the owner's margin. Counted in
    # requests (hit_cost 1) the same 12 move the next one to B (a full prefill and an eviction).
    for hit_cost, home in ((0.2, A), (1.0, B)):
        r = Router(affinity_table(2), hit_cost=hit_cost)
        key = owned_by(r, A)
        first = r.pick("tiny", sticky_key="x", affinity=key)
        assert first.backend.id == A and first.cost == pytest.approx(hit_cost)
        for _ in range(12):
            r.begin(A, first.cost)
        assert r.pick("tiny", sticky_key="x", affinity=key).backend.id == home
        # Ended with their costs, the work is gone: equal (zero) loads, the owner wins.
        for _ in range(12):
            r.end(A, ok=True, cost=first.cost)
        assert r.pick("tiny", sticky_key="x", affinity=key).backend.id == A
    # A miss costs the full 1: a prefix new to B's cache is dearer there than at its owner.
    r = Router(affinity_table(2))
    key = owned_by(r, A)
    for _ in range(30):
        r.begin(B)  # another gateway's misses keep B loaded
    p = r.pick("tiny", sticky_key="x", affinity=key)
    assert (p.backend.id, p.cost) == (A, pytest.approx(0.2))
    with pytest.raises(ValueError, match="hit_cost"):
        Router(affinity_table(2), hit_cost=0)
    for bad in (1.5, math.nan, True, -0.1):
        with pytest.raises(ValueError, match="hit_cost"):
            Router(affinity_table(2), hit_cost=bad)


def test_prefix_affinity_a_hot_prefix_still_spreads_by_work() -> None:
    # One prefix only, every request of it begun with its cost and kept in flight: cheap hits
    # pile on the owner only until its work leads by the margin; then the other backend takes
    # requests (misses first, then hits of a prefix it now holds), and neither backend carries
    # more than its load cap.
    r = Router(affinity_table(2))
    key = owned_by(r, A)
    counts: Counter[str] = Counter()
    work: Counter[str] = Counter()
    for _ in range(200):
        p = r.pick("tiny", sticky_key="x", affinity=key)
        r.begin(p.backend.id, p.cost)
        counts[p.backend.id] += 1
        work[p.backend.id] += p.cost
    assert counts[A] > counts[B] > 0, counts
    total = work[A] + work[B]
    assert max(work.values()) <= max(1.25 * total / 2, total / 2 + 8) + 1, work


def test_prefix_affinity_counts_only_the_engine_queue_beyond_our_requests() -> None:
    clock = Clock()
    r = Router(affinity_table(2), clock=clock)
    key = owned_by(r, A)
    for _ in range(10):
        p = r.pick("tiny", sticky_key="x", affinity=key)
        assert p.backend.id == A
        r.begin(A, p.cost)
    # The engine queues our 10 (all waiting): they are in the work already, not again.
    r.observe_load(A, waiting=10)
    r.observe_load(B, waiting=0)
    assert r.pick("tiny", sticky_key="x", affinity=key).backend.id == A
    # 20 more waiting there are another gateway's: those count, and the request moves.
    r.observe_load(A, waiting=30)
    assert r.pick("tiny", sticky_key="x", affinity=key).backend.id == B


def test_prefix_affinity_without_affinity_is_least_outstanding() -> None:
    r = Router(affinity_table(2))
    r.begin("http://127.0.0.1:8001")
    assert {r.pick("tiny", sticky_key="k").backend.id for _ in range(20)} == {"http://127.0.0.1:8002"}


# -- ejection and readiness ---------------------------------------------------------------


def test_ejection_after_consecutive_failures_and_return() -> None:
    clock = Clock()
    r = Router(
        table(model(backends=[backend(8001), backend(8002)])),
        eject_after_failures=3,
        eject_base_s=5,
        eject_max_s=12,
        clock=clock,
    )
    bad = "http://127.0.0.1:8001"
    for ok in (False, False, True, False, False):  # a success resets the count
        r.begin(bad)
        r.end(bad, ok=ok)
    assert r.snapshot()[bad]["ejected_until"] is None
    r.begin(bad)
    r.end(bad, ok=False)
    assert r.snapshot()[bad]["ejected_until"] == clock.now + 5
    assert {r.pick("tiny", sticky_key="k").backend.id for _ in range(20)} == {"http://127.0.0.1:8002"}
    clock.now += 5
    assert bad in {r.pick("tiny", sticky_key="k").backend.id for _ in range(50)}
    # Back on probation: one failure re-ejects, for longer (5 * 2), then capped at eject_max_s.
    r.begin(bad)
    r.end(bad, ok=False)
    assert r.snapshot()[bad]["ejected_until"] == clock.now + 10
    clock.now += 10
    r.begin(bad)
    r.end(bad, ok=False)
    assert r.snapshot()[bad]["ejected_until"] == clock.now + 12
    clock.now += 12
    r.begin(bad)
    r.end(bad, ok=True)  # probation passed
    r.begin(bad)
    r.end(bad, ok=False)
    assert r.snapshot()[bad]["ejected_until"] is None


def test_max_ejection_percent_keeps_half_the_fleet() -> None:
    clock = Clock()
    urls = [f"http://127.0.0.1:{8001 + i}" for i in range(4)]
    r = Router(
        table(model(backends=[backend(8001 + i) for i in range(4)])), eject_after_failures=1, clock=clock
    )
    for url in urls:
        r.begin(url)
        r.end(url, ok=False)
    ejected = [u for u, s in r.snapshot().items() if s["ejected_until"] is not None]
    assert len(ejected) == 2
    assert {r.pick("tiny", sticky_key="k").backend.id for _ in range(50)} == set(urls) - set(ejected)
    # A single backend is never passively ejected.
    solo = Router(table(model()), eject_after_failures=1, clock=clock)
    for _ in range(10):
        solo.begin("http://127.0.0.1:8001")
        solo.end("http://127.0.0.1:8001", ok=False)
    assert solo.pick("tiny", sticky_key="k").backend.id == "http://127.0.0.1:8001"
    # Readiness failures remove backends regardless.
    solo.set_ready("http://127.0.0.1:8001", False)
    with pytest.raises(NoBackendError, match="none of its 1 backend"):
        solo.pick("tiny", sticky_key="k")
    solo.set_ready("http://127.0.0.1:8001", True)
    assert solo.pick("tiny", sticky_key="k").backend.id == "http://127.0.0.1:8001"


def test_set_table_keeps_state_of_surviving_backends() -> None:
    r = Router(table(model(backends=[backend(8001), backend(8002)])))
    r.begin("http://127.0.0.1:8001")
    r.begin("http://127.0.0.1:8001")
    r.begin("http://127.0.0.1:8002")
    r.set_ready("http://127.0.0.1:8001", False)
    r.set_table(table(model(backends=[backend(8001), backend(8003)])))
    snap = r.snapshot()
    assert (
        snap["http://127.0.0.1:8001"]["outstanding"] == 2 and snap["http://127.0.0.1:8001"]["ready"] is False
    )
    assert snap["http://127.0.0.1:8003"]["outstanding"] == 0
    # The removed backend's request ends cleanly and its state goes.
    assert snap["http://127.0.0.1:8002"]["routed"] is False
    assert r.pick("tiny", sticky_key="k").backend.id == "http://127.0.0.1:8003"
    r.end("http://127.0.0.1:8002", ok=False)
    assert "http://127.0.0.1:8002" not in r.snapshot()
    r.end("http://127.0.0.1:8002", ok=True)  # an extra end is harmless
    assert r.aliases() == ["tiny"]
    # A request begun on a backend swapped out between pick and begin still ends cleanly.
    r.begin("ghost")
    r.end("ghost", ok=True)
    assert "ghost" not in r.snapshot()


# -- properties -----------------------------------------------------------------------------

_backend_spec = st.tuples(
    st.sampled_from(["v1", "v2"]),
    st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    st.booleans(),  # ready
    st.booleans(),  # excluded
    st.integers(0, 5),  # failures
    st.integers(0, 4),  # outstanding
)


@settings(max_examples=200, deadline=None)
@given(
    specs=st.lists(_backend_spec, min_size=1, max_size=8),
    strategy=st.sampled_from(["least_outstanding", "weighted", "prefix_affinity"]),
    model_name=st.sampled_from(["tiny", "tiny@v1", "tiny@v2"]),
    affinity=st.none() | st.binary(max_size=16),
    sticky=st.text(max_size=8),
    split=st.booleans(),
)
def test_pick_never_returns_an_unusable_backend(
    specs: list[tuple[str, float, bool, bool, int, int]],
    strategy: str,
    model_name: str,
    affinity: bytes | None,
    sticky: str,
    split: bool,
) -> None:
    backends = [backend(9000 + i, v, w) for i, (v, w, *_rest) in enumerate(specs)]
    versions = sorted({v for v, *_ in specs})
    extra: dict[str, Any] = {"split": dict.fromkeys(versions, 1.0)} if split else {}
    r = Router(
        table(model(backends=backends, strategy=strategy, **extra)),
        eject_after_failures=2,
        rng=random.Random(0),
    )
    excluded = set()
    for b, (_v, _w, ready, excl, failures, outstanding) in zip(backends, specs, strict=True):
        url = b["url"]
        r.set_ready(url, ready)
        if excl:
            excluded.add(url)
        for _ in range(failures):
            r.begin(url)
            r.end(url, ok=False)
        for _ in range(outstanding):
            r.begin(url)
    snap = r.snapshot()
    usable = {
        b["url"]
        for b, (v, w, *_r) in zip(backends, specs, strict=True)
        if w > 0
        and snap[b["url"]]["ready"]
        and snap[b["url"]]["ejected_until"] is None
        and b["url"] not in excluded
    }
    _, pinned = Router.split_model(model_name)
    if pinned is not None and pinned not in versions:
        with pytest.raises(GatewayError) as e:
            r.pick(model_name, sticky_key=sticky, affinity=affinity, exclude=excluded)
        assert e.value.status == 404
        return
    try:
        p = r.pick(model_name, sticky_key=sticky, affinity=affinity, exclude=excluded)
    except NoBackendError:
        # No usable backend in the versions this request may use: the pinned one, else the
        # split's sticky choice (a split never falls back to another version, even when the
        # chosen one has only weight-0 backends), else every version.
        if pinned:
            chosen = {pinned}
        elif split:
            chosen = set(r._versions(r.route(model_name), None, sticky))
        else:
            chosen = set(versions)
        offending = [b["url"] for b in backends if b["url"] in usable and b["version"] in chosen]
        assert offending == []
        return
    assert p.backend.id in usable
    if pinned:
        assert p.version == pinned


# -- regions --------------------------------------------------------------------------------


def test_home_region_is_preferred_and_others_take_over_when_it_has_no_healthy_backend():
    t = table(
        model(
            backends=[
                backend(8001, region="eu"),
                backend(8002, region="eu"),
                backend(8003, region="us"),
            ]
        )
    )
    r = Router(t, region="us")
    assert {r.pick("tiny", sticky_key="k").backend.id for _ in range(50)} == {"http://127.0.0.1:8003"}
    r.set_ready("http://127.0.0.1:8003", False)
    assert {r.pick("tiny", sticky_key="k").backend.id for _ in range(50)} == {
        "http://127.0.0.1:8001",
        "http://127.0.0.1:8002",
    }
    # Without a home region every region serves.
    anywhere = Router(t)
    assert len({anywhere.pick("tiny", sticky_key="k").backend.id for _ in range(200)}) == 3

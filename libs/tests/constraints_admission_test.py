"""Spec admission (memoized, identity-trusted), enum lowering, the compile cache's byte budget
and in-flight compiles, preemption bookkeeping without pinning, and the Unicode check."""

from __future__ import annotations

import gc
import json
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paved.constraints import spec as specs
from paved.constraints.tracking import CompileCache, first_seen
from paved.engine import text


# ---- enum lowering ---------------------------------------------------------------------------
def test_enum_of_strings_becomes_a_catalogue_of_json_texts():
    lowered = specs.enum_as_choice({"enum": ["a", 'say "hi"', "é"], "title": "t"})
    assert lowered == {
        "type": "choice",
        "items": ['"a"', '"say \\"hi\\""', '"\\u00e9"'],
        "k": 1,
        "separator": ", ",
        "distinct": False,
    }
    assert specs.enum_as_choice({"const": 3})["items"] == ["3"]
    assert specs.enum_as_choice({"enum": [1, None, {"b": [1, 2]}]})["items"] == ["1", "null", '{"b":[1,2]}']
    # `type` filters values the schema could never accept.
    assert specs.enum_as_choice({"type": "string", "enum": ["x", 1]})["items"] == ['"x"']
    assert specs.enum_as_choice({"type": "integer", "enum": [True, 1.5, 2]})["items"] == ["2"]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string"},
        {"enum": []},
        {"enum": ["a"], "minLength": 2},  # another keyword constrains the values
        {"enum": ["a"], "const": "a"},
        {"type": "integer", "enum": ["a"]},  # nothing left to choose
        {"type": "strange", "enum": ["a"]},
        {"enum": ["x" * (specs.MAX_CHOICE_ITEM_BYTES + 1)]},
        {"enum": [float("nan")]},
    ],
)
def test_schemas_that_stay_on_the_schema_path(schema):
    assert specs.enum_as_choice(schema) is None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.one_of(st.text(max_size=8), st.integers(), st.booleans(), st.none()), min_size=1, max_size=8)
)
def test_every_lowered_item_parses_back_to_an_enum_value(values):
    lowered = specs.enum_as_choice({"enum": values})
    assert lowered is not None
    assert [json.loads(item) for item in lowered["items"]] == values


def test_json_schema_specs_are_lowered_by_validation():
    spec = specs.validate_spec({"type": "json_schema", "schema": {"enum": [f"v{i}" for i in range(50_000)]}})
    assert spec["type"] == "choice" and len(spec["items"]) == 50_000


# ---- admission ------------------------------------------------------------------------------
def test_admit_validates_each_distinct_spec_once(monkeypatch):
    calls = []
    real = specs.validate_spec
    monkeypatch.setattr(specs, "validate_spec", lambda raw, **kw: calls.append(raw) or real(raw, **kw))
    raw = {"type": "regex", "pattern": "admit-once-[0-9]+"}
    spec, key = specs.admit(raw)
    again, key2 = specs.admit(dict(raw))  # equal, not identical: same digest
    assert again is spec and key2 == key and len(calls) == 1
    # The JSON-text form is its own raw digest (one more check), same normalized key.
    from_text, text_key = specs.admit(json.dumps(raw))
    assert text_key == key and len(calls) == 2
    # One object per key: a holder of either stays trusted by validate_params.
    assert from_text is spec and specs.is_admitted(spec, key)


def test_admit_memoizes_errors_too(monkeypatch):
    bad = {"type": "regex", "pattern": "(unclosed"}
    with pytest.raises(ValueError) as first:
        specs.admit(bad)
    monkeypatch.setattr(specs, "validate_spec", lambda raw, **kw: pytest.fail("checked twice"))
    with pytest.raises(ValueError) as second:
        specs.admit(dict(bad))
    assert str(second.value) == str(first.value)


def test_is_admitted_is_identity_not_equality():
    spec, key = specs.admit({"type": "regex", "pattern": "identity-[a-z]"})
    assert specs.is_admitted(spec, key)
    assert not specs.is_admitted(dict(spec), key)  # an equal copy (e.g. forged) is re-validated
    assert not specs.is_admitted(spec, "0" * 64)
    assert not specs.is_admitted(spec, None)


def test_check_shape_accepts_normal_specs_only():
    spec, _ = specs.admit({"type": "choice", "items": ["a", "b"]})
    specs.check_shape(spec)
    for bad in (None, [], {"type": "choice", "items": ["a"]}, {"type": "nope"}):
        with pytest.raises(ValueError):
            specs.check_shape(bad)


# ---- compile cache -------------------------------------------------------------------------
class Compiled:
    def __init__(self, spec, size):
        self.spec, self.size = spec, size


def test_cache_evicts_least_recently_used_past_the_byte_budget():
    compiled = []

    def compile_fn(spec):
        compiled.append(spec["n"])
        return Compiled(spec, spec["size"])

    cache = CompileCache(compile_fn, capacity=100, max_bytes=100, size_of=lambda c: c.size)
    a = cache.get("a", {"n": "a", "size": 40})
    cache.get("b", {"n": "b", "size": 40})
    assert cache.get("a", {}) is a  # a hit: no compile, a becomes most recent
    cache.get("c", {"n": "c", "size": 40})  # 120 > 100: b (least recent) goes
    assert cache.peek("b") is None and cache.peek("a") is a and cache.total_bytes == 80
    # Sizes are re-measured on hits: a mask cache that grew pushes older entries out.
    a.size = 90
    cache.peek("a")
    assert cache.peek("c") is None and len(cache) == 1 and cache.total_bytes == 90
    # One entry over the whole budget is still kept: its requests need it.
    big = cache.get("d", {"n": "d", "size": 500})
    assert cache.peek("d") is big and len(cache) == 1
    assert compiled == ["a", "b", "c", "d"]


def test_concurrent_starts_share_one_background_compile_and_failures_are_final():
    gate = threading.Event()
    calls = []

    def compile_fn(spec):
        calls.append(spec)
        assert gate.wait(10)
        if spec.get("fail"):
            raise ValueError("too many states")
        return Compiled(spec, 1)

    cache = CompileCache(compile_fn, max_bytes=10, size_of=lambda c: c.size)
    with ThreadPoolExecutor(2) as pool:
        first = cache.start("k", {"x": 1}, pool)
        second = cache.start("k", {"x": 1}, pool)
        assert first is second and cache.inflight("k") is first and not first.done()
        failing = cache.start("bad", {"fail": True}, pool)
        gate.set()
        assert first.result(10).spec == {"x": 1}
        with pytest.raises(ValueError, match="too many states"):
            failing.result(10)
    assert len(calls) == 2 and cache.inflight("k") is None
    assert cache.peek("bad") is None
    # A failure is final (compiles are deterministic): asked again, no second compile.
    with pytest.raises(ValueError, match="too many states"):
        cache.get("bad", {"fail": True})
    assert cache.inflight("bad").exception() is not None and len(calls) == 2
    assert cache.start("k", {}, None).result() is first.result()


# ---- preemption bookkeeping ------------------------------------------------------------------
class Params:
    def __init__(self):
        self.extra_args = {specs.EXTRA_ARGS_KEY: {"type": "regex", "pattern": "x"}}


def test_first_seen_lives_on_the_request_and_dies_with_it():
    params = Params()
    assert first_seen(params, 10, 50) == (10, 50)
    # Re-added after preemption: the prompt grew by the folded outputs; the first values win.
    assert first_seen(params, 17, 43) == (10, 50)
    assert first_seen(Params(), 17, 43) == (17, 43)  # another request: its own values
    ref = weakref.ref(params)
    del params
    gc.collect()
    assert ref() is None  # nothing pinned it


# ---- Unicode ------------------------------------------------------------------------------
def test_unencodable_path_finds_the_first_bad_string():
    assert text.unencodable_path({"a": ["ok", {"b": "fine \U0001f600"}]}) is None
    assert text.unencodable_path({"a": ["ok", {"b": "x\ud800"}]}) == "a.1.b"
    assert text.unencodable_path(["\udfff"]) == "0"
    assert text.unencodable_path("\ud800") == "(root)"
    assert text.unencodable_path({"k\ud800": 1}) == "(root) (a key)"
    assert text.unencodable_path({"a": {"\udc00": 1}}) == "a (a key)"
    assert text.unencodable_path({"nul": "a\x00b"}) is None


def test_unencodable_path_survives_deep_nesting():
    deep: list = ["\ud800"]
    for _ in range(5000):
        deep = [deep]
    assert text.unencodable_path(deep) == ".".join(["0"] * 5001)

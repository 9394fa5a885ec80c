"""The pybind11 extension of cc/constraints, driven from Python like the vLLM adapters do.

Random walks over a synthetic byte-level vocabulary (every single byte plus multi-byte tokens
that cross JSON/regex boundaries) sample uniformly among the allowed tokens; every completed
output must satisfy the constraint (json.loads strict + jsonschema, re.fullmatch, catalogue
membership) and end with EOS within max_tokens.
"""

import collections
import inspect
import json
import random
import re
import threading

import _paved_constraints as native
import jsonschema
import numpy as np
import pytest

from paved import constraints

MULTI_BYTE_TOKENS = [
    b'{"',
    b'":',
    b'",',
    b'"}',
    b'":"',
    b"true",
    b"false",
    b"null",
    b"ab",
    b"abc",
    b"  ",
    b"\\n",
    b"\\u00",
    b"\\u",
    b"12",
    b"-1",
    b", ",
    b'"a',
    b"name",
    b"Alien",
    b"The ",
    b"}]",
    b'"]',
    b"[{",
    b"},{",
    b"0.5",
    b"e+",
    "é".encode(),
    "日本".encode(),
    b"\xe6\x97",  # a split UTF-8 character
    b"\n\t",
]
SPECIAL = 256 + len(MULTI_BYTE_TOKENS)
EOS = SPECIAL + 1
TOKENS = [bytes([b]) for b in range(256)] + MULTI_BYTE_TOKENS + [b"", b"</s>"]
VOCAB_SIZE = len(TOKENS) + 5  # padded like a model's embedding matrix
WORDS = constraints.bitmask_words(VOCAB_SIZE)


@pytest.fixture(scope="module")
def vocab():
    return native.Vocab(TOKENS, [EOS], VOCAB_SIZE)


def walk(constraint, max_tokens, seed):
    """Samples allowed tokens until EOS; returns the output bytes."""
    rng = random.Random(seed)
    state = constraint.new_state(max_tokens)
    out = bytearray()
    while not state.is_finished:
        allowed = state.allowed_tokens()
        assert allowed, f"empty mask after {bytes(out)!r}"
        token = rng.choice(allowed)
        assert state.advance(token)
        if token != EOS:
            out += TOKENS[token]
    assert state.is_accepting
    if max_tokens is not None:
        assert state.num_generated <= max_tokens
    return bytes(out)


def _mask_allowing(batch: int, vocab: int, allowed: dict[int, list[int]]) -> np.ndarray:
    mask = np.zeros((batch, constraints.bitmask_words(vocab)), dtype=np.int32)
    for row, tokens in allowed.items():
        for t in tokens:
            mask[row, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return mask


def bits_to_set(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


# --- apply_bitmask ------------------------------------------------------------------------


def test_apply_bitmask_sets_neg_inf_exactly_outside_allowed_set():
    vocab = 100
    logits = np.random.default_rng(0).standard_normal((2, vocab)).astype(np.float32)
    before = logits.copy()
    mask = _mask_allowing(2, vocab, {0: [0, 31, 32, 99], 1: list(range(vocab))})
    constraints.apply_bitmask(logits, mask)
    allowed = np.isfinite(logits[0])
    assert sorted(np.flatnonzero(allowed).tolist()) == [0, 31, 32, 99]
    np.testing.assert_array_equal(logits[0, allowed], before[0, allowed])
    np.testing.assert_array_equal(logits[1], before[1])


def test_apply_bitmask_only_touches_selected_rows():
    vocab = 64
    logits = np.zeros((3, vocab), dtype=np.float32)
    mask = _mask_allowing(3, vocab, {0: [1], 1: [2], 2: [3]})
    constraints.apply_bitmask(logits, mask, rows=[2])
    assert np.isfinite(logits[:2]).all()
    assert np.flatnonzero(np.isfinite(logits[2])).tolist() == [3]


def _misaligned(dtype, shape):
    """A writeable C-contiguous array whose data starts one byte off its dtype's alignment."""
    count = int(np.prod(shape))
    buffer = bytearray(count * np.dtype(dtype).itemsize + 1)
    return np.frombuffer(buffer, dtype=dtype, count=count, offset=1).reshape(shape)


@pytest.mark.parametrize(
    ("logits", "mask", "message"),
    [
        (np.zeros((2, 64), np.float64), np.zeros((2, 2), np.int32), "float32"),
        (np.zeros((2, 64), np.float32), np.zeros((2, 3), np.int32), "bitmask shape"),
        (np.zeros((2, 64), np.float32), np.zeros((2, 2), np.int64), "int32"),
        (np.zeros((64, 2), np.float32).T, np.zeros((2, 2), np.int32), "contiguous"),
        (_misaligned(np.float32, (2, 64)), np.zeros((2, 2), np.int32), "aligned"),
        (np.zeros((2, 64), np.float32), _misaligned(np.int32, (2, 2)), "aligned"),
    ],
)
def test_apply_bitmask_rejects_bad_arrays(logits, mask, message):
    with pytest.raises(ValueError, match=message):
        constraints.apply_bitmask(logits, mask)


def test_apply_bitmask_rejects_out_of_range_rows():
    with pytest.raises(IndexError):
        constraints.apply_bitmask(np.zeros((2, 32), np.float32), np.zeros((2, 1), np.int32), rows=[2])


# --- Vocab --------------------------------------------------------------------------------


def test_vocab_size_and_validation(vocab):
    assert vocab.size == VOCAB_SIZE
    assert native.Vocab([b"a"], [1], 2).size == 2  # EOS may lie past token_bytes
    with pytest.raises(ValueError, match="eos_token_ids must not be empty"):
        native.Vocab(TOKENS, [])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        native.Vocab(TOKENS, [VOCAB_SIZE], VOCAB_SIZE)
    with pytest.raises(ValueError, match="smaller than"):
        native.Vocab(TOKENS, [EOS], 10)
    # Only None means len(token_bytes); a negative size was taken for it.
    for size in (0, -5, 1 << 40):
        with pytest.raises(ValueError, match=r"vocab_size must be in \[1, "):
            native.Vocab([b"a"], [0], size)


def test_bitmask_words_rejects_sizes_it_cannot_count():
    assert [constraints.bitmask_words(v) for v in (0, 1, 32, 33)] == [0, 1, 1, 2]
    for size in (-100, 2**63 - 1):  # -2 words, and a signed overflow to a negative count
        with pytest.raises(ValueError, match="non-negative"):
            constraints.bitmask_words(size)


def test_padding_special_and_eos_ids_are_never_ordinary_tokens(vocab):
    c = native.Constraint.regex(vocab, r"(.|\n)*")
    state = c.new_state()
    allowed = set(state.allowed_tokens())
    assert EOS in allowed  # the empty string is accepted
    assert SPECIAL not in allowed
    assert not allowed & set(range(len(TOKENS), VOCAB_SIZE))
    assert not state.advance(SPECIAL)
    assert not state.advance(VOCAB_SIZE - 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        state.advance(VOCAB_SIZE)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        state.advance(-1)


# --- regex --------------------------------------------------------------------------------

REGEXES = [
    r"[a-z]{3,8}@(gmail|yahoo)\.com",
    r"(ab|abc)+\d{2}",
    r"\d{3}-\d{4}",
    r"(?:[A-Z][a-z]+ ){1,3}[A-Z][a-z]+",
    r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?",
    r"café|日本語?|.{1,3}",
    r"[^a-z\n]{2,5}",
    r"(?P<key>\w+)=(?P<value>\S+)(;\s?\w+=\S+)*",
    r"\s*yes|no\s*",
    r"^(true|false)$",
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_random_walks_fullmatch(vocab, pattern):
    native.check_regex(pattern)
    c = native.Constraint.regex(vocab, pattern)
    for seed in range(8):
        text = walk(c, 40, seed).decode("utf-8")
        assert re.fullmatch(pattern, text, re.ASCII), (pattern, text)


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        (r"a(?=b)", "lookahead at position 1"),
        (r"(a)\1", "backreference at position 3"),
        (r"a+?", "lazy quantifier at position 2"),
        (r"(?i)abc", "inline flags"),
        (r"[[:digit:]]", "POSIX character class"),
        (r"a{100000}", "exceeds the limit"),
        (r"(ab", "unterminated subpattern"),
        (r"\q", "bad escape"),
    ],
)
def test_regex_errors_name_construct_and_position(vocab, pattern, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        native.check_regex(pattern)
    with pytest.raises(ValueError, match=re.escape(message)):
        native.Constraint.regex(vocab, pattern)


# --- JSON Schema --------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "format": "email"},
    },
    "required": ["name", "age"],
}

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "meta": {
            "type": "object",
            "properties": {"created": {"type": "string", "format": "date"}, "n": {"type": "number"}},
            "required": ["created"],
        },
    },
    "required": ["id", "meta"],
}

SCHEMAS = [
    {"type": "string"},
    {"type": "string", "maxLength": 5},
    {"type": "string", "minLength": 3, "maxLength": 6},
    {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
    {"type": "string", "pattern": '[a-c"\\\\\\n]{1,4}'},  # characters JSON must escape
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "enum": ["red", "green", 'blue "navy"', "naïve\n"]},
    {"type": "integer"},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "integer", "exclusiveMinimum": 0},
    {"type": "integer", "maximum": -7},
    {"type": "number"},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": [1, "two", None, True, [3], {"four": 4}]},
    {"const": {"fixed": [1, 2, {"x": None}]}},
    {"type": ["string", "integer", "null"]},
    {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}]},
    {"type": "array", "items": {"type": "integer"}},
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"type": "number"}, "maxItems": 0},
    {"type": "array"},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "maxItems": 3},
    {"type": "object"},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
    PERSON,
    {
        "type": "object",
        "properties": {"p": {"type": "integer"}, "q": {"type": "string"}, "r": {"type": "boolean"}},
    },
    RECORD,
    {
        "$defs": {"person": PERSON},
        "type": "object",
        "properties": {"people": {"type": "array", "items": {"$ref": "#/$defs/person"}, "maxItems": 2}},
        "required": ["people"],
    },
    {
        "title": "Pydantic-style optional",
        "type": "object",
        "properties": {
            "nickname": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}], "default": None},
            "score": {"allOf": [{"type": "integer", "minimum": 1, "maximum": 5}], "description": "1-5"},
        },
        "required": ["score"],
    },
    {"type": "object", "properties": {"anything": {}}, "required": ["anything"]},
    {"type": "object", "properties": {"deep": {"type": "object", "properties": {"er": PERSON}}}},
    {"type": "object", "properties": {"é": {"const": "日本"}, 'a"b': {"type": "boolean"}}, "required": ["é"]},
]


@pytest.mark.parametrize("whitespace", ["compact", "standard", "free"])
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_random_walks_are_valid_json(vocab, index, whitespace):
    schema = SCHEMAS[index]
    schema_json = json.dumps(schema)
    native.check_json_schema(schema_json)
    c = native.Constraint.json_schema(vocab, schema_json, whitespace)
    budget = c.stats()["min_tokens"] + 60
    for seed in range(3):
        raw = walk(c, budget, seed + 100 * index)
        text = raw.decode("utf-8")
        value = json.loads(text)  # strict: raw control characters in strings are errors
        jsonschema.validate(value, schema)
        if whitespace != "free":
            assert all(b >= 0x20 for b in raw), raw
            skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)  # strings removed
            if whitespace == "standard":
                skeleton = skeleton.replace(", ", ",").replace(": ", ":")
            assert not re.search(r"\s", skeleton), text


def test_standard_whitespace_is_json_dumps_style(vocab):
    schema = {"const": {"a": [1, 2], "b": {"c": None}}}
    c = native.Constraint.json_schema(vocab, json.dumps(schema), "standard")
    assert walk(c, None, 0).decode() == json.dumps(schema["const"])
    c = native.Constraint.json_schema(vocab, json.dumps(schema))
    assert walk(c, None, 0).decode() == json.dumps(schema["const"], separators=(",", ":"))


def test_json_strings_reject_raw_control_characters_and_accept_escapes(vocab):
    c = native.Constraint.json_schema(vocab, '{"type":"string"}')

    def accepts(text: bytes) -> bool:
        state = c.new_state()
        return all(state.advance(b) for b in text) and state.advance(EOS)

    for ok in [b'"a\\"b"', b'"\\\\\\/\\b\\f\\n\\r\\t"', b'"\\u00e9\\uABCD"', '"é日"'.encode()]:
        assert accepts(ok), ok
        json.loads(ok)
    for bad in [b'"a\nb"', b'"\x00"', b'"\t"', b'"\\x41"', b'"\\ud800"', b'"a', b"'a'"]:
        assert not accepts(bad), bad


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            {"type": "object", "properties": {"a": {"type": "object", "patternProperties": {}}}},
            "unsupported JSON Schema keyword 'patternProperties' at $.properties.a",
        ),
        ({"type": "array", "items": {"not": {}}}, "unsupported JSON Schema keyword 'not' at $.items"),
        ({"oneOf": [{"type": "null"}]}, "unsupported JSON Schema keyword 'oneOf' at $"),
        ({"type": "object", "additionalProperties": True}, "additionalProperties"),
        ({"type": "string", "pattern": "(?<=x)y"}, "lookbehind"),
        ({"type": "number", "maximum": 3}, "'maximum' for type number"),
        ({"type": "string", "maxLength": 10**6}, "exceeds the limit"),
        ({"$ref": "#/$defs/nope"}, "does not resolve"),
    ],
)
def test_json_schema_errors_name_keyword_and_path(vocab, schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        native.check_json_schema(json.dumps(schema))
    with pytest.raises(ValueError, match=re.escape(message)):
        native.Constraint.json_schema(vocab, json.dumps(schema))


def test_json_schema_rejects_bad_documents_and_options(vocab):
    with pytest.raises(ValueError, match="not valid JSON"):
        native.check_json_schema('{"type": "string",}')
    with pytest.raises(ValueError, match="over the limit"):
        native.check_json_schema(json.dumps({"enum": ["x" * (1 << 20)]}))
    with pytest.raises(ValueError, match="whitespace must be"):
        native.Constraint.json_schema(vocab, '{"type":"null"}', "pretty")


# --- catalogue choice ---------------------------------------------------------------------

TITLES = ["Alien", "Aliens", "The Thing", "The Fly", "Up", "Heat", "Her", "It", "日本の夏", "Amélie"]


@pytest.mark.parametrize(("k", "distinct"), [(1, False), (3, False), (3, True), (len(TITLES), True)])
def test_choice_random_walks(vocab, k, distinct):
    c = native.Constraint.choice(vocab, TITLES, k=k, separator=", ", distinct=distinct)
    for seed in range(10):
        items = walk(c, None, seed).decode().split(", ")
        assert len(items) == k
        assert set(items) <= set(TITLES)
        if distinct:
            assert len(set(items)) == k


def test_choice_list_distinct_state_is_per_request(vocab):
    c = native.Constraint.choice(vocab, ["x", "y"], k=2, separator="|", distinct=True)
    first, second = c.new_state(), c.new_state()
    for b in b"x|":
        assert first.advance(b)
    assert not first.advance(ord("x"))
    assert second.advance(ord("x"))  # another request is unaffected
    assert first.advance(ord("y")) and first.is_accepting


def test_choice_errors(vocab):
    with pytest.raises(ValueError, match="catalogue is empty"):
        native.Constraint.choice(vocab, [])
    with pytest.raises(ValueError, match="distinct"):
        native.Constraint.choice(vocab, ["a", "b"], k=3, distinct=True)
    with pytest.raises(ValueError, match="ambiguous"):
        native.Constraint.choice(vocab, ["Up", "Up, Up and Away"], k=2, separator=", ")


# --- budget-aware termination -------------------------------------------------------------


def test_every_walk_ends_with_eos_within_a_tight_budget(vocab):
    cases = [
        native.Constraint.regex(vocab, r"[a-z]+( [a-z]+)*\."),
        native.Constraint.json_schema(vocab, json.dumps(RECORD), "free"),
        native.Constraint.json_schema(vocab, json.dumps({"type": "array", "items": {"type": "string"}})),
        native.Constraint.choice(vocab, TITLES, k=4, separator=" / ", distinct=True),
    ]
    for c in cases:
        low = c.stats()["min_tokens"]
        for budget in (low, low + 1, low + 5):
            for seed in range(10):
                walk(c, budget, seed)  # asserts EOS, acceptance and num_generated <= budget


def test_budget_below_the_shortest_output_is_refused(vocab):
    c = native.Constraint.regex(vocab, "hello")
    assert c.stats()["min_tokens"] == 6
    with pytest.raises(ValueError, match="max_tokens=5 is too small"):
        c.new_state(5)
    state = c.new_state(6)
    assert state.max_tokens == 6
    assert c.new_state().max_tokens is None


def test_reset_replays_from_the_start(vocab):
    c = native.Constraint.regex(vocab, "ab")
    state = c.new_state(3)
    assert state.advance(ord("a")) and state.advance(ord("b")) and state.advance(EOS)
    assert state.is_finished and state.num_generated == 3
    assert state.allowed_tokens() == [EOS]
    state.reset()
    assert (state.is_finished, state.is_accepting, state.num_generated) == (False, False, 0)
    assert state.advance(ord("a"))


# --- masks and the batch masker -----------------------------------------------------------


def make_batch(vocab):
    cs = [
        native.Constraint.regex(vocab, r"\w+@\w+\.com"),
        native.Constraint.json_schema(vocab, json.dumps(PERSON)),
        native.Constraint.choice(vocab, TITLES, k=2, distinct=True),
    ]
    states = []
    for i in range(20):
        if i % 6 == 5:
            states.append(None)
            continue
        c = cs[i % 3]
        s = c.new_state(None if i % 2 else 50)
        rng = random.Random(i)
        for _ in range(i % 7):
            allowed = [t for t in s.allowed_tokens() if t != EOS]
            if allowed:
                s.advance(rng.choice(allowed))
        states.append(s)
    return states


def test_fill_bitmask_row_matches_allowed_tokens(vocab):
    for s in make_batch(vocab):
        if s is None:
            continue
        row = np.zeros(WORDS, np.int32)
        s.fill_bitmask_row(row)
        assert bits_to_set(row) == set(s.allowed_tokens())


@pytest.mark.parametrize("threads", [1, 3])
def test_batch_masker_matches_per_state_masks(vocab, threads):
    states = make_batch(vocab)
    masker = native.BatchMasker(VOCAB_SIZE, num_threads=threads)
    bitmask = np.full((len(states), WORDS), 0x5A5A5A5A, np.int32)
    masker.fill_bitmask(states, bitmask)
    logits = np.random.default_rng(1).standard_normal((len(states), VOCAB_SIZE)).astype(np.float32)
    before = logits.copy()
    masker.apply(states, logits)
    for i, s in enumerate(states):
        if s is None:
            assert bits_to_set(bitmask[i]) == set(range(VOCAB_SIZE))
            np.testing.assert_array_equal(logits[i], before[i])
            continue
        allowed = set(s.allowed_tokens())
        assert bits_to_set(bitmask[i]) == allowed
        finite = set(np.flatnonzero(np.isfinite(logits[i])).tolist())
        assert finite == allowed
        np.testing.assert_array_equal(logits[i, sorted(allowed)], before[i, sorted(allowed)])
        assert np.all(logits[i, ~np.isfinite(logits[i])] == -np.inf)


def test_batch_masker_validates_before_touching_memory(vocab):
    states = make_batch(vocab)[:4]
    masker = native.BatchMasker(VOCAB_SIZE)
    for bad, message in [
        (np.zeros((4, WORDS), np.int64), "int32"),
        (np.zeros((3, WORDS), np.int32), r"shape must be \[4, "),
        (np.zeros((4, WORDS + 1), np.int32), "shape"),
        (np.zeros((WORDS, 4), np.int32).T, "C-contiguous"),
    ]:
        with pytest.raises(ValueError, match=message):
            masker.fill_bitmask(states, bad)
    readonly = np.zeros((4, WORDS), np.int32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        masker.fill_bitmask(states, readonly)
    with pytest.raises(ValueError, match="float32"):
        masker.apply(states, np.zeros((4, VOCAB_SIZE), np.float64))
    with pytest.raises(ValueError, match=r"states\[1\] must be a State or None"):
        masker.fill_bitmask([None, "x", None, None], np.zeros((4, WORDS), np.int32))
    other = native.BatchMasker(VOCAB_SIZE + 32)
    with pytest.raises(ValueError, match="row 0"):
        other.fill_bitmask(states, np.zeros((4, constraints.bitmask_words(VOCAB_SIZE + 32)), np.int32))
    with pytest.raises(ValueError, match="num_threads"):
        native.BatchMasker(VOCAB_SIZE, num_threads=0)
    with pytest.raises(ValueError, match="row shape"):
        states[0].fill_bitmask_row(np.zeros(WORDS + 1, np.int32))


@pytest.mark.parametrize("threads", [1, 3])
def test_unique_bitmask_gathers_to_the_full_bitmask(vocab, threads):
    batch = make_batch(vocab)
    # Duplicate rows (the same state twice, fresh states at the start) must share a unique row.
    c = native.Constraint.json_schema(vocab, json.dumps(PERSON))
    states = batch + [batch[0], batch[0]] + [c.new_state() for _ in range(4)]
    masker = native.BatchMasker(VOCAB_SIZE, num_threads=threads)
    full = np.zeros((len(states), WORDS), np.int32)
    masker.fill_bitmask(states, full)
    unique = np.full((len(states), WORDS), 0x5A5A5A5A, np.int32)
    index = np.full(len(states), -1, np.int32)
    n = masker.fill_unique_bitmask(states, unique, index)
    assert 0 < n <= len(states) - 4
    assert index.min() >= 0 and index.max() < n
    np.testing.assert_array_equal(unique[index], full)
    assert index[len(batch)] == index[len(batch) + 1] == index[0]
    assert len(set(index[-4:].tolist())) == 1


def test_unique_bitmask_validates_its_arrays(vocab):
    states = make_batch(vocab)[:4]
    masker = native.BatchMasker(VOCAB_SIZE)
    index = np.zeros(4, np.int32)
    with pytest.raises(ValueError, match=r"unique shape must be \[4, "):
        masker.fill_unique_bitmask(states, np.zeros((3, WORDS), np.int32), index)
    with pytest.raises(ValueError, match="row_index must be a int32 array"):
        masker.fill_unique_bitmask(states, np.zeros((4, WORDS), np.int32), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match=r"row_index shape must be \[4\]"):
        masker.fill_unique_bitmask(states, np.zeros((4, WORDS), np.int32), np.zeros(5, np.int32))
    with pytest.raises(ValueError, match=r"states\[2\] must be a State or None"):
        masker.fill_unique_bitmask([None, None, 3, None], np.zeros((4, WORDS), np.int32), index)
    shared = np.zeros(4 * WORDS + 4, np.int32)
    with pytest.raises(ValueError, match="must not overlap"):
        masker.fill_unique_bitmask(
            states, shared[: 4 * WORDS].reshape(4, WORDS), shared[4 * WORDS - 2 : 4 * WORDS + 2]
        )


def test_batch_methods_bind_arguments_like_python_functions(vocab):
    # fill_bitmask, fill_unique_bitmask and apply are plain CPython methods (module.cc,
    # kBatchMethods): keywords, tuples and other sequences work, bad calls are TypeErrors, and
    # arrays outside the plain case go through the same checks as before.
    states = make_batch(vocab)[:4]
    masker = native.BatchMasker(VOCAB_SIZE)
    expected = np.zeros((4, WORDS), np.int32)
    masker.fill_bitmask(states, expected)
    for call in (
        lambda out: masker.fill_bitmask(states=states, bitmask=out),
        lambda out: masker.fill_bitmask(states, bitmask=out),
        lambda out: masker.fill_bitmask(tuple(states), out),
        lambda out: native.BatchMasker.fill_bitmask(masker, states, out),
        lambda out: masker.fill_bitmask(collections.deque(states), out),
    ):
        out = np.zeros((4, WORDS), np.int32)
        call(out)
        np.testing.assert_array_equal(out, expected)
    # A view with an offset, and a little-endian dtype spelled out, are still the plain case.
    for out in (np.zeros((5, WORDS), np.int32)[1:], np.zeros((4, WORDS), np.dtype("<i4"))):
        masker.fill_bitmask(states, out)
        np.testing.assert_array_equal(out, expected)
    strided = np.zeros((8, WORDS), np.int32)[::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        masker.fill_bitmask(states, strided)
    with pytest.raises(ValueError, match="int32"):
        masker.fill_bitmask(states, np.zeros((4, WORDS), np.dtype(">i4")))
    with pytest.raises(TypeError, match="bitmask must be a numpy int32 array"):
        masker.fill_bitmask(states, [[0] * WORDS] * 4)

    # The batch is what the sequence holds, whatever its __len__ says: the arrays are checked
    # against the rows that are filled (a mismatch once wrote past the end of the bitmask).
    class ShortList(list):
        def __len__(self):
            return 1

    class Lying:
        def __len__(self):
            return 1

        def __getitem__(self, i):
            if i >= 4:
                raise IndexError(i)
            return None

    for lying in (ShortList([None] * 4), Lying()):
        guarded = np.full((5, WORDS), 7, np.int32)
        with pytest.raises(ValueError, match=r"bitmask shape must be \[4, "):
            masker.fill_bitmask(lying, guarded[:1])
        with pytest.raises(ValueError, match=r"logits shape must be \[4, "):
            masker.apply(lying, np.zeros((1, VOCAB_SIZE), np.float32))
        with pytest.raises(ValueError, match=r"unique shape must be \[4, "):
            masker.fill_unique_bitmask(lying, guarded[:1], np.zeros(1, np.int32))
        assert (guarded == 7).all()
        masker.fill_bitmask(lying, guarded[:4])
        assert (guarded[4] == 7).all() and bits_to_set(guarded[0]) == set(range(VOCAB_SIZE))
    # A State made by __new__ alone is refused, not read.
    with pytest.raises(ValueError, match=r"states\[1\] must be a State or None"):
        masker.fill_bitmask([None, native.State.__new__(native.State), None, None], expected.copy())
    bad_calls = [
        (lambda: masker.fill_bitmask(states), r"takes 2 arguments \(states, bitmask\)"),
        (lambda: masker.fill_bitmask(states, expected, expected), "takes 2 arguments"),
        (
            lambda: masker.fill_bitmask(states, bitmask=expected, mask=expected),
            "unexpected keyword argument 'mask'",
        ),
        (
            lambda: masker.fill_bitmask(states, expected, bitmask=expected),
            "multiple values for argument 'bitmask'",
        ),
        (lambda: masker.fill_bitmask(5, expected), "states must be a sequence"),
        (lambda: masker.fill_bitmask(iter(states), expected), "states must be a sequence"),
        (lambda: native.BatchMasker.fill_bitmask(object(), states, expected), "BatchMasker"),
        (
            lambda: native.BatchMasker.__new__(native.BatchMasker).fill_bitmask(states, expected),
            "initialized",
        ),
        (lambda: masker.fill_unique_bitmask(states, expected), r"\(states, unique, row_index\)"),
        (lambda: masker.apply(states), r"\(states, logits\)"),
    ]
    for call, message in bad_calls:
        with pytest.raises(TypeError, match=message):
            call()
    logits = np.zeros((4, VOCAB_SIZE), np.float32)
    masker.apply(states=states, logits=logits)
    assert np.array_equal(
        np.isfinite(logits),
        np.unpackbits(expected.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB_SIZE] == 1,
    )
    unique, index = np.zeros((4, WORDS), np.int32), np.zeros(4, np.int32)
    n = masker.fill_unique_bitmask(states=states, unique=unique, row_index=index)
    assert isinstance(n, int) and 1 <= n <= 4
    np.testing.assert_array_equal(unique[index], expected)
    assert str(inspect.signature(native.BatchMasker.fill_bitmask)) == "(self, /, states, bitmask)"


def test_batch_masker_is_usable_from_several_python_threads(vocab):
    states = make_batch(vocab)
    masker = native.BatchMasker(VOCAB_SIZE, num_threads=2)
    expected = np.zeros((len(states), WORDS), np.int32)
    masker.fill_bitmask(states, expected)
    errors = []

    def run():
        out = np.zeros_like(expected)
        unique = np.zeros_like(expected)
        index = np.zeros(len(states), np.int32)
        for _ in range(50):
            masker.fill_bitmask(states, out)
            if not np.array_equal(out, expected):
                errors.append("mismatch")
            n = masker.fill_unique_bitmask(states, unique, index)
            if not np.array_equal(unique[:n][index], expected):
                errors.append("unique mismatch")

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_stats_report_cache_use(vocab):
    c = native.Constraint.json_schema(vocab, json.dumps(PERSON))
    walk(c, None, 0)
    stats = c.stats()
    assert stats["kind"] == "json_schema"
    assert stats["dfa_states"] > 0
    assert 0 < stats["cached_masks"] <= stats["cache_capacity"]
    assert stats["cache_bytes"] == stats["cached_masks"] * WORDS * 4
    assert stats["cache_hits"] + stats["cache_misses"] > 0
    # Unrestricted masks of DFA states are pinned (read lock-free) up to half the capacity.
    assert 0 < stats["cache_pinned"] <= min(stats["cached_masks"], stats["cache_capacity"] // 2)

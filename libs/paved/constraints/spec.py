"""Constraint specs: the JSON-able description of a paved constraint carried by a request.

A spec travels from the API (response_format, tool_choice, `vllm_xargs.paved_constraint`) to
the engine core inside `SamplingParams.extra_args[EXTRA_ARGS_KEY]`, with its canonical key in
`extra_args[KEY_ARGS_KEY]`. `admit` is the single admission check (no vocabulary needed): it is
memoized by the key, so a spec is validated once per process however often it is sent, and it
costs milliseconds to seconds for big specs, so servers call it off the event loop
(`asyncio.to_thread`). vLLM's `validate_params` then trusts the very object `admit` returned
(`is_admitted`, an identity check) and validates anything else; the engine core re-checks only
cheap invariants (`check_shape`), since vLLM runs `validate_params` on every request first.

A JSON schema that is only an `enum`/`const` of JSON values (the 50k-value catalogue case) is
lowered to a `choice` spec over the values' compact JSON texts: the catalogue engine compiles
50k values in ~20 ms where the regex path would exceed its DFA state cap.

Spec shapes (after normalization every field is present):
  {"type": "json_schema", "schema": {...}, "whitespace": "compact" | "standard" | "free"}
  {"type": "regex", "pattern": "..."}
  {"type": "choice", "items": ["...", ...], "k": 1, "separator": ", ", "distinct": false}
"""

from __future__ import annotations

import hashlib
import json
from json.encoder import encode_basestring_ascii as _ascii_json_string
from typing import Any, NoReturn

from paved.constraints.lru import LockedLRU

EXTRA_ARGS_KEY = "paved_constraint"
KEY_ARGS_KEY = "paved_constraint_key"

MAX_SPEC_BYTES = 16 * 1024 * 1024  # a 100k-title catalogue is ~3 MB
MAX_CHOICE_ITEMS = 1_000_000
MAX_CHOICE_ITEM_BYTES = 4096
MAX_CHOICE_K = 1024
WHITESPACE_MODES = ("compact", "standard", "free")

_FIELDS = {
    "json_schema": {"type", "schema", "whitespace"},
    "regex": {"type", "pattern"},
    "choice": {"type", "items", "k", "separator", "distinct"},
}


def _native():
    # Imported lazily: the frontend validates specs without loading the engine.
    import _paved_constraints

    return _paved_constraints


def _fail(message: str) -> NoReturn:
    raise ValueError(f"invalid {EXTRA_ARGS_KEY}: {message}")


def _loads(text: str, what: str) -> Any:
    # json.loads raises RecursionError, not a ValueError, past ~1000 levels of nesting.
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        _fail(f"{what} is not valid JSON ({e})")
    except RecursionError:
        _fail(f"{what} is nested too deeply")


def validate_spec(obj: Any, *, size: int | None = None) -> dict:
    """Return the normalized spec or raise ValueError saying what is wrong and where.

    `obj` may be a dict or its JSON text (REST `vllm_xargs` values are often strings).
    """
    if isinstance(obj, str):
        if len(obj.encode()) > MAX_SPEC_BYTES:
            _fail(f"spec is larger than {MAX_SPEC_BYTES} bytes")
        obj = _loads(obj, "spec")
    if not isinstance(obj, dict):
        _fail(f"expected an object, got {type(obj).__name__}")
    kind = obj.get("type")
    if kind not in _FIELDS:
        _fail(f"'type' must be one of {sorted(_FIELDS)}, got {kind!r}")
    unknown = sorted(set(obj) - _FIELDS[kind])
    if unknown:
        _fail(f"unknown field(s) {unknown} for type {kind!r}")
    if (len(json.dumps(obj)) if size is None else size) > MAX_SPEC_BYTES:
        _fail(f"spec is larger than {MAX_SPEC_BYTES} bytes")
    return {"json_schema": _json_schema, "regex": _regex, "choice": _choice}[kind](obj)


def _json_schema(obj: dict) -> dict:
    schema = obj.get("schema")
    if isinstance(schema, str):
        schema = _loads(schema, "'schema'")
    if not isinstance(schema, dict):
        _fail("'schema' must be a JSON Schema object")
    whitespace = obj.get("whitespace", "compact")
    if whitespace not in WHITESPACE_MODES:
        _fail(f"'whitespace' must be one of {list(WHITESPACE_MODES)}, got {whitespace!r}")
    lowered = enum_as_choice(schema)
    if lowered is not None:
        return lowered
    reason = json_schema_unsupported_reason(schema)
    if reason is not None:
        _fail(reason)
    return {"type": "json_schema", "schema": schema, "whitespace": whitespace}


# Keywords that do not change what an enum/const schema accepts.
_ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated"}
_JSON_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def enum_as_choice(schema: Any) -> dict | None:
    """The `choice` spec equal to `schema` when it only lists values (`enum` or `const`, an
    optional `type` every value satisfies, annotations); None otherwise.

    Each value is emitted as its compact JSON text (`json.dumps`, ASCII escapes), one of the
    texts that parse to it, so the output is always valid for the schema. A value longer than
    a catalogue item keeps the schema on the regex path."""
    if not isinstance(schema, dict) or not ({"enum", "const"} & schema.keys()):
        return None
    if set(schema) - _ANNOTATIONS - {"enum", "const", "type"}:
        return None
    if "enum" in schema and "const" in schema:
        return None
    values = schema["enum"] if "enum" in schema else [schema["const"]]
    if not isinstance(values, list) or not values:
        return None
    kind = schema.get("type")
    if kind is not None:
        kinds = [kind] if isinstance(kind, str) else kind
        if not isinstance(kinds, list) or not all(k in _JSON_TYPES for k in kinds):
            return None
        values = [v for v in values if any(_JSON_TYPES[k](v) for k in kinds)]
        if not values:
            return None
    try:
        # Strings (the catalogue case) through json's C escaper: the text json.dumps gives,
        # without its per-call overhead on 50k values.
        items = [_ascii_json_string(v) if isinstance(v, str) else _compact(v) for v in values]
    except (TypeError, ValueError):
        return None
    if len(items) > MAX_CHOICE_ITEMS or any(len(item) > MAX_CHOICE_ITEM_BYTES for item in items):
        return None
    return {"type": "choice", "items": items, "k": 1, "separator": ", ", "distinct": False}


def _regex(obj: dict) -> dict:
    pattern = obj.get("pattern")
    if not isinstance(pattern, str) or not pattern:
        _fail("'pattern' must be a non-empty string")
    try:
        _native().check_regex(pattern)
    except ValueError as e:
        _fail(str(e))
    return {"type": "regex", "pattern": pattern}


def _choice(obj: dict) -> dict:
    items = obj.get("items")
    if not isinstance(items, list) or not items:
        _fail("'items' must be a non-empty list of strings")
    if len(items) > MAX_CHOICE_ITEMS:
        _fail(f"'items' has {len(items)} entries, more than the limit of {MAX_CHOICE_ITEMS}")
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item:
            _fail(f"items[{i}] must be a non-empty string")
        if len(item.encode()) > MAX_CHOICE_ITEM_BYTES:
            _fail(f"items[{i}] is longer than {MAX_CHOICE_ITEM_BYTES} bytes")
    k = obj.get("k", 1)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_CHOICE_K:
        _fail(f"'k' must be an integer in [1, {MAX_CHOICE_K}], got {k!r}")
    separator = obj.get("separator", ", ")
    if not isinstance(separator, str):
        _fail("'separator' must be a string")
    if k > 1 and not separator:
        _fail("'separator' must be non-empty when k > 1")
    distinct = obj.get("distinct", False)
    if not isinstance(distinct, bool):
        _fail("'distinct' must be a boolean")
    if distinct and k > len(set(items)):
        _fail(f"k={k} distinct items requested but the catalogue has only {len(set(items))}")
    return {"type": "choice", "items": items, "k": k, "separator": separator, "distinct": distinct}


def json_schema_unsupported_reason(schema: Any) -> str | None:
    """None if paved's engine enforces `schema` exactly; otherwise why not (the caller may
    then fall back to another structured-output backend)."""
    try:
        _native().check_json_schema(json.dumps(schema))
    except ValueError as e:
        return str(e)
    except TypeError as e:  # not JSON-serializable
        return f"schema is not JSON: {e}"
    return None


def spec_key(spec: Any) -> str:
    """Canonical digest of a spec: equal specs share one compiled automaton and one
    admission result. A digest, not the text, so it is cheap to carry and compare."""
    return hashlib.sha256(_canonical(spec).encode()).hexdigest()


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


# Distinct specs remembered per process; each entry holds one normalized spec (big catalogues
# are a few MB, so the bound is in entries of what clients actually repeat).
ADMISSION_CACHE_ENTRIES = 256
# Raw spec digest -> (normalized spec, its key) or the error's text.
_outcomes: LockedLRU[str, tuple[dict, str] | str] = LockedLRU(ADMISSION_CACHE_ENTRIES)
# Key -> the normalized spec object handed out for it (what `is_admitted` compares against).
_issued: LockedLRU[str, dict] = LockedLRU(ADMISSION_CACHE_ENTRIES)


def admit(raw: Any) -> tuple[dict, str]:
    """(normalized spec, its key) for a raw spec, validated once per distinct spec.

    Raises ValueError as `validate_spec` does (the error is memoized too). Costs O(spec size)
    for the digest and, on a miss, the native checks: call it off the event loop. The returned
    dict must not be mutated (it is shared by every request with the same spec)."""
    if isinstance(raw, str):
        if len(raw) > MAX_SPEC_BYTES:
            _fail(f"spec is larger than {MAX_SPEC_BYTES} bytes")
        raw_key = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()
        size = None
    else:
        try:
            text = _canonical(raw)
        except (TypeError, ValueError) as e:
            _fail(f"spec is not JSON ({e})")
        raw_key, size = hashlib.sha256(text.encode()).hexdigest(), len(text)
    hit = _outcomes.get(raw_key)
    if isinstance(hit, str):
        raise ValueError(hit)
    if hit is not None:
        _issued.put(hit[1], hit[0])  # trusted as long as it is in use
        return hit
    try:
        spec = validate_spec(raw, size=size)
    except ValueError as e:
        _outcomes.put(raw_key, str(e))
        raise
    # Already normal (all fields given): its key is the digest just taken.
    key = raw_key if not isinstance(raw, str) and spec == raw else spec_key(spec)
    # One object per key (the same spec sent as text and as an object, or admitted by two
    # threads at once): every holder then passes `is_admitted`.
    spec = _issued.get(key) or spec
    _outcomes.put(raw_key, (spec, key))
    _issued.put(key, spec)
    return spec, key


def is_admitted(spec: Any, key: Any) -> bool:
    """True when `spec` is the very object `admit` returned with `key` (and still remembered):
    then it needs no re-validation. O(1), whatever the spec's size."""
    return isinstance(key, str) and _issued.get(key) is spec


def check_shape(spec: Any) -> None:
    """The cheap invariants the engine core re-checks on a spec vLLM's `validate_params`
    already admitted: a dict of a known type with that type's fields."""
    if not isinstance(spec, dict) or spec.get("type") not in _FIELDS:
        _fail("not a normalized spec")
    if set(spec) != _FIELDS[spec["type"]]:
        _fail(f"fields {sorted(spec)} are not those of a normalized {spec['type']!r} spec")

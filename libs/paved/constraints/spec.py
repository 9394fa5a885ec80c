"""Constraint specs: the JSON-able description of a paved constraint carried by a request.

A spec travels from the API (response_format, tool_choice, `vllm_xargs.paved_constraint`) to
the engine core inside `SamplingParams.extra_args[EXTRA_ARGS_KEY]`. `validate_spec` is the
single admission check: it runs in the frontend process (no vocabulary needed) and again in
vLLM's `validate_params`, so a bad spec is a 400 before it is scheduled, never an engine error.

Spec shapes (after normalization every field is present):
  {"type": "json_schema", "schema": {...}, "whitespace": "compact" | "standard" | "free"}
  {"type": "regex", "pattern": "..."}
  {"type": "choice", "items": ["...", ...], "k": 1, "separator": ", ", "distinct": false}
"""

from __future__ import annotations

import json
from typing import Any

EXTRA_ARGS_KEY = "paved_constraint"

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


def _fail(message: str) -> None:
    raise ValueError(f"invalid {EXTRA_ARGS_KEY}: {message}")


def validate_spec(obj: Any) -> dict:
    """Return the normalized spec or raise ValueError saying what is wrong and where.

    `obj` may be a dict or its JSON text (REST `vllm_xargs` values are often strings).
    """
    if isinstance(obj, str):
        if len(obj.encode()) > MAX_SPEC_BYTES:
            _fail(f"spec is larger than {MAX_SPEC_BYTES} bytes")
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError as e:
            _fail(f"not valid JSON ({e})")
    if not isinstance(obj, dict):
        _fail(f"expected an object, got {type(obj).__name__}")
    kind = obj.get("type")
    if kind not in _FIELDS:
        _fail(f"'type' must be one of {sorted(_FIELDS)}, got {kind!r}")
    unknown = sorted(set(obj) - _FIELDS[kind])
    if unknown:
        _fail(f"unknown field(s) {unknown} for type {kind!r}")
    if len(json.dumps(obj)) > MAX_SPEC_BYTES:
        _fail(f"spec is larger than {MAX_SPEC_BYTES} bytes")
    return {"json_schema": _json_schema, "regex": _regex, "choice": _choice}[kind](obj)


def _json_schema(obj: dict) -> dict:
    schema = obj.get("schema")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            _fail(f"'schema' is not valid JSON ({e})")
    if not isinstance(schema, dict):
        _fail("'schema' must be a JSON Schema object")
    whitespace = obj.get("whitespace", "compact")
    if whitespace not in WHITESPACE_MODES:
        _fail(f"'whitespace' must be one of {list(WHITESPACE_MODES)}, got {whitespace!r}")
    reason = json_schema_unsupported_reason(schema)
    if reason is not None:
        _fail(reason)
    return {"type": "json_schema", "schema": schema, "whitespace": whitespace}


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


def spec_key(spec: dict) -> str:
    """Canonical text of a normalized spec: equal specs share one compiled automaton."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))

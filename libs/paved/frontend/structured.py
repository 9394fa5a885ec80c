"""Structured outputs: turn a request's constraint fields into one enforced `Constraint`.

Sources, at most one per request: `response_format` (json_object / json_schema),
`tool_choice` (a named function, or "required"), vLLM's `structured_outputs` extension, and
`vllm_xargs.paved_constraint` (a raw paved spec). JSON schemas go to paved's constraint
engine when they are inside its subset (compact, budget-aware: output closes before
max_tokens runs out), otherwise to vLLM's xgrammar. Whatever cannot be enforced is a 400:
a constraint is never dropped.

Checking a spec costs up to hundreds of milliseconds (JSON Schema meta-validation, paved's
native subset check and automaton limits); a request's own cost is one digest of its spec.
`resolve_async` plans a request (which source, the spec's canonical digest) on the event
loop when its constraint fields are small (`INLINE_SPEC_CHARS`), else on the admission pool;
the outcome of each distinct spec is memoized by that digest. Only a spec not yet memoized
is checked, once, on the admission pool: requests that carry a spec whose check is running
wait on that check (single flight). `MAX_CHECKS` bounds the distinct specs being checked at
once, a bound an attacker sending many distinct specs meets, never a burst of one spec.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from paved.constraints.background import background_executor
from paved.constraints.lru import LockedLRU
from paved.engine.protocol import Constraint, EngineOverloadedError, ModelCard, SamplingOptions
from paved.frontend.errors import APIError
from paved.frontend.schemas import (
    ChatCompletionRequest,
    NamedToolChoice,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    SamplingFields,
    Tool,
)
from paved.http.json_body import MAX_DEPTH, JSONBodyError, parse_json

PAVED_CONSTRAINT_XARG = "paved_constraint"
BACKEND_HEADER = "x-paved-constraint-backend"
# Generic JSON object, the meaning of response_format json_object.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolMode:
    """How generated text becomes tool calls: one named function's arguments, or a list."""

    kind: Literal["named", "required"]
    name: str | None = None


@dataclass(frozen=True)
class Resolved:
    constraint: Constraint | None = None
    tool_mode: ToolMode | None = None


@dataclass(frozen=True)
class _Check:
    """A constraint still to be checked: `run` is the check (it raises a 400 APIError for a
    spec that cannot be enforced), memoized under `key`, the spec's canonical digest."""

    key: tuple
    run: Callable[[], Constraint]
    param: str
    tool_mode: ToolMode | None = None


# Admission work runs on its own threads so that a burst of heavy specs cannot take the
# default executor (tokenization of long prompts) with it.
ADMISSION_THREADS = 2
_pool = background_executor(ADMISSION_THREADS, "paved-admit")
# Distinct specs being checked at once; a new spec past it is refused (503), so that many
# distinct heavy specs cannot queue unbounded CPU work. Requests repeating a spec being
# checked wait on that check and take nothing from this bound.
MAX_CHECKS = 64
# Constraint fields up to this size (characters of their strings plus a few per node) are
# digested on the event loop, well under a millisecond; larger ones are digested on the pool.
INLINE_SPEC_CHARS = 64 * 1024
# Spec key -> the running check's outcome (a Constraint, or a 400's text).
_checks: dict[tuple, Future] = {}
_checks_lock = threading.Lock()


def has_constraint(request: SamplingFields) -> bool:
    """Whether `request` names any output constraint (only those need the admission pool)."""
    if isinstance(request.response_format, ResponseFormatJsonObject | ResponseFormatJsonSchema):
        return True
    if request.structured_outputs is not None or request.vllm_xargs:
        return True
    return isinstance(request, ChatCompletionRequest) and (
        request.tool_choice is not None or bool(request.tools)
    )


async def resolve_async(request: SamplingFields, card: ModelCard) -> Resolved:
    """`resolve` without blocking the event loop: the spec's digest on the loop when it is
    small, the check (once per distinct spec) on the admission pool."""
    if not has_constraint(request):
        return resolve(request, card)
    if _inline(request):
        plan = _plan(request, card)
    else:
        # The digest is O(spec size), like the body's parse the server already did: it waits
        # for the pool, bounded by the bodies accepted, not refused.
        plan = await asyncio.get_running_loop().run_in_executor(_pool, _plan, request, card)
    if isinstance(plan, Resolved):
        return plan
    outcome = _memoized(plan.key)
    if outcome is None:
        outcome = await _single_flight(plan)
    return _finish(plan, outcome)


def resolve(request: SamplingFields, card: ModelCard) -> Resolved:
    """The constraint (and tool-call mode) `request` asks for, validated and routed.

    Blocking (see `resolve_async`)."""
    plan = _plan(request, card)
    if isinstance(plan, Resolved):
        return plan
    outcome = _memoized(plan.key)
    if outcome is None:
        outcome = _check(plan)
    return _finish(plan, outcome)


# ---- the memo and the single flight ---------------------------------------------------------
ROUTE_CACHE_ENTRIES = 256
# Spec key -> the Constraint, or the 400's text.
_routes: LockedLRU[tuple, Constraint | str] = LockedLRU(ROUTE_CACHE_ENTRIES)


def _memoized(key: tuple) -> Constraint | str | None:
    hit = _routes.get(key)
    if isinstance(hit, Constraint) and hit.backend == "paved":
        from paved.constraints import spec as paved_spec

        # Engines trust a paved spec without re-validating it only while `spec.admit` still
        # remembers issuing it (an identity check); one it forgot is admitted again.
        if not paved_spec.is_admitted(hit.value, hit.key):
            return None
    return hit


def _check(plan: _Check) -> Constraint | str:
    """Run `plan`'s check and memoize its outcome (a 400's text too). Blocking."""
    try:
        outcome: Constraint | str = plan.run()
    except APIError as e:
        if e.status != 400:
            raise
        outcome = e.message
    _routes.put(plan.key, outcome)
    return outcome


async def _single_flight(plan: _Check) -> Constraint | str:
    with _checks_lock:
        # Memoized while this request was being planned? (A check stores its outcome before
        # it leaves `_checks`, so under the lock one of the two always has it.)
        outcome = _memoized(plan.key)
        if outcome is not None:
            return outcome
        shared = _checks.get(plan.key)
        if shared is None:
            if len(_checks) >= MAX_CHECKS:
                raise EngineOverloadedError(
                    f"{MAX_CHECKS} distinct output constraints are already being checked (the "
                    "admission limit on new specs); retry shortly",
                    reason="constraint_checks",
                )
            shared = _checks[plan.key] = Future()
            _pool.submit(_run_shared, plan, shared)
    # Shielded: a waiter that disconnects must not cancel the check the others wait on.
    return await asyncio.shield(asyncio.wrap_future(shared))


def _run_shared(plan: _Check, shared: Future) -> None:
    try:
        outcome = _check(plan)
    except BaseException as e:  # noqa: BLE001 - every waiter gets it (a bug: their 500)
        with _checks_lock:
            del _checks[plan.key]
        shared.set_exception(e)
        return
    with _checks_lock:
        del _checks[plan.key]
    shared.set_result(outcome)


def _finish(plan: _Check, outcome: Constraint | str) -> Resolved:
    if isinstance(outcome, str):
        raise APIError(400, outcome, param=plan.param)
    return Resolved(outcome, plan.tool_mode)


def _inline(request: SamplingFields) -> bool:
    """Whether the request's constraint fields are small enough to plan on the event loop.

    A walk that gives up as soon as the budget is spent: O(INLINE_SPEC_CHARS) at most."""
    budget = INLINE_SPEC_CHARS
    stack: list[Any] = list(_constraint_fields(request))
    while stack:
        value = stack.pop()
        budget -= 8
        if isinstance(value, str):
            budget -= len(value)
        elif isinstance(value, dict | list):
            budget -= 8 * len(value)  # before expanding it: a huge container stops here
            if budget >= 0:
                stack.extend(value.items() if isinstance(value, dict) else value)
        elif isinstance(value, tuple):  # a dict item
            stack.extend(value)
        elif isinstance(value, Tool):
            stack.append(value.function.parameters)
        if budget < 0:
            return False
    return True


def _constraint_fields(request: SamplingFields) -> Iterator[Any]:
    rf = request.response_format
    if isinstance(rf, ResponseFormatJsonSchema):
        yield rf.json_schema.schema_
    elif isinstance(rf, ResponseFormatJsonObject):
        yield rf.schema_
    so = request.structured_outputs
    if so is not None:
        yield from (so.json_, so.regex, so.choice, so.grammar)
    if request.vllm_xargs:
        yield request.vllm_xargs
    if isinstance(request, ChatCompletionRequest) and request.tools:
        yield request.tools


def _digest(value: Any) -> str:
    """The SHA-256 of `value`'s canonical JSON text (ValueError: NaN or Infinity in it)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# ---- planning: which source, and its spec's digest --------------------------------------------
def _plan(request: SamplingFields, card: ModelCard) -> Resolved | _Check:
    """The request's constraint source, validated; the answer itself when nothing needs a
    check, else the check to run (or find memoized)."""
    sources: list[tuple[str, Any]] = []
    rf = request.response_format
    if isinstance(rf, ResponseFormatJsonObject | ResponseFormatJsonSchema):
        sources.append(("response_format", rf))
    if request.structured_outputs is not None:
        sources.append(("structured_outputs", request.structured_outputs))
    xargs = dict(request.vllm_xargs or {})
    paved_spec = xargs.pop(PAVED_CONSTRAINT_XARG, None)
    if xargs:
        raise APIError(
            400,
            f"vllm_xargs key(s) {sorted(xargs)} are not supported; "
            f"only {PAVED_CONSTRAINT_XARG!r} is read here",
            param="vllm_xargs",
        )
    if paved_spec is not None:
        sources.append((f"vllm_xargs.{PAVED_CONSTRAINT_XARG}", paved_spec))
    tool_mode, tool_schema = (
        _tool_mode(request) if isinstance(request, ChatCompletionRequest) else (None, None)
    )
    if tool_mode is not None:
        sources.append(("tool_choice", tool_schema))
    if not sources:
        return Resolved()
    if len(sources) > 1:
        names = " and ".join(name for name, _ in sources)
        raise APIError(400, f"{names} both constrain the output; send only one", param=sources[1][0])
    if not card.constraint_backends:
        raise APIError(400, f"model {card.id!r} does not support structured outputs", param=sources[0][0])
    if request.ignore_eos:
        raise APIError(400, "ignore_eos cannot be combined with a constrained output", param="ignore_eos")

    name, value = sources[0]
    if name == "response_format":
        if isinstance(value, ResponseFormatJsonObject):
            if value.schema_ is not None:
                return _json(value.schema_, card, "response_format.schema")
            return _json(_ANY_OBJECT, card, name, json_object=True)
        schema = value.json_schema.schema_
        if schema is None:
            raise APIError(
                400, "response_format.json_schema.schema is required", param="response_format.json_schema"
            )
        return _json(schema, card, "response_format.json_schema.schema")
    if name == "tool_choice":
        check = _json(value, card, "tools")
        return _Check(check.key, check.run, check.param, tool_mode)
    if name == "structured_outputs":
        return _structured_outputs(value, card)
    return _paved_spec(value, card, name)


def _json(schema: Any, card: ModelCard, param: str, json_object: bool = False) -> _Check:
    if isinstance(schema, str):
        try:
            schema = parse_json(schema)
        except JSONBodyError as e:
            raise APIError(400, f"the JSON schema is {e}", param=param) from None
    if not isinstance(schema, dict):
        raise APIError(400, "a JSON schema must be an object", param=param)
    try:
        digest = _digest(schema)
    except ValueError as e:  # NaN/Infinity: not JSON, and no backend could compare against it
        raise APIError(400, f"the JSON schema is not valid JSON: {e}", param=param) from e
    key = ("json", digest, card.constraint_backends, json_object)
    return _Check(key, functools.partial(_route_json, schema, card, param, json_object), param)


def _route_json(schema: dict, card: ModelCard, param: str, json_object: bool) -> Constraint:
    _check_schema(schema, param)
    reason = None
    if "paved" in card.constraint_backends:
        from paved.constraints import spec as paved_spec

        # One check: admission either normalizes it (paved enforces it) or says why not.
        try:
            spec, key = paved_spec.admit({"type": "json_schema", "schema": schema, "whitespace": "compact"})
        except ValueError as e:
            reason = str(e)
        else:
            return Constraint("paved", "paved", spec, key)
    if "xgrammar" in card.constraint_backends:
        if json_object:
            return Constraint("xgrammar", "json_object")
        return Constraint("xgrammar", "json_schema", schema)
    because = f" ({reason})" if reason else ""
    raise APIError(400, f"model {card.id!r} cannot enforce this JSON schema{because}", param=param)


def _check_schema(schema: dict, param: str) -> None:
    """Reject schemas that are not JSON Schema at all, before any backend interprets them."""
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise APIError(400, f"invalid JSON schema at {where}: {e.message}", param=param) from e
    except Exception as e:  # e.g. an unknown $schema dialect or a regex the checker cannot compile
        raise APIError(400, f"invalid JSON schema: {e}", param=param) from e


def _structured_outputs(value, card: ModelCard) -> Resolved | _Check:
    if value.json_ is not None:
        return _json(value.json_, card, "structured_outputs.json")
    if value.json_object:
        return _json(_ANY_OBJECT, card, "structured_outputs.json_object", json_object=True)
    # regex / choice / grammar keep vLLM's meaning, so they stay on xgrammar; paved's own
    # regex and choice engines are reached through vllm_xargs.paved_constraint.
    if "xgrammar" not in card.constraint_backends:
        raise APIError(
            400, f"model {card.id!r} does not support structured_outputs", param="structured_outputs"
        )
    if value.regex is not None:
        return Resolved(Constraint("xgrammar", "regex", value.regex))
    if value.choice is not None:
        return Resolved(Constraint("xgrammar", "choice", list(value.choice)))
    return Resolved(Constraint("xgrammar", "grammar", value.grammar))


def _paved_spec(raw: Any, card: ModelCard, param: str) -> Resolved | _Check:
    if "paved" not in card.constraint_backends:
        raise APIError(400, f"paved's constraint engine is not enabled for model {card.id!r}", param=param)
    if isinstance(raw, str):  # a spec's JSON text: `admit` memoizes texts by their own digest
        key: tuple = ("paved_text", hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest())
    else:
        try:
            key = ("paved", _digest(raw))
        except ValueError:  # not JSON: admit says so at once, naming the field
            return Resolved(_validated_spec(raw, param))
    return _Check(key, functools.partial(_validated_spec, raw, param), param)


def _validated_spec(raw: Any, param: str) -> Constraint:
    from paved.constraints import spec as paved_spec

    try:
        spec, key = paved_spec.admit(raw)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from e
    return Constraint("paved", "paved", spec, key)


# ---- tools ----------------------------------------------------------------------------------
def _tool_mode(request: ChatCompletionRequest) -> tuple[ToolMode | None, dict | None]:
    choice, tools = request.tool_choice, request.tools or []
    if choice is None:
        if tools:
            raise APIError(400, _AUTO_UNSUPPORTED, param="tool_choice")
        return None, None
    if choice == "none":
        return None, None
    if not tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if choice == "auto":
        raise APIError(400, _AUTO_UNSUPPORTED, param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        by_name = {t.function.name: t for t in tools}
        tool = by_name.get(choice.function.name)
        if tool is None:
            raise APIError(
                400, f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice"
            )
        # The tool's parameters are the root: its local $refs resolve as written.
        return ToolMode("named", tool.function.name), _parameters(tool)
    # "required": a non-empty JSON array of {"name", "parameters"} calls (vLLM's shape). Each
    # tool's parameters sit inside the combined schema, so its local $refs ("#/$defs/X",
    # "#/definitions/X", "#") are rewritten to that position; its definitions stay with it (two
    # tools may define the same name differently).
    schema = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t.function.name]},
                        "parameters": _rebased(_parameters(t), f"#/items/anyOf/{i}/properties/parameters"),
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for i, t in enumerate(tools)
            ]
        },
    }
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return ToolMode("required"), schema


_AUTO_UNSUPPORTED = (
    "tool_choice 'auto' (the default when tools are given) needs a tool-call parser for this model, "
    "which paved does not configure; send tool_choice 'required', a named function, or 'none'"
)


def _parameters(tool) -> dict[str, Any]:
    return dict(tool.function.parameters or {"type": "object", "properties": {}})


# Keywords whose values are JSON data, not subschemas: a "$ref" inside them is data.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords mapping names (any name, "default" included) to subschemas.
_NAMED_SUBSCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebased(schema: Any, prefix: str, depth: int = 0) -> Any:
    """`schema` with each local `$ref` ("#" or "#/...") made relative to `prefix` instead of
    the root. Bounded in depth (a 400 past MAX_DEPTH, never a RecursionError)."""
    if depth > MAX_DEPTH:
        raise APIError(400, f"tool parameters are nested more than {MAX_DEPTH} levels deep", param="tools")
    if isinstance(schema, list):
        return [_rebased(item, prefix, depth + 1) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = prefix + value[1:]
        elif key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
            out[key] = {name: _rebased(sub, prefix, depth + 2) for name, sub in value.items()}
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, prefix, depth + 1)
    return out


def sampling_options(
    body: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    resolved: Resolved,
) -> SamplingOptions:
    """The engine's sampling options for validated OpenAI fields (the KServe server maps
    Triton's sampling_parameters through here too, so both APIs agree)."""
    return SamplingOptions(
        max_tokens=max_tokens,
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=body.stop_list(),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        constraint=resolved.constraint,
    )

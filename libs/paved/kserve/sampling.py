"""Triton vLLM backend `sampling_parameters` -> the engine protocol's `SamplingOptions`.

Server side (`options_from_parameters`): the JSON object a Triton + vLLM client sends, keyed by
vLLM `SamplingParams` names, validated with the OpenAI frontend's own request model and
constraint resolver (`paved.frontend.schemas` / `paved.frontend.structured`), so both APIs
accept the same ranges and route constraints to the same backend. Like the vLLM backend,
numbers and booleans may arrive as strings ("0.7", "true"): its own sample client sends them so.
Constraints come in as vLLM's `structured_outputs` (or its older name `guided_decoding`; either
an object or its JSON text, the form the vLLM backend parses), OpenAI's `response_format`,
paved's `paved_constraint`, or `extra_args: {"paved_constraint": ...}`. A key paved does not
honour is INVALID_ARGUMENT; nothing is dropped.

The client side (`parameters_from_options`, for `KServeEngine`) is in `paved.kserve.wire`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from paved.engine import text as unicode_text
from paved.engine.protocol import ModelCard, SamplingOptions
from paved.http.json_body import JSONBodyError, parse_json
from paved.kserve.errors import invalid_argument
from paved.kserve.wire import PAVED_CONSTRAINT

# vLLM SamplingParams fields paved honours only at vLLM's default value: a client that sets
# the default explicitly is served, any other value is refused.
_DEFAULT_ONLY: dict[str, Any] = {
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "detokenize": True,
    "use_beam_search": False,
    "stop_token_ids": [],
    "bad_words": [],
    "allowed_token_ids": None,
    "truncate_prompt_tokens": None,
    "lora_name": None,
    "logits_processors": None,
}
# SamplingFields members that are request-level in OpenAI's API, not sampling parameters.
_NOT_SAMPLING = {"model", "stream", "stream_options", "user"}
# Passed through to the OpenAI frontend's request model (same names as vLLM's).
_FIELDS = {
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    "response_format",
    "structured_outputs",
}
_OWN = {
    "max_tokens",
    "logprobs",
    "prompt_logprobs",
    "best_of",
    "guided_decoding",
    "extra_args",
    PAVED_CONSTRAINT,
}


# Sampling parameters are a few hundred bytes (a 300-entry logit_bias is ~6 KB); they are
# parsed and checked on the event loop, so a larger object is refused rather than parsed.
MAX_PARAMETERS_BYTES = 1024 * 1024


def parse_parameters(text: bytes | str, source: str) -> dict[str, Any]:
    """The JSON object in a `sampling_parameters` tensor."""
    if len(text) > MAX_PARAMETERS_BYTES:
        raise invalid_argument(f"{source} is {len(text)} bytes; at most {MAX_PARAMETERS_BYTES} are accepted")
    try:
        value = parse_json(text)
    except JSONBodyError as e:
        raise invalid_argument(f"{source} is {e}") from e
    if not isinstance(value, dict):
        raise invalid_argument(f"{source} must be a JSON object, got {type(value).__name__}")
    path = unicode_text.unencodable_path(value)
    if path is not None:
        raise invalid_argument(f"{source}: {unicode_text.message(path)}")
    return value


def _json_value(value: Any, where: str) -> Any:
    """vLLM's backend sends nested objects as JSON text; accept both forms."""
    if isinstance(value, str):
        try:
            value = parse_json(value)
        except JSONBodyError as e:
            raise invalid_argument(f"{where} is a string but {e}") from e
        # The outer parse saw only text; escapes inside it are decoded just now.
        path = unicode_text.unencodable_path(value)
        if path is not None:
            raise invalid_argument(f"{where}: {unicode_text.message(path)}")
    return value


def _as_bool(value: Any) -> Any:
    """Triton's vLLM backend sends parameters as text ("false", "True"): its flags become
    booleans here, where the OpenAI request model takes JSON booleans only."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return value


def _int(params: dict, key: str, source: str, *, minimum: int, maximum: int | None = None) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise invalid_argument(f"{source}.{key} must be an integer, got {params[key]!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_argument(f"{source}.{key} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise invalid_argument(f"{source}.{key} must be {bound}, got {value}")
    return value


def options_from_parameters(params: dict[str, Any], card: ModelCard, source: str) -> SamplingOptions:
    """Validate Triton vLLM-backend sampling parameters for `card` (raises INVALID_ARGUMENT).

    Blocking: a constraint's first check can take long (the server calls `admit_options`)."""
    from paved.frontend.errors import APIError
    from paved.frontend.structured import resolve

    fields = _prepare(params, card, source)
    try:
        return fields.options(resolve(fields.request, card))
    except APIError as e:
        raise _invalid(e, source) from e


async def admit_options(params: dict[str, Any], card: ModelCard, source: str) -> SamplingOptions:
    """`options_from_parameters` through the OpenAI frontend's admission: a spec already checked
    costs one digest, a new one is checked once for all the requests that carry it, off the event
    loop; only a flood of distinct new specs is refused (UNAVAILABLE), never a burst of one."""
    from paved.frontend.errors import APIError
    from paved.frontend.structured import resolve_async

    fields = _prepare(params, card, source)
    try:
        return fields.options(await resolve_async(fields.request, card))
    except APIError as e:
        raise _invalid(e, source) from e


def _invalid(e: Any, source: str) -> Exception:
    where = f"{source}.{e.param}: " if e.param else f"{source}: "
    return invalid_argument(where + e.message)


@dataclass(frozen=True)
class _Prepared:
    """Validated fields of one request, before its constraint is resolved."""

    request: Any  # paved.frontend.schemas.SamplingFields
    max_tokens: int | None
    logprobs: int | None

    def options(self, resolved: Any) -> SamplingOptions:
        from paved.frontend.structured import sampling_options

        # The OpenAI frontend's own mapping, so both APIs turn the same fields into the same options.
        return sampling_options(
            self.request,
            max_tokens=self.max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=None,
            resolved=resolved,
        )


def _prepare(params: dict[str, Any], card: ModelCard, source: str) -> _Prepared:
    # Imported on first use: a server of classic models only never loads the OpenAI request
    # model, nor the native constraint engine behind its resolver.
    from paved.frontend.schemas import SamplingFields

    unknown = sorted(set(params) - _FIELDS - _OWN - set(_DEFAULT_ONLY))
    if unknown:
        hint = " (set it as an input tensor)" if "stream" in unknown else ""
        raise invalid_argument(f"{source}: unknown sampling parameter(s) {unknown}{hint}")
    for key, default in _DEFAULT_ONLY.items():
        value = _as_bool(params.get(key)) if isinstance(default, bool) else params.get(key)
        if key in params and value != default and not (default in ([], None) and not value):
            raise invalid_argument(f"{source}.{key}={params[key]!r} is not supported (only {default!r})")

    fields: dict[str, Any] = {k: v for k, v in params.items() if k in _FIELDS}
    if "ignore_eos" in fields:
        fields["ignore_eos"] = _as_bool(fields["ignore_eos"])
    if "guided_decoding" in params:
        if "structured_outputs" in params:
            raise invalid_argument(f"{source}: structured_outputs and guided_decoding both given; send one")
        fields["structured_outputs"] = params["guided_decoding"]
    if "structured_outputs" in fields:
        fields["structured_outputs"] = _json_value(
            fields["structured_outputs"], f"{source}.structured_outputs"
        )
    if "response_format" in fields:
        fields["response_format"] = _json_value(fields["response_format"], f"{source}.response_format")
    xargs = _json_value(params.get("extra_args") or {}, f"{source}.extra_args")
    if not isinstance(xargs, dict):
        raise invalid_argument(f"{source}.extra_args must be an object")
    xargs = dict(xargs)
    if PAVED_CONSTRAINT in params:
        if PAVED_CONSTRAINT in xargs:
            raise invalid_argument(f"{source}: paved_constraint given twice (top level and in extra_args)")
        xargs[PAVED_CONSTRAINT] = params[PAVED_CONSTRAINT]
    if xargs:
        fields["vllm_xargs"] = xargs
    if fields.get("top_k") in (-1, "-1"):
        fields["top_k"] = 0  # vLLM's old spelling of "disabled"

    n = _int(params, "n", source, minimum=1) or 1
    best_of = _int(params, "best_of", source, minimum=1)
    if best_of is not None and best_of != n:
        raise invalid_argument(f"{source}.best_of other than n is not supported")
    logprobs = _int(params, "logprobs", source, minimum=0, maximum=card.max_logprobs)
    if params.get("prompt_logprobs") is not None:
        raise invalid_argument(
            f"{source}.prompt_logprobs is not supported: the vLLM tensor interface cannot return them"
        )
    max_tokens = _int(params, "max_tokens", source, minimum=1)

    try:
        request = SamplingFields.model_validate({"model": card.id, **fields})
    except ValidationError as e:
        raise invalid_argument(_validation_message(e, source)) from e
    return _Prepared(request, max_tokens if "max_tokens" in params else 16, logprobs)


def _validation_message(error: ValidationError, source: str) -> str:
    parts = []
    for item in error.errors()[:3]:
        loc = ".".join(str(p) for p in item.get("loc", ()))
        if item.get("type") == "extra_forbidden":
            parts.append(f"{source}.{loc}: unknown field")
        else:
            parts.append(f"{source}.{loc}: {item['msg']}" if loc else f"{source}: {item['msg']}")
    return "; ".join(parts)

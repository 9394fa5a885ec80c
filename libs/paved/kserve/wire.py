"""What a KServe v2 client and paved's KServe server agree on beyond the protocol itself.

Both ends depend on this module (and on `tensors` / `errors`, the rest of the wire format);
neither end's code lives here. The remote engine (`paved.engine.kserve_engine`) builds requests
with it and reads what the server publishes; the server (`paved.kserve.llm`, `grpc_server`)
publishes it. A real Triton vLLM backend understands the `sampling_parameters` produced here;
the `paved.*` model parameters and the in-band error code are paved's own additions.
"""

from __future__ import annotations

import json
import re
from typing import Any

from paved.engine.protocol import Constraint, InvalidRequestError, SamplingOptions

# ModelConfig parameters a KServeEngine reads to describe a paved-served model exactly.
PARAM_MAX_MODEL_LEN = "paved.max_model_len"
PARAM_CONSTRAINT_BACKENDS = "paved.constraint_backends"
PARAM_MAX_LOGPROBS = "paved.max_logprobs"
PARAM_KIND = "paved.kind"

# Response parameter naming the status code of an in-band stream error: Triton's stream
# protocol carries none, and the client needs it to tell a bad request from an outage.
ERROR_CODE_PARAMETER = "paved_error_code"
# Beside an in-band UNAVAILABLE that is push-back (an admission bound or a queue full, not an
# outage): the seconds to wait, the HTTP Retry-After the refusal would have had. A client
# counts such a refusal apart from failures, as alerting does.
RETRY_AFTER_PARAMETER = "paved_retry_after_s"

# The same code where a server cannot set response parameters on an error: Triton (2.51
# measured) sends a Python-backend model's `TritonError(message, code)` on ModelStreamInfer as
# `error_message` alone, code and parameters dropped. A model behind Triton that wants its error
# answered as a client error starts the message with this marker and a gRPC status name:
# "[paved_error_code=INVALID_ARGUMENT] the grammar does not parse". Only the marker is read,
# never the text after it.
ERROR_CODE_MARKER = re.compile(r"\[paved_error_code=([A-Z_]+)\] ")


def marked_error(code: str, message: str) -> str:
    """`message` carrying `code` (a gRPC status name) for clients that read ERROR_CODE_MARKER."""
    return f"[{ERROR_CODE_PARAMETER}={code}] {message}"


def error_code_of(message: str) -> tuple[str, str]:
    """(the status name a message is marked with, or "", the message without its marker)."""
    match = ERROR_CODE_MARKER.match(message)
    if match is None:
        return "", message
    return match.group(1), message[match.end() :]


# The `sampling_parameters` key (top level or in `extra_args`) of a paved constraint spec.
PAVED_CONSTRAINT = "paved_constraint"


def parameters_from_options(options: SamplingOptions) -> dict[str, Any]:
    """The `sampling_parameters` object for a remote Triton vLLM backend (or paved's server).

    `max_tokens` None ("up to the end of the context") is sent as null: paved's server takes it,
    a real Triton vLLM backend may not, so callers that can count prompt tokens should bound it.
    """
    if options.prompt_logprobs is not None:
        raise InvalidRequestError(
            "prompt logprobs are not available through the KServe v2 vLLM tensor interface",
            param="prompt_logprobs",
        )
    params: dict[str, Any] = {"n": options.n, "max_tokens": options.max_tokens}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "logprobs"):
        value = getattr(options, name)
        if value is not None:
            params[name] = value
    if options.stop:
        params["stop"] = list(options.stop)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(options, name):
            params[name] = getattr(options, name)
    if options.logit_bias:
        params["logit_bias"] = {str(k): v for k, v in options.logit_bias.items()}
    if options.min_tokens:
        params["min_tokens"] = options.min_tokens
    if options.ignore_eos:
        params["ignore_eos"] = True
    if options.constraint is not None:
        params.update(constraint_parameters(options.constraint))
    return params


def constraint_parameters(constraint: Constraint) -> dict[str, Any]:
    if constraint.backend == "paved":
        return {"extra_args": {PAVED_CONSTRAINT: constraint.value}}
    key = {"json_schema": "json", "json_object": "json_object", "regex": "regex", "choice": "choice"}.get(
        constraint.kind, constraint.kind
    )
    value = True if constraint.kind == "json_object" else constraint.value
    # JSON text: the vLLM backend builds StructuredOutputsParams(**json.loads(value)).
    return {"structured_outputs": json.dumps({key: value})}

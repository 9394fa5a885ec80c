"""A remote engine: one model served by a KServe v2 gRPC server running Triton's vLLM backend.

`KServeEngine.from_uri("kserve://scoring:8001", "llama")` lets the OpenAI frontend front a
remote Model Scoring Service (Triton + vLLM, or paved's own KServe server) through the Engine
protocol. Every request is one ModelStreamInfer call with the vLLM backend's tensors; its
sampling options, constraints included, travel in `sampling_parameters` in the form the
backend parses (`structured_outputs` as JSON text; paved specs in `extra_args`, read by paved's
logits processor when installed in the remote vLLM). This is the `response_format` path
Triton's own OpenAI frontend lacks: a constraint is sent, or the request is refused. An
xgrammar constraint that xgrammar cannot parse is refused here, before it travels: Triton's
stream carries no status code, so the remote's refusal would otherwise read as a failure. A
remote error is a client error only when the server names its code (paved's response
parameter, or the message marker of `paved.kserve.wire.ERROR_CODE_MARKER`).

What the tensor interface cannot carry is refused with InvalidRequestError, never faked:
token-id prompts, prompt logprobs, max_tokens=0 scoring. Chat prompts and `tokenize` need the
model's tokenizer locally (`?tokenizer=DIR`), as Triton's OpenAI frontend needs one too.
Output deltas carry text, logprobs and finish reasons; token ids are not among the
backend's outputs, so `ChoiceDelta.token_ids` stays empty and `ChoiceDelta.num_tokens`
carries the server's `num_output_tokens` (usage and the generated-tokens metric).

The model's description comes from its ModelConfig: a paved server publishes max_model_len,
constraint backends and logprob limit there (`paved.*` parameters); for a plain Triton server
pass them in the URI (`?max_model_len=4096&constraint_backends=xgrammar`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, cast

import grpc
import numpy as np
from prometheus_client import Metric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from tritonclient.grpc import service_pb2, service_pb2_grpc

from paved.constraints.lru import LockedLRU
from paved.engine.protocol import (
    ChatPrompt,
    ChoiceDelta,
    Constraint,
    ConstraintBackend,
    EmbedRequest,
    EmbedResult,
    EngineError,
    EngineOverloadedError,
    EngineUnavailableError,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    InvalidRequestError,
    ModelCard,
    ModelKind,
    ModelNotFoundError,
    TextPrompt,
    TokenLogprob,
    TokenPrompt,
    TopLogprob,
)
from paved.engine.streams import Closing, gather_or_cancel
from paved.engine.text import render_chat_template_off_loop

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
from paved.kserve.tensors import from_raw, serialize_bytes
from paved.kserve.wire import (
    ERROR_CODE_PARAMETER,
    PARAM_CONSTRAINT_BACKENDS,
    PARAM_KIND,
    PARAM_MAX_LOGPROBS,
    PARAM_MAX_MODEL_LEN,
    RETRY_AFTER_PARAMETER,
    error_code_of,
    parameters_from_options,
)

logger = logging.getLogger(__name__)

SCHEME = "kserve"
_URI_OPTIONS = {
    "tokenizer",
    "max_model_len",
    "constraint_backends",
    "max_logprobs",
    "kind",
    "connect_timeout_s",
    "rpc_timeout_s",
    "request_timeout_s",
}
_BACKENDS: tuple[ConstraintBackend, ...] = ("paved", "xgrammar")
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort", "error": "abort"}
_HEALTH_INTERVAL_S = 5.0
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Deadlines of the remote calls: health and metadata RPCs answer at once on a healthy server;
# a request (one ModelStreamInfer call, generation or embedding) may take as long as a long
# generation. Both are URI options; request_timeout_s=0 means none.
DEFAULT_RPC_TIMEOUT_S = 10.0
DEFAULT_REQUEST_TIMEOUT_S = 600.0


class _Aborted(Exception):
    """The call was cancelled by `KServeEngine.abort`."""


def _status_error(e: grpc.aio.AioRpcError, target: str, deadline: str = "") -> EngineError:
    """`deadline` names the limit that set the call's deadline, for DEADLINE_EXCEEDED."""
    code, details = e.code(), e.details() or ""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline:
        return EngineUnavailableError(
            f"remote KServe server {target}: no complete answer within {deadline} (DEADLINE_EXCEEDED)"
        )
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return ModelNotFoundError(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return InvalidRequestError(f"the request is too large for the remote server: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return EngineUnavailableError(f"remote KServe server {target}: {details or code.name}")
    return EngineError(f"remote KServe server {target}: {code.name}: {details}")


def _inband_error(response: service_pb2.ModelStreamInferResponse, target: str) -> EngineError:
    """An error a stream delivered in-band. paved's server names its status code in a response
    parameter; Triton drops a model's code, so a model behind it names the code with
    `wire.ERROR_CODE_MARKER` at the start of its message. Errors naming no code are engine
    failures: never guessed at from their text."""
    code, message = error_code_of(response.error_message)
    params = response.infer_response.parameters
    if ERROR_CODE_PARAMETER in params:
        code = params[ERROR_CODE_PARAMETER].string_param
    if code == "INVALID_ARGUMENT":
        return InvalidRequestError(message)
    if code == "NOT_FOUND":
        return ModelNotFoundError(message)
    if code == "UNAVAILABLE":
        if RETRY_AFTER_PARAMETER in params:  # paved's push-back, with its delay
            delay = params[RETRY_AFTER_PARAMETER].int64_param
            return EngineOverloadedError(message, retry_after_s=max(1, delay))
        if "queue" in message.lower():
            return EngineOverloadedError(message)
        return EngineUnavailableError(message)
    return EngineError(f"remote KServe server {target}: {message}")


# xgrammar's C++ errors start with "[HH:MM:SS] /path/file.cc:LINE: ": not the user's business.
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# Outcomes of the parse by (kind, canonical JSON of the spec): "" = it parses. Requests repeat
# their specs; a parse of a large schema costs more than this key.
_PARSED: LockedLRU[tuple[str, str], str] = LockedLRU(256)


def _xgrammar_refusal(constraint: Constraint) -> str | None:
    """`_parse_refusal`, memoized."""
    key = (constraint.kind, json.dumps(constraint.value, sort_keys=True))
    outcome = _PARSED.get(key)
    if outcome is None:
        outcome = _parse_refusal(constraint) or ""
        _PARSED.put(key, outcome)
    return outcome or None


def _parse_refusal(constraint: Constraint) -> str | None:
    """Why xgrammar cannot parse `constraint`, or None (it parses, or xgrammar is not installed
    here and the remote alone decides). Blocking: the first call imports xgrammar (~3 s).

    The parses the remote vLLM's own check runs first (vllm.v1.structured_output.
    backend_xgrammar.validate_xgrammar_grammar): a spec that fails here fails there, and is
    refused before it travels, since Triton's stream carries no status code for the remote's
    refusal. vLLM's further policy (schema features it declines) is the remote's to report."""
    try:
        import xgrammar
    except ImportError:
        return None
    kind, value = constraint.kind, constraint.value
    try:
        if kind == "regex":
            if "\x00" in value:
                return "the regex must not contain a NUL character"
            xgrammar.Grammar.from_regex(value)
        elif kind == "grammar":
            # vLLM's rule (grammar_is_likely_lark): EBNF when any line defines a rule with ::=.
            lines = (re.sub(r"(#|//).*$", "", line) for line in value.split("\n"))
            if any("::=" in line for line in lines):
                xgrammar.Grammar.from_ebnf(value)
            else:
                xgrammar.Grammar.from_lark(value)
        elif kind == "choice":
            if not value:
                return "choice needs at least one string"
        elif kind == "json_schema":
            xgrammar.Grammar.from_json_schema(json.dumps(value))
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and friends for any bad spec
        return _XGRAMMAR_LOCATION.sub("", str(e)).strip()
    return None


async def _check_constraint(constraint: Constraint | None) -> None:
    """InvalidRequestError for an xgrammar constraint that does not parse."""
    if constraint is None or constraint.backend != "xgrammar" or constraint.kind == "json_object":
        return
    reason = await asyncio.to_thread(_xgrammar_refusal, constraint)
    if reason is not None:
        raise InvalidRequestError(f"the {constraint.kind} constraint cannot be compiled: {reason}")


def _tensor(request: service_pb2.ModelInferRequest, name: str, datatype: str, value: Any) -> None:
    request.inputs.add(name=name, datatype=datatype, shape=[1])
    if datatype == "BYTES":
        request.raw_input_contents.append(serialize_bytes(np.array([value], dtype=object)))
    else:
        request.raw_input_contents.append(np.array([value], dtype=np.bool_).tobytes())


def _outputs(response: service_pb2.ModelInferResponse) -> dict[str, np.ndarray]:
    raw = response.raw_output_contents
    out = {}
    for i, tensor in enumerate(response.outputs):
        if i < len(raw):
            out[tensor.name] = from_raw(tensor.name, tensor.datatype, tensor.shape, raw[i])
    return out


def _logprobs(text: bytes, top: int) -> list[TokenLogprob] | None:
    """vLLM's per-position {token_id: {logprob, rank, decoded_token}} (chosen token first)."""
    positions = json.loads(text)
    if positions is None:
        return None
    result = []
    for position in positions:
        entries = [(int(k), v) for k, v in position.items()]
        if not entries:
            continue
        chosen_id, chosen = entries[0]
        alternatives = sorted(
            (e for e in entries if e[1].get("rank") is not None and e[1]["rank"] <= top),
            key=lambda e: e[1]["rank"],
        )
        result.append(
            TokenLogprob(
                token=chosen.get("decoded_token") or "",
                token_id=chosen_id,
                logprob=float(chosen["logprob"]),
                top=[
                    TopLogprob(v.get("decoded_token") or "", tid, float(v["logprob"]))
                    for tid, v in alternatives
                ],
            )
        )
    return result


def _merged(into: GenerateOutput, out: GenerateOutput) -> GenerateOutput:
    """`into` followed by `out`, as one output (`into` is updated)."""
    choices = {c.index: c for c in into.choices}
    for delta in out.choices:
        held = choices.get(delta.index)
        if held is None:
            into.choices.append(delta)
            choices[delta.index] = delta
            continue
        held.text += delta.text
        if delta.logprobs is not None:
            held.logprobs = [*(held.logprobs or ()), *delta.logprobs]
        if delta.num_tokens is not None:
            held.num_tokens = held.token_count + delta.num_tokens
        held.finish_reason = delta.finish_reason or held.finish_reason
    into.finished = out.finished
    return into


class _Overrides(TypedDict):
    """What the URI or the caller fixed; None: the remote model's published value."""

    max_model_len: int | None
    constraint_backends: tuple[ConstraintBackend, ...] | None
    max_logprobs: int | None
    kind: ModelKind | None


class KServeEngine:
    """One remote model over KServe v2 gRPC."""

    def __init__(
        self,
        target: str,
        model: str,
        *,
        tokenizer: str | None = None,
        max_model_len: int | None = None,
        constraint_backends: Sequence[str] | None = None,
        max_logprobs: int | None = None,
        kind: str | None = None,
        connect_timeout_s: float = 120.0,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ):
        if constraint_backends is not None and set(constraint_backends) - set(_BACKENDS):
            raise ValueError(
                f"constraint_backends must be drawn from {_BACKENDS}, got {list(constraint_backends)}"
            )
        if kind not in (None, "generate", "embed"):
            raise ValueError(f"kind must be 'generate' or 'embed', got {kind!r}")
        for name, value, zero_ok in (
            ("connect_timeout_s", connect_timeout_s, False),
            ("rpc_timeout_s", rpc_timeout_s, False),
            ("request_timeout_s", request_timeout_s, True),
        ):
            if not (value >= 0 if zero_ok else value > 0) or value == float("inf"):
                sign = "non-negative" if zero_ok else "positive"
                raise ValueError(f"{name} must be a {sign} number of seconds, got {value}")
        self.target = target
        self.model = model
        self._tokenizer_path = tokenizer
        self._overrides: _Overrides = {
            "max_model_len": max_model_len,
            # Both checked against their Literal's values above.
            "constraint_backends": tuple(cast(Sequence[ConstraintBackend], constraint_backends))
            if constraint_backends is not None
            else None,
            "max_logprobs": max_logprobs,
            "kind": cast(ModelKind | None, kind),
        }
        self.connect_timeout_s = connect_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.request_timeout_s = request_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: service_pb2_grpc.GRPCInferenceServiceStub | None = None
        self._card: ModelCard | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._ready = False
        self._health: asyncio.Task | None = None
        self._calls: dict[str, grpc.aio.StreamStreamCall] = {}
        self._counts = {"ok": 0, "error": 0, "cancelled": 0}
        self._generated_tokens = 0

    @classmethod
    def from_uri(cls, uri: str, model: str, **overrides: Any) -> KServeEngine:
        """`kserve://HOST:PORT[?tokenizer=DIR&max_model_len=N&constraint_backends=paved,xgrammar
        &max_logprobs=N&kind=generate|embed&connect_timeout_s=S&rpc_timeout_s=S
        &request_timeout_s=S]`; keyword overrides win."""
        parts = urllib.parse.urlsplit(uri)
        if parts.scheme != SCHEME or not parts.hostname or parts.port is None or parts.path not in ("", "/"):
            raise ValueError(f"expected {SCHEME}://HOST:PORT[?options], got {uri!r}")
        query = urllib.parse.parse_qs(parts.query, strict_parsing=False, keep_blank_values=True)
        unknown = sorted(set(query) - _URI_OPTIONS)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} in {uri!r}; known: {sorted(_URI_OPTIONS)}")
        options: dict[str, Any] = {k: v[-1] for k, v in query.items()}
        for key in ("max_model_len", "max_logprobs"):
            if key in options:
                options[key] = int(options[key])
        for key in ("connect_timeout_s", "rpc_timeout_s", "request_timeout_s"):
            if key in options:
                try:
                    options[key] = float(options[key])
                except ValueError:
                    raise ValueError(f"{key} must be a number of seconds, got {options[key]!r}") from None
        if "constraint_backends" in options:
            options["constraint_backends"] = [b for b in options["constraint_backends"].split(",") if b]
        options.update(overrides)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return cls(f"{host}:{parts.port}", model, **options)

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self._card is not None:
            return  # already started (a registry may start every engine it is given)
        self._channel = grpc.aio.insecure_channel(
            self.target,
            options=[
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                # Long generations idle between tokens; keepalives stop middleboxes dropping them.
                ("grpc.keepalive_time_ms", 30_000),
            ],
        )
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        if self._tokenizer_path:
            self._tokenizer = await asyncio.to_thread(self._load_tokenizer, self._tokenizer_path)
        await self._wait_model_ready()
        try:
            config = (
                await self._rpc.ModelConfig(
                    service_pb2.ModelConfigRequest(name=self.model), timeout=self.rpc_timeout_s
                )
            ).config
        except grpc.aio.AioRpcError as e:
            raise _status_error(
                e, self.target, f"rpc_timeout_s={self.rpc_timeout_s:g} s (ModelConfig)"
            ) from e
        self._card = self._describe(config)
        self._ready = True
        self._health = asyncio.create_task(self._watch_health(), name=f"kserve-health-{self.model}")
        logger.info(
            "remote model %s at %s ready (max_model_len %d, constraint backends: %s)",
            self.model,
            self.target,
            self._card.max_model_len,
            ", ".join(self._card.constraint_backends) or "none",
        )

    @staticmethod
    def _load_tokenizer(path: str) -> PreTrainedTokenizerBase:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)

    async def _wait_model_ready(self) -> None:
        deadline = time.monotonic() + self.connect_timeout_s
        last = "no answer"
        while True:
            try:
                response = await self._rpc.ModelReady(
                    service_pb2.ModelReadyRequest(name=self.model),
                    timeout=max(min(self.rpc_timeout_s, deadline - time.monotonic()), 0.1),
                )
                if response.ready:
                    return
                last = f"model {self.model!r} is not ready"
            except grpc.aio.AioRpcError as e:
                last = f"{e.code().name}: {e.details()}"
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    last += f" (rpc_timeout_s={self.rpc_timeout_s:g} s)"
            if time.monotonic() >= deadline:
                raise EngineUnavailableError(
                    f"remote KServe server {self.target}: model {self.model!r} not ready after "
                    f"{self.connect_timeout_s:.0f} s ({last})"
                )
            await asyncio.sleep(0.5)

    def _describe(self, config) -> ModelCard:
        params = {k: v.string_value for k, v in config.parameters.items()}
        inputs = {t.name for t in config.input}
        kind = (
            self._overrides["kind"]
            or params.get(PARAM_KIND)
            or ("embed" if "embedding_request" in inputs and "text_input" not in inputs else "generate")
        )
        if kind not in ("generate", "embed"):
            raise ValueError(f"remote model {self.model!r} publishes kind {kind!r}, not generate or embed")
        max_model_len = self._overrides["max_model_len"] or int(params.get(PARAM_MAX_MODEL_LEN, "0"))
        if not max_model_len and self._tokenizer is not None:
            max_model_len = int(getattr(self._tokenizer, "model_max_length", 0) or 0)
            if max_model_len > 10**7:  # transformers' "unset" sentinel
                max_model_len = 0
        if not max_model_len:
            raise ValueError(
                f"remote model {self.model!r} does not publish its context length; "
                "add ?max_model_len=N to the URI"
            )
        backends: tuple[ConstraintBackend, ...]
        if self._overrides["constraint_backends"] is not None:
            backends = self._overrides["constraint_backends"]
        else:
            if PARAM_CONSTRAINT_BACKENDS in params:
                # In the published order; a name this client does not know it cannot ask for.
                published = params[PARAM_CONSTRAINT_BACKENDS].split(",")
                backends = tuple(known for b in published for known in _BACKENDS if known == b)
            else:
                # Triton's vLLM backend builds StructuredOutputsParams (xgrammar) from sampling_parameters.
                backends = ("xgrammar",) if kind == "generate" else ()
        max_logprobs = self._overrides["max_logprobs"] or int(params.get(PARAM_MAX_LOGPROBS, "20"))
        return ModelCard(
            id=self.model,
            kind=kind,
            max_model_len=max_model_len,
            created=int(time.time()),
            owned_by=f"kserve://{self.target}",
            constraint_backends=backends,
            max_logprobs=max_logprobs,
        )

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(_HEALTH_INTERVAL_S)
            try:
                response = await self._rpc.ModelReady(
                    service_pb2.ModelReadyRequest(name=self.model), timeout=self.rpc_timeout_s
                )
                ready = response.ready
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self._ready:
                    logger.warning(
                        "remote model %s at %s: ModelReady got no answer within rpc_timeout_s=%g s",
                        self.model,
                        self.target,
                        self.rpc_timeout_s,
                    )
                ready = False
            if ready != self._ready:
                logger.warning(
                    "remote model %s at %s is %s", self.model, self.target, "ready" if ready else "NOT ready"
                )
            self._ready = ready

    async def stop(self) -> None:
        self._ready = False
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        for call in list(self._calls.values()):
            call.cancel()
        if self._channel is not None:
            await self._channel.close()

    def ready(self) -> bool:
        return self._ready

    def models(self) -> Sequence[ModelCard]:
        return [self._card] if self._card is not None else []

    @property
    def _rpc(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        """The stub start() made; every RPC after start() goes through it."""
        if self._stub is None:
            raise EngineUnavailableError(f"model {self.model!r}: remote engine not started")
        return self._stub

    # ---- requests ------------------------------------------------------------------------------
    def _check(self, model: str) -> ModelCard:
        if model != self.model:
            raise ModelNotFoundError(f"model {model!r} is not served by this engine")
        if self._card is None or self._stub is None:
            raise EngineUnavailableError(f"model {model!r}: remote engine not started")
        if not self._ready:
            raise EngineUnavailableError(f"model {model!r}: remote KServe server {self.target} is not ready")
        return self._card

    async def _prompt_text(self, prompt, param: str) -> str:
        if isinstance(prompt, TextPrompt):
            return prompt.text
        if isinstance(prompt, ChatPrompt):
            if self._tokenizer is None:
                raise InvalidRequestError(
                    "chat prompts need the model's chat template; "
                    "start the KServe engine with ?tokenizer=DIR",
                    param=param,
                )
            return await render_chat_template_off_loop(self._tokenizer, prompt, param)
        raise InvalidRequestError(
            "token-id prompts are not supported by the KServe v2 vLLM interface (text_input is text)",
            param=param,
        )

    async def generate(self, request: GenerateRequest) -> Closing:
        card = self._check(request.model)
        if card.kind != "generate":
            raise InvalidRequestError(
                f"model {request.model!r} is an embedding model; it cannot generate", param="model"
            )
        param = "messages" if isinstance(request.prompt, ChatPrompt) else "prompt"
        text = await self._prompt_text(request.prompt, param)
        s = request.sampling
        if s.max_tokens == 0:
            raise InvalidRequestError("max_tokens=0 (prompt scoring) is not supported by the KServe engine")
        params = parameters_from_options(s)
        await _check_constraint(s.constraint)
        prompt_ids = None
        if self._tokenizer is not None and (s.max_tokens is None or request.echo):
            prompt_ids = self._tokenizer.encode(
                text, add_special_tokens=not isinstance(request.prompt, ChatPrompt)
            )
            if s.max_tokens is None:
                # A real Triton backend wants a number; bound it by what the context leaves.
                params["max_tokens"] = max(card.max_model_len - len(prompt_ids), 1)

        infer = service_pb2.ModelInferRequest(model_name=self.model, id=request.request_id)
        _tensor(infer, "text_input", "BYTES", text.encode())
        # Always streamed from the remote, whatever the caller asked: its first response then
        # comes with the first token instead of with the last. Admission is awaited below; a
        # non-streaming wait for the whole generation there could not be cancelled by the
        # caller (a disconnected client's request ran to its end) and made a caller that
        # admits several prompts one after the other run them one after the other.
        _tensor(infer, "stream", "BOOL", True)
        _tensor(infer, "sampling_parameters", "BYTES", json.dumps(params).encode())
        _tensor(infer, "exclude_input_in_output", "BOOL", True)
        _tensor(infer, "return_num_input_tokens", "BOOL", True)
        _tensor(infer, "return_num_output_tokens", "BOOL", True)
        _tensor(infer, "return_finish_reason", "BOOL", True)
        if s.logprobs is not None:
            _tensor(infer, "return_logprobs", "BOOL", True)

        call = self._rpc.ModelStreamInfer(timeout=self.request_timeout_s or None)
        self._calls[request.request_id] = call
        try:
            await self._send(call, infer)
            # Admission: the first response (or the error that replaces it).
            first = await self._read(call)
        except BaseException:
            self._calls.pop(request.request_id, None)
            call.cancel()
            self._counts["error"] += 1
            raise
        if first is None:
            self._calls.pop(request.request_id, None)
            raise EngineError(f"remote KServe server {self.target} closed the stream without a response")
        # Closing, not the bare generator: a stream closed before its first item must still
        # cancel the call (closing an unstarted generator runs none of its code).
        return Closing(self._stream(request, call, first, text, prompt_ids), lambda: self._end(request, call))

    def _end(self, request: GenerateRequest, call: grpc.aio.StreamStreamCall) -> None:
        """After the stream closed. A stream that ran has already settled its call; one that
        never ran still owns it: cancelling is how a KServe client aborts (the server then
        aborts the engine request)."""
        if request.request_id not in self._calls or self._calls[request.request_id] is not call:
            return
        del self._calls[request.request_id]
        self._counts["cancelled"] += 1
        call.cancel()

    async def _send(self, call, infer: service_pb2.ModelInferRequest) -> None:
        """Write the call's one request. A call that has already failed (the remote is down or
        unreachable) raises its status here, before any read: mapped like a read's."""
        try:
            await call.write(infer)
            await call.done_writing()
        except grpc.aio.AioRpcError as e:
            hint = f"request_timeout_s={self.request_timeout_s:g} s" if self.request_timeout_s else ""
            raise _status_error(e, self.target, hint) from e

    async def _read(self, call) -> service_pb2.ModelInferResponse | None:
        try:
            message = await call.read()
        except grpc.aio.AioRpcError as e:
            hint = f"request_timeout_s={self.request_timeout_s:g} s" if self.request_timeout_s else ""
            raise _status_error(e, self.target, hint) from e
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError from a call cancelled by `abort`; only the
            # caller's own cancellation may propagate as such.
            task = asyncio.current_task()
            if call.cancelled() and not (task is not None and task.cancelling()):
                raise _Aborted() from None
            raise
        if message is grpc.aio.EOF:
            return None
        if message.error_message:
            raise _inband_error(message, self.target)
        return message.infer_response

    async def _stream(
        self, request: GenerateRequest, call, response, prompt_text: str, prompt_ids: list[int] | None
    ) -> AsyncIterator[GenerateOutput]:
        s = request.sampling
        first = True
        finished = False
        # Choices already finished. With n > 1 the remote reports every choice in every
        # response, an ended one again with its finish reason (and nothing new): dropped, so
        # that each choice finishes once.
        ended: set[int] = set()
        # stream=False: the outputs so far, handed on as one when the request ends.
        held: GenerateOutput | None = None
        try:
            while response is not None:
                outputs = _outputs(response)
                final = (
                    response.parameters["triton_final_response"].bool_param
                    if ("triton_final_response" in response.parameters)
                    else False
                )
                texts = outputs.get("text_output", np.empty(0, dtype=object))
                reasons = outputs.get("finish_reason")
                logprobs = outputs.get("logprobs")
                counts = outputs.get("num_output_tokens")
                choices = []
                for i in range(len(texts)):
                    if i in ended:
                        continue
                    reason = reasons[i].decode() if reasons is not None and i < len(reasons) else "None"
                    choices.append(
                        ChoiceDelta(
                            index=i,
                            text=texts[i].decode(),
                            logprobs=_logprobs(logprobs[i], s.logprobs or 0)
                            if logprobs is not None
                            else None,
                            finish_reason=_FINISH.get(reason)
                            if reason != "None"
                            else ("stop" if final else None),
                            num_tokens=int(counts.reshape(-1)[i])
                            if counts is not None and i < counts.size
                            else None,
                        )
                    )
                    if choices[-1].finish_reason is not None:
                        ended.add(i)
                if counts is not None:
                    self._generated_tokens += int(counts.sum())
                output = GenerateOutput(choices=choices, finished=final)
                if first:
                    first = False
                    if "num_input_tokens" in outputs:
                        output.prompt_tokens = int(outputs["num_input_tokens"].reshape(-1)[0])
                    if request.echo:
                        output.prompt_text = prompt_text
                        output.prompt_token_ids = prompt_ids
                finished = final
                if request.stream:
                    yield output
                else:
                    held = output if held is None else _merged(held, output)
                    if final:
                        yield held
                if final:
                    break
                try:
                    response = await self._read(call)
                except _Aborted:
                    # Aborted by request id: the choices end like an engine-side abort.
                    finished = True
                    end = GenerateOutput(
                        [ChoiceDelta(i, finish_reason="abort") for i in range(s.n) if i not in ended],
                        finished=True,
                    )
                    yield end if held is None else _merged(held, end)
                    break
            if not finished:
                raise EngineError(
                    f"remote KServe server {self.target} ended the stream before the final response"
                )
            self._counts["ok"] += 1
        except GeneratorExit:
            self._counts["cancelled"] += 1
            raise
        except BaseException:
            self._counts["error"] += 1
            raise
        finally:
            self._calls.pop(request.request_id, None)
            if not finished:
                # Cancelling the call is how a KServe client aborts: the server aborts the engine request.
                call.cancel()

    async def abort(self, request_id: str) -> None:
        call = self._calls.pop(request_id, None)
        if call is not None:
            call.cancel()

    async def embed(self, request: EmbedRequest) -> EmbedResult:
        card = self._check(request.model)
        if card.kind != "embed":
            raise InvalidRequestError(f"model {request.model!r} does not produce embeddings", param="model")

        async def one(i: int, prompt) -> tuple[list[float], int]:
            body: dict[str, Any] = {
                "input": prompt.text if isinstance(prompt, TextPrompt) else list(prompt.token_ids)
            }
            if request.dimensions is not None:
                body["pooling_params"] = {"dimensions": [request.dimensions]}
            infer = service_pb2.ModelInferRequest(model_name=self.model, id=f"{request.request_id}-{i}")
            _tensor(infer, "embedding_request", "BYTES", json.dumps(body).encode())
            _tensor(infer, "return_num_input_tokens", "BOOL", True)
            call = self._rpc.ModelStreamInfer(timeout=self.request_timeout_s or None)
            try:
                await self._send(call, infer)
                response = await self._read(call)
            finally:
                call.cancel()
            if response is None:
                raise EngineError(f"remote KServe server {self.target} sent no embedding for input {i}")
            outputs = _outputs(response)
            vector = json.loads(outputs["text_output"].reshape(-1)[0])
            count = int(outputs["num_input_tokens"].reshape(-1)[0]) if "num_input_tokens" in outputs else 0
            return vector, count

        for prompt in request.inputs:
            if not isinstance(prompt, TextPrompt | TokenPrompt):
                raise InvalidRequestError("embedding inputs must be text or token ids", param="input")
        results = await gather_or_cancel(*(one(i, p) for i, p in enumerate(request.inputs)))
        return EmbedResult(embeddings=[v for v, _ in results], prompt_tokens=sum(c for _, c in results))

    async def tokenize(self, model: str, text: str, *, add_special_tokens: bool) -> list[int]:
        self._check(model)
        if self._tokenizer is None:
            raise InvalidRequestError(
                "tokenize needs the model's tokenizer; start the KServe engine with ?tokenizer=DIR"
            )
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def metrics(self) -> Iterable[Metric]:
        requests = CounterMetricFamily(
            "paved_kserve_engine_requests",
            "Requests sent to the remote KServe server, by outcome",
            labels=["model", "outcome"],
        )
        for outcome, count in self._counts.items():
            requests.add_metric([self.model, outcome], count)
        up = GaugeMetricFamily(
            "paved_kserve_engine_ready", "1 while the remote model answers ready", labels=["model"]
        )
        up.add_metric([self.model], 1.0 if self._ready else 0.0)
        tokens = CounterMetricFamily(
            "paved_kserve_engine_generation_tokens",
            "Tokens generated remotely (num_output_tokens)",
            labels=["model"],
        )
        tokens.add_metric([self.model], self._generated_tokens)
        in_flight = GaugeMetricFamily(
            "paved_kserve_engine_in_flight", "Open generation streams", labels=["model"]
        )
        in_flight.add_metric([self.model], len(self._calls))
        return [requests, tokens, up, in_flight]

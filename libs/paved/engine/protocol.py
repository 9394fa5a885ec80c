"""The engine protocol: everything a frontend needs from whatever runs the models.

Transport-neutral on purpose (shaped like Triton's OpenAI frontend `LLMEngine` protocol, but
below the OpenAI layer): requests and outputs are plain dataclasses, errors are the exception
types below, metrics are Prometheus metric families. The in-process vLLM engine
(`paved.engine.vllm_engine`) implements it today; a remote KServe v2 / Triton engine can
implement it without touching the frontend, which imports only this module.

Semantics every implementation keeps:
  * `generate` yields *deltas*: concatenating the `text`/`token_ids`/`logprobs` of every
    `ChoiceDelta` with the same index gives that choice's whole output, whether the caller
    asked to stream or not (`stream=False` only lets the engine send fewer, larger deltas).
  * `await generate(...)` admits the request and returns its output stream. Client mistakes
    raise `InvalidRequestError` (or a subclass) there, before the frontend has committed to a
    status code, so they become HTTP 400 and never a 500 or a broken stream.
  * `aclose()` on the returned stream (always called by the frontend, also when the client
    disconnected before the first output) aborts the request if it has not finished and
    frees its engine resources; `abort` does the same by request id.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from prometheus_client import Metric

ModelKind = Literal["generate", "embed"]
# Who enforces an output constraint: paved's C++ engine (a normalized paved spec) or vLLM's
# structured outputs (xgrammar).
ConstraintBackend = Literal["paved", "xgrammar"]
FinishReason = Literal["stop", "length", "abort"]


# ---------------------------------------------------------------------------------------------
# Errors. Messages are written for the API client; the frontend forwards them verbatim.
# ---------------------------------------------------------------------------------------------
class EngineError(Exception):
    """Base class of the errors an engine raises on purpose."""


class InvalidRequestError(EngineError):
    """The request cannot be served as asked (HTTP 400). `param` names the offending field."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class PromptTooLongError(InvalidRequestError):
    """Prompt plus requested output does not fit the model's context (HTTP 400)."""

    def __init__(self, *, prompt_tokens: int, max_tokens: int, max_model_len: int, param: str | None = None):
        if prompt_tokens > max_model_len:
            message = (
                f"This model's maximum context length is {max_model_len} tokens, but the prompt "
                f"has {prompt_tokens} tokens."
            )
        else:
            message = (
                f"This model's maximum context length is {max_model_len} tokens, but "
                f"{prompt_tokens + max_tokens} tokens were requested ({prompt_tokens} in the "
                f"prompt, {max_tokens} for the completion). Reduce the prompt or max_tokens."
            )
        super().__init__(message, param=param, code="context_length_exceeded")
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class ModelNotFoundError(EngineError):
    """No engine serves this model (HTTP 404)."""


class EngineOverloadedError(EngineError):
    """The engine's queue is full; retry later (HTTP 503 with Retry-After).

    Push-back, not failure: the frontend counts every one it answers as a 503 in
    `paved_requests_rejected_total` by `model` (set by whoever knows it, "" otherwise) and
    `reason` (`queue_full`: the frontend's admission; `engine_queue_full`: the engine's own
    waiting queue; `constraint_checks`: the bound on distinct output constraints compiling),
    which alerting subtracts from a version's errors."""

    def __init__(self, message: str, retry_after_s: int = 1, reason: str = "engine_queue_full"):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason
        self.model = ""


class EngineUnavailableError(EngineError):
    """The engine is not ready (still loading) or has died (HTTP 503)."""


# ---------------------------------------------------------------------------------------------
# Models.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelCard:
    id: str
    kind: ModelKind
    max_model_len: int
    created: int
    owned_by: str = "paved"
    # Constraint backends this engine enforces, best first. Empty: no structured outputs.
    constraint_backends: tuple[ConstraintBackend, ...] = ()
    # Upper bound of `logprobs` / `prompt_logprobs` alternatives per position.
    max_logprobs: int = 20


# ---------------------------------------------------------------------------------------------
# Generation requests.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TextPrompt:
    text: str


@dataclass(frozen=True)
class TokenPrompt:
    token_ids: Sequence[int]


@dataclass(frozen=True)
class ChatPrompt:
    """Messages rendered with the model's chat template by the engine (which owns the tokenizer).

    `messages` are OpenAI-shaped dicts with string content; `tools` are OpenAI tool definitions
    handed to the template so the model sees them. `continue_final_message` (vLLM's extension;
    then `add_generation_prompt` is False and the last message is the assistant's) renders that
    message open, so generation continues its text instead of starting a new turn.
    """

    messages: Sequence[dict[str, Any]]
    tools: Sequence[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # About how large the messages and tools are, in bytes (the request body's length), when
    # the caller knows; 0: the engine estimates it from the message text.
    size_hint: int = 0


Prompt = TextPrompt | TokenPrompt | ChatPrompt


@dataclass(frozen=True)
class Constraint:
    """An output constraint and the backend chosen to enforce it.

    backend "paved":    kind "paved", value = a spec normalized by paved.constraints.spec,
                        key = its canonical digest (`spec.admit` returns both; engines trust
                        the pair and compile by the key).
    backend "xgrammar": kind "json_schema" (value: schema dict), "json_object" (value: None),
                        "regex" (str), "choice" (list[str]) or "grammar" (EBNF str).
    """

    backend: ConstraintBackend
    kind: Literal["paved", "json_schema", "json_object", "regex", "choice", "grammar"]
    value: Any = None
    key: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class SamplingOptions:
    """OpenAI sampling knobs plus the few vLLM extensions paved exposes.

    None means "the model's default" (its generation_config), like vLLM's own server.
    """

    # None: up to the end of the context. 0: prefill only (score the prompt, generate nothing).
    max_tokens: int | None = 16
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    # Alternatives per generated position (0: just the chosen token's logprob); None: none.
    logprobs: int | None = None
    # Same for prompt positions.
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    constraint: Constraint | None = None


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    model: str
    prompt: Prompt
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    # Streaming callers want small deltas early; others let the engine send one final delta.
    stream: bool = False
    # Return the prompt's text and token ids with the first output (completions `echo`).
    echo: bool = False


# ---------------------------------------------------------------------------------------------
# Generation outputs.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TopLogprob:
    token: str
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The logprob of the token at one position, plus the best alternatives there.

    `logprob` is None only for a prompt's first token, which nothing predicts.
    """

    token: str
    token_id: int
    logprob: float | None
    top: Sequence[TopLogprob] = ()


@dataclass
class ChoiceDelta:
    index: int
    text: str = ""
    token_ids: Sequence[int] = ()
    logprobs: Sequence[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    # The stop string or token id that ended the choice, if any.
    stop_reason: str | int | None = None
    # How many tokens this delta holds, for engines that know the count but not the ids
    # (the KServe v2 vLLM interface returns text and `num_output_tokens`); None: len(token_ids).
    num_tokens: int | None = None

    @property
    def token_count(self) -> int:
        return len(self.token_ids) if self.num_tokens is None else self.num_tokens


@dataclass
class GenerateOutput:
    choices: list[ChoiceDelta]
    # Set on the first output of a request.
    prompt_tokens: int | None = None
    # With prompt_logprobs, on the first output: one entry per prompt token.
    prompt_logprobs: Sequence[TokenLogprob] | None = None
    prompt_text: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    cached_prompt_tokens: int | None = None
    finished: bool = False


@runtime_checkable
class GenerateStream(Protocol):
    """The outputs of one admitted request.

    `aclose()` must free the request's engine resources (abort it) whenever it has not
    finished, including when the stream was never iterated; callers always call it. (An
    async generator does not qualify: closing one that never started runs none of its code.)
    """

    def __aiter__(self) -> AsyncIterator[GenerateOutput]: ...

    async def __anext__(self) -> GenerateOutput: ...

    async def aclose(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Embeddings.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EmbedRequest:
    request_id: str
    model: str
    inputs: Sequence[TextPrompt | TokenPrompt]
    dimensions: int | None = None


@dataclass(frozen=True)
class EmbedResult:
    embeddings: list[list[float]]
    prompt_tokens: int


# ---------------------------------------------------------------------------------------------
# The protocol.
# ---------------------------------------------------------------------------------------------
@runtime_checkable
class Engine(Protocol):
    """Serves one or more models. Frontends route by `ModelCard.id`."""

    async def start(self) -> None:
        """Load and warm up; returns once `ready()` is true. Raises if the engine cannot start."""

    async def stop(self) -> None:
        """Release every resource; in-flight requests end with `EngineUnavailableError`."""

    def ready(self) -> bool:
        """True once warm and while healthy."""

    def models(self) -> Sequence[ModelCard]: ...

    async def generate(self, request: GenerateRequest) -> GenerateStream:
        """Admit the request, then return the stream of its outputs (deltas, see above).

        Admission errors (validation, prompt too long, queue full) raise here, before the
        caller has committed to a response; errors after admission surface from the stream.
        """

    async def embed(self, request: EmbedRequest) -> EmbedResult: ...

    async def tokenize(self, model: str, text: str, *, add_special_tokens: bool) -> list[int]: ...

    async def abort(self, request_id: str) -> None: ...

    def metrics(self) -> Iterable[Metric]:
        """The engine's own Prometheus metric families (merged into the frontend's /metrics)."""

"""OpenAI API schemas (pydantic), the only place the wire format is spelled out.

Requests forbid unknown fields: a parameter paved cannot honour is a 400 naming it, never
silently ignored. Ranges follow OpenAI's API reference; vLLM extensions paved honours are
marked as such. The same models generate the OpenAPI document served at /openapi.json.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from paved.engine import text

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_BATCH = 2048
# A prompt (or embedding input) given as token ids, and a chat's messages: past any served
# model's context (a message renders to at least one token), and bounded so that a body of
# millions of them is refused by its length rather than walked and validated whole.
MAX_TOKEN_IDS = 1024 * 1024
# Tokens one logit_bias may name: a whole vocabulary (Gemma's 256k; OpenAI documents no bound),
# checked before its entries are converted (each key's int() runs on the event loop).
MAX_LOGIT_BIAS = 262_144
MAX_MESSAGES = 128 * 1024
# /v1/rank's context, in characters: about half a million tokens of English, past any served
# model's context; the bound stops a body's worth of text being tokenized only to be refused.
MAX_RANK_CONTEXT_CHARS = 2 * 1024 * 1024

NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]
MAX_TOKEN_ID = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
FunctionName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


# Flags are StrictBool: pydantic's lax mode would also take "yes", "off" or 1, which OpenAI
# refuses, and a client that sent them meant something else.
class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Body(Request):
    """A whole request body: every string in it must be Unicode text (see paved.engine.text),
    checked once here rather than per field (nested models do not repeat the walk).

    `_BOUNDED` (field, bound) are list fields whose length (or, for a list of lists, whose
    lists' lengths) is checked before that O(body) walk: a body refused for its size costs its
    length, and the error names the field as the schema's own max_length would.

    `_ITEMS` (field, kind) are list fields whose elements are checked first, in one pass that
    stops at the first bad one: "prompt" (all token ids, all strings, or all lists of token
    ids, as the first element says), "object" (all JSON objects). Pydantic reports every bad
    element, trying each branch of a union on each: a megabyte of bad items cost seconds of
    CPU with the GIL held and most of a gigabyte for one 400."""

    _BOUNDED: ClassVar[tuple[tuple[str, int], ...]] = ()
    _ITEMS: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Whether the body has a `logit_bias`, checked as `_ITEMS` are (its size, then its values).
    _LOGIT_BIAS: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for field, bound in cls._BOUNDED:
                _check_length(data.get(field), field, bound)
            for field, kind in cls._ITEMS:
                _check_items(data.get(field), field, kind)
            if cls._LOGIT_BIAS:
                _check_logit_bias(data.get("logit_bias"))
        path = text.unencodable_path(data)
        if path is not None:
            raise ValueError(text.message(path))
        return data


def _invalid(field: str, message: str, value: Any = None) -> ValidationError:
    """A validation error located at `field`: raised by a model-level validator that checks
    several fields, so that the 400 names the field to change (a ValueError there names none)."""
    error = PydanticCustomError("value_error", message)
    return ValidationError.from_exception_data(
        "request", [InitErrorDetails(type=error, loc=(field,), input=value)]
    )


def _token_id(value: Any) -> bool:
    # An integral float (1.0, 1e3) is a token id, as pydantic's lax int takes it; a bool is not.
    if type(value) is float and value.is_integer():
        value = int(value)
    return type(value) is int and 0 <= value <= MAX_TOKEN_ID


def _check_logit_bias(bias: Any) -> None:
    if not isinstance(bias, dict):
        return
    if len(bias) > MAX_LOGIT_BIAS:
        raise _invalid("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
    for token, value in bias.items():
        if type(value) not in (int, float) or not -100 <= value <= 100:
            raise _invalid("logit_bias", f"logit_bias[{token!r:.40}] must be a number from -100 to 100")


def _check_items(value: Any, field: str, kind: str) -> None:
    if not isinstance(value, list) or not value:
        return
    if kind == "object":
        good: Any = lambda item: isinstance(item, dict)  # noqa: E731
        what = "a JSON object"
    elif _token_id(value[0]):
        good, what = _token_id, "a token id (an integer 0..2**31-1), as the first element is"
    elif isinstance(value[0], str):
        good, what = (
            (lambda item: isinstance(item, str) and item != ""),
            "a non-empty string, as the first element is",
        )
    elif isinstance(value[0], list):
        good = lambda item: isinstance(item, list) and item != [] and all(map(_token_id, item))  # noqa: E731
        what = "a non-empty list of token ids, as the first element is"
    else:
        raise _invalid(field, f"{field}[0] must be a string, a token id or a list of token ids")
    for i, item in enumerate(value):
        if not good(item):
            raise _invalid(field, f"{field}[{i}] must be {what}")


def _check_length(value: Any, field: str, bound: int) -> None:
    if not isinstance(value, list):
        return
    where: tuple[str | int, ...] = (field,)
    too_long = value if len(value) > bound else None
    if too_long is None and value and isinstance(value[0], list):
        for i, item in enumerate(value):
            if isinstance(item, list) and len(item) > bound:
                where, too_long = (field, i), item
                break
    if too_long is None:
        return
    # Raised as the schema's own too_long error would be (the field in `loc`), not as a
    # ValueError of this model-level validator (which has no field to name).
    ctx = {"field_type": "List", "max_length": bound, "actual_length": len(too_long)}
    raise ValidationError.from_exception_data(
        "request", [InitErrorDetails(type="too_long", loc=where, input=[], ctx=ctx)]
    )


# ---------------------------------------------------------------------------------------------
# Shared request pieces.
# ---------------------------------------------------------------------------------------------
class JsonSchemaFormat(Request):
    name: FunctionName
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormatText(Request):
    type: Literal["text"]


class ResponseFormatJsonObject(Request):
    type: Literal["json_object"]
    # The Together / Anyscale / Fireworks convention (instructor's Mode.JSON_SCHEMA sends it):
    # JSON mode constrained by this schema, as json_schema's is.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class ResponseFormatJsonSchema(Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]


class StructuredOutputs(Request):
    """vLLM's `structured_outputs` extension: exactly one of the constraint fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: NonEmptyStr | None = None
    choice: list[NonEmptyStr] | None = Field(default=None, min_length=1)
    grammar: NonEmptyStr | None = None
    json_object: StrictBool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [
            name
            for name, value in (
                ("json", self.json_),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object"
                + (f"; got {given}" if given else "")
            )
        return self


class StreamOptions(Request):
    include_usage: StrictBool | None = None


class SamplingFields(Body):
    """Fields common to chat and completions."""

    _LOGIT_BIAS = True

    model: NonEmptyStr
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    user: str | None = Field(default=None, max_length=512)
    response_format: ResponseFormat | None = None
    # vLLM extensions paved honours.
    top_k: int | None = Field(default=None, ge=0, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0, le=2**31 - 1)
    ignore_eos: StrictBool = False
    structured_outputs: StructuredOutputs | None = None
    # Per-request args for engine plugins; paved reads `paved_constraint` (a paved spec, as an
    # object or its JSON text). Other keys are rejected: no plugin here would read them.
    vllm_xargs: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are supported")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit() or int(key) > MAX_TOKEN_ID:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise _invalid("stream_options", "stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# ---------------------------------------------------------------------------------------------
# Chat completions.
# ---------------------------------------------------------------------------------------------
class TextPart(Request):
    type: Literal["text"]
    text: str


class FunctionCall(Request):
    name: FunctionName
    arguments: str


class ToolCall(Request):
    id: NonEmptyStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Only text: paved serves text models; other content parts are a 400, not dropped.
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.role == "assistant":
            if self.content is None and not self.tool_calls and self.refusal is None:
                raise ValueError("an assistant message needs content or tool_calls")
        elif self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class FunctionDefinition(Request):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Request):
    name: FunctionName


class NamedToolChoice(Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    _BOUNDED = (("messages", MAX_MESSAGES),)
    _ITEMS = (("messages", "object"),)

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    logprobs: StrictBool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # OpenAI fields accepted because their only meaning here is the default behaviour.
    store: Literal[False] | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None
    # vLLM's chat-template extensions: continue the final assistant message (a cut-off answer
    # resumed, a prefilled start) instead of opening a new turn.
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid("top_logprobs", "top_logprobs requires logprobs: true", self.top_logprobs)
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise _invalid(
                    "add_generation_prompt", "continue_final_message needs add_generation_prompt: false", True
                )
            if self.messages[-1].role != "assistant":
                raise _invalid(
                    "messages", "continue_final_message needs the last message to be the assistant's"
                )
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise _invalid(
                "max_completion_tokens", "max_tokens and max_completion_tokens disagree; send one of them"
            )
        return self

    def output_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------------------------------------
# Completions.
# ---------------------------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    _BOUNDED = (("prompt", MAX_TOKEN_IDS),)
    _ITEMS = (("prompt", "prompt"),)

    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_BATCH)]
        | Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_IDS)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_IDS)]],
            Field(min_length=1, max_length=MAX_BATCH),
        ]
    )
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    echo: StrictBool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(default=16, ge=0, le=2**31 - 1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        if self.suffix is not None:
            raise _invalid("suffix", "suffix is not supported: paved serves no fill-in-the-middle models")
        if self.best_of is not None and self.best_of != self.n:
            raise _invalid("best_of", "best_of other than n is not supported", self.best_of)
        if self.max_tokens == 0 and not self.echo:
            raise _invalid(
                "max_tokens", "max_tokens=0 generates nothing; it is only meaningful with echo: true", 0
            )
        if self.max_tokens == 0 and self.stream:
            raise _invalid("max_tokens", "max_tokens=0 (prompt scoring) cannot be streamed", 0)
        return self


# ---------------------------------------------------------------------------------------------
# Embeddings.
# ---------------------------------------------------------------------------------------------
class EmbeddingRequest(Body):
    _BOUNDED = (("input", MAX_TOKEN_IDS),)
    _ITEMS = (("input", "prompt"),)

    model: NonEmptyStr
    input: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_BATCH)]
        | Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_IDS)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_IDS)]],
            Field(min_length=1, max_length=MAX_BATCH),
        ]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=65536)
    user: str | None = Field(default=None, max_length=512)


# ---------------------------------------------------------------------------------------------
# Ranking (paved extension).
# ---------------------------------------------------------------------------------------------
class RankRequest(Body):
    """Score candidate continuations of one context by log-likelihood (one batched prefill)."""

    model: NonEmptyStr
    context: Annotated[str, StringConstraints(min_length=1, max_length=MAX_RANK_CONTEXT_CHARS)]
    _BOUNDED = (("candidates", 256),)

    candidates: list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_RANK_CONTEXT_CHARS)]] = (
        Field(min_length=1, max_length=256)
    )
    user: str | None = Field(default=None, max_length=512)


# ---------------------------------------------------------------------------------------------
# Responses.
# ---------------------------------------------------------------------------------------------
class Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Response):
    error: ErrorDetail


class ModelObject(Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(Response):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class PromptTokensDetails(Response):
    cached_tokens: int = 0


class Usage(Response):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprobEntry(Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(TopLogprobEntry):
    top_logprobs: list[TopLogprobEntry]


class ChatLogprobs(Response):
    content: list[ChatLogprobEntry] | None = None
    refusal: list[ChatLogprobEntry] | None = None


class FunctionCallOut(Response):
    name: str
    arguments: str


class ToolCallOut(Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ToolCallDelta(Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None


class ChatDelta(Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(Response):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class EmbeddingObject(Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingList(Response):
    object: Literal["list"] = "list"
    data: list[EmbeddingObject]
    model: str
    usage: Usage


class RankedCandidate(Response):
    index: int
    text: str
    logprob: float
    tokens: int


class RankList(Response):
    object: Literal["list"] = "list"
    model: str
    data: list[RankedCandidate]
    usage: Usage

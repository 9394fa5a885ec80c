"""An engine's model on the KServe interface, with the tensors of Triton's vLLM backend.

Mirrors triton-inference-server/vllm_backend (src/model.py, src/utils/request.py) so a client
written for Triton + vLLM works unchanged:
  inputs   text_input (BYTES [1]), stream, sampling_parameters (JSON text), exclude_input_in_output,
           return_finish_reason / return_cumulative_logprob / return_logprobs /
           return_num_input_tokens / return_num_output_tokens (BOOL [1], optional);
  outputs  text_output (one element per choice), finish_reason, cumulative_logprob, logprobs
           (JSON per choice), num_input_tokens, num_output_tokens (per response: the delta).
Same semantics too: without `exclude_input_in_output` a non-streaming answer starts with the
prompt, streaming with the prompt included is an error, `stream` responses carry deltas, and
sampling parameters may come as request parameters when the tensor is absent.
Embedding models take the backend's `embedding_request` JSON instead of `text_input`.

Requests go through `Engine.generate` / `Engine.embed`, so any protocol engine is served.
Where paved is stricter than the backend: unknown sampling keys, a `stream` request on the
unary ModelInfer RPC, and `logprobs` rank (reported only when the token is among the top
alternatives the engine returned; the protocol carries no rank otherwise).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import numpy as np

from paved.engine.protocol import (
    EmbedRequest,
    Engine,
    GenerateOutput,
    GenerateRequest,
    ModelCard,
    TextPrompt,
    TokenLogprob,
    TokenPrompt,
)
from paved.engine.streams import Closing, aclose
from paved.kserve.errors import invalid_argument
from paved.kserve.model import (
    Admission,
    InferRequest,
    InferResponse,
    ModelState,
    ServedModel,
)
from paved.kserve.sampling import admit_options, parse_parameters
from paved.kserve.tensors import TensorSpec
from paved.kserve.wire import PARAM_CONSTRAINT_BACKENDS, PARAM_KIND, PARAM_MAX_LOGPROBS, PARAM_MAX_MODEL_LEN

_RETURN_FLAGS = (
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
)
_GENERATE_INPUTS = (
    TensorSpec("text_input", "BYTES", (1,)),
    TensorSpec("stream", "BOOL", (1,), optional=True),
    TensorSpec("sampling_parameters", "BYTES", (1,), optional=True),
    TensorSpec("exclude_input_in_output", "BOOL", (1,), optional=True),
    *(TensorSpec(flag, "BOOL", (1,), optional=True) for flag in _RETURN_FLAGS),
)
_GENERATE_OUTPUTS = (
    TensorSpec("text_output", "BYTES", (-1,)),
    TensorSpec("finish_reason", "BYTES", (-1,)),
    TensorSpec("cumulative_logprob", "FP32", (-1,)),
    TensorSpec("logprobs", "BYTES", (-1,)),
    TensorSpec("num_input_tokens", "UINT32", (1,)),
    TensorSpec("num_output_tokens", "UINT32", (-1,)),
)
_EMBED_INPUTS = (
    TensorSpec("embedding_request", "BYTES", (1,)),
    TensorSpec("return_num_input_tokens", "BOOL", (1,), optional=True),
    TensorSpec("return_num_output_tokens", "BOOL", (1,), optional=True),
)
_EMBED_OUTPUTS = (
    TensorSpec("text_output", "BYTES", (-1,)),
    TensorSpec("num_input_tokens", "UINT32", (1,)),
    TensorSpec("num_output_tokens", "UINT32", (-1,)),
)


def _flag(request: InferRequest, name: str) -> bool | None:
    value = request.inputs.get(name)
    return None if value is None else bool(value.reshape(-1)[0])


def _text(value: np.ndarray, tensor: str) -> str:
    try:
        raw = value.reshape(-1)[0]
        return raw.decode() if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError as e:
        raise invalid_argument(f"input '{tensor}' is not UTF-8 text: {e}") from e


def _bytes_array(values: list[str]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = [v.encode() for v in values]
    return out


class LlmModel(ServedModel):
    platform = ""
    backend = "vllm"
    max_batch_size = 0  # the engine batches; like the vLLM backend, Triton-level batching is off
    decoupled = True

    def __init__(self, engine: Engine, card: ModelCard, admission: Admission | None = None):
        self.engine = engine
        self.card = card
        self.admission = admission
        self.name = card.id
        if card.kind == "embed":
            self.inputs, self.outputs = _EMBED_INPUTS, _EMBED_OUTPUTS
        else:
            self.inputs, self.outputs = _GENERATE_INPUTS, _GENERATE_OUTPUTS

    def state(self) -> tuple[ModelState, str]:
        if self.engine.ready():
            return "READY", ""
        return "UNAVAILABLE", "engine not ready"

    def config_parameters(self) -> dict[str, str]:
        return {
            PARAM_KIND: self.card.kind,
            PARAM_MAX_MODEL_LEN: str(self.card.max_model_len),
            PARAM_CONSTRAINT_BACKENDS: ",".join(self.card.constraint_backends),
            PARAM_MAX_LOGPROBS: str(self.card.max_logprobs),
        }

    async def infer(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        if self.card.kind == "embed":
            return await self._embed(request)
        return await self._generate(request)

    # ---- generation ----------------------------------------------------------------------
    def _sampling_source(self, request: InferRequest) -> tuple[dict, str]:
        tensor = request.inputs.get("sampling_parameters")
        if tensor is not None:
            if request.parameters:
                raise invalid_argument(
                    "sampling parameters given both as the 'sampling_parameters' input and as request "
                    f"parameters {sorted(request.parameters)}; send one"
                )
            return parse_parameters(tensor.reshape(-1)[0], "sampling_parameters"), "sampling_parameters"
        # The vLLM backend's fallback: request parameters are the sampling parameters.
        return dict(request.parameters), "parameters"

    async def _generate(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        prompt = _text(request.inputs["text_input"], "text_input")
        stream = bool(_flag(request, "stream"))
        if stream and not request.decoupled:
            raise invalid_argument(
                "stream=true needs a decoupled transport: gRPC ModelStreamInfer or HTTP generate_stream"
            )
        exclude = _flag(request, "exclude_input_in_output")
        prepend = (not exclude) if exclude is not None else not stream
        if prepend and stream:
            raise invalid_argument("When streaming, `exclude_input_in_output` = False is not allowed.")
        flags = {name: bool(_flag(request, name)) for name in _RETURN_FLAGS}
        params, source = self._sampling_source(request)
        # The OpenAI frontend's admission: constraint checks off the event loop, once per spec.
        sampling = await admit_options(params, self.card, source)
        wants_logprobs = sampling.logprobs is not None
        if flags["return_cumulative_logprob"] and not wants_logprobs:
            # The chosen token's logprob is needed to sum; alternatives are not.
            sampling = replace(sampling, logprobs=0)
        engine_request = GenerateRequest(
            request_id=f"kserve-{uuid.uuid4().hex}",
            model=self.card.id,
            prompt=TextPrompt(prompt),
            sampling=sampling,
            stream=stream,
        )
        ticket = self.admission(self.card.id, sampling.n) if self.admission is not None else None
        try:
            outputs = await self.engine.generate(engine_request)
        except BaseException:
            if ticket is not None:
                ticket.release()
            raise
        state = _State(
            n=sampling.n,
            flags=flags,
            report_logprobs=wants_logprobs,
            top=sampling.logprobs or 0,
            prefix=prompt if prepend else "",
        )
        # Closing the responses closes the engine stream (aborting the request if unfinished)
        # and releases the admission ticket, whether or not they were ever iterated.
        return Closing(
            self._responses(outputs, state, stream),
            lambda: aclose(outputs),
            ticket.release if ticket is not None else None,
        )

    async def _responses(
        self, outputs: AsyncIterator[GenerateOutput], state: _State, stream: bool
    ) -> AsyncIterator[InferResponse]:
        finished = False
        async for output in outputs:
            state.absorb(output)
            finished = output.finished
            if stream:
                yield InferResponse(state.flush_delta(), final=finished)
        if not stream:
            yield InferResponse(state.flush_total(), final=True)
        elif not finished:
            # The engine ended the stream without marking it finished: close it for the client.
            yield InferResponse(state.flush_delta(), final=True)

    # ---- embeddings ----------------------------------------------------------------------
    async def _embed(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        if request.parameters:
            raise invalid_argument(
                f"request parameters {sorted(request.parameters)} are not supported for embeddings"
            )
        raw = _text(request.inputs["embedding_request"], "embedding_request")
        body = parse_parameters(raw, "embedding_request")
        unknown = sorted(set(body) - {"input", "pooling_params"})
        if unknown:
            raise invalid_argument(f"embedding_request: unknown field(s) {unknown}")
        value = body.get("input")
        prompt: TextPrompt | TokenPrompt
        if isinstance(value, str) and value:
            prompt = TextPrompt(value)
        elif (
            isinstance(value, list)
            and value
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
        ):
            prompt = TokenPrompt(value)
        else:
            raise invalid_argument(
                "embedding_request.input must be a non-empty string or a list of token ids"
            )
        pooling = body.get("pooling_params") or {}
        if not isinstance(pooling, dict) or set(pooling) - {"dimensions"}:
            raise invalid_argument("embedding_request.pooling_params supports only 'dimensions'")
        dimensions = pooling.get("dimensions")
        if isinstance(dimensions, list):  # the backend's shape: {"dimensions": [d]}
            dimensions = dimensions[0] if len(dimensions) == 1 else None
            if dimensions is None:
                raise invalid_argument("embedding_request.pooling_params.dimensions must hold one integer")
        if dimensions is not None and (
            isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
        ):
            raise invalid_argument("embedding_request.pooling_params.dimensions must be a positive integer")
        # One input, one sequence: embeddings count against the same bound as generation.
        ticket = self.admission(self.card.id, 1) if self.admission is not None else None
        try:
            result = await self.engine.embed(
                EmbedRequest(
                    request_id=f"kserve-{uuid.uuid4().hex}",
                    model=self.card.id,
                    inputs=[prompt],
                    dimensions=dimensions,
                )
            )
        finally:
            if ticket is not None:
                ticket.release()
        outputs = {"text_output": _bytes_array([json.dumps(result.embeddings[0])])}
        if _flag(request, "return_num_input_tokens"):
            outputs["num_input_tokens"] = np.array([result.prompt_tokens], dtype=np.uint32)
        if _flag(request, "return_num_output_tokens"):
            outputs["num_output_tokens"] = np.array([0], dtype=np.uint32)
        return _one(InferResponse(outputs))


async def _one(response: InferResponse) -> AsyncIterator[InferResponse]:
    yield response


@dataclass
class _Choice:
    text: str = ""
    tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    # Deltas since the last streamed response.
    new_text: str = ""
    new_tokens: int = 0
    new_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class _State:
    """Per-request accumulation of engine deltas into Triton responses."""

    n: int
    flags: dict[str, bool]
    report_logprobs: bool
    top: int
    prefix: str
    prompt_tokens: int | None = None
    choices: list[_Choice] = field(default_factory=list)

    def __post_init__(self):
        self.choices = [_Choice() for _ in range(self.n)]

    def absorb(self, output: GenerateOutput) -> None:
        if output.prompt_tokens is not None and self.prompt_tokens is None:
            self.prompt_tokens = output.prompt_tokens
        for delta in output.choices:
            c = self.choices[delta.index]
            c.text += delta.text
            c.new_text += delta.text
            c.tokens += delta.token_count
            c.new_tokens += delta.token_count
            for lp in delta.logprobs or ():
                if lp.logprob is not None:  # None only for a prompt's first token
                    c.cumulative_logprob += lp.logprob
                c.logprobs.append(lp)
                c.new_logprobs.append(lp)
            if delta.finish_reason is not None:
                c.finish_reason = delta.finish_reason

    def flush_delta(self) -> dict[str, np.ndarray]:
        out = self._tensors(
            [c.new_text for c in self.choices],
            [c.new_tokens for c in self.choices],
            [c.new_logprobs for c in self.choices],
        )
        for c in self.choices:
            c.new_text, c.new_tokens, c.new_logprobs = "", 0, []
        return out

    def flush_total(self) -> dict[str, np.ndarray]:
        return self._tensors(
            [self.prefix + c.text for c in self.choices],
            [c.tokens for c in self.choices],
            [c.logprobs for c in self.choices],
        )

    def _tensors(self, texts: list[str], tokens: list[int], logprobs: list[list[TokenLogprob]]) -> dict:
        out: dict[str, np.ndarray] = {"text_output": _bytes_array(texts)}
        flags = self.flags
        if flags["return_finish_reason"]:
            # str(None) for unfinished choices, exactly as the vLLM backend reports them.
            out["finish_reason"] = _bytes_array([str(c.finish_reason) for c in self.choices])
        if flags["return_cumulative_logprob"]:
            out["cumulative_logprob"] = np.array(
                [c.cumulative_logprob for c in self.choices], dtype=np.float32
            )
        if flags["return_logprobs"]:
            out["logprobs"] = _bytes_array(
                [_logprobs_json(lps, self.top) if self.report_logprobs else "null" for lps in logprobs]
            )
        if flags["return_num_input_tokens"]:
            out["num_input_tokens"] = np.array([self.prompt_tokens or 0], dtype=np.uint32)
        if flags["return_num_output_tokens"]:
            out["num_output_tokens"] = np.array(tokens, dtype=np.uint32)
        return out


def _logprobs_json(positions: list[TokenLogprob], top: int) -> str:
    """vLLM's per-position `{token_id: {logprob, rank, decoded_token}}`, chosen token first."""
    result = []
    for position in positions:
        entry: dict[int, dict] = {}
        ranks = {alt.token_id: i + 1 for i, alt in enumerate(position.top)}
        entry[position.token_id] = {
            "logprob": position.logprob,
            "rank": ranks.get(position.token_id),
            "decoded_token": position.token,
        }
        for i, alt in enumerate(position.top[:top]):
            entry.setdefault(
                alt.token_id, {"logprob": alt.logprob, "rank": i + 1, "decoded_token": alt.token}
            )
        result.append(entry)
    return json.dumps(result)

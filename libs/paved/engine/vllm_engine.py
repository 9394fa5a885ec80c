"""The in-process vLLM engine: one AsyncLLM per model behind `paved.engine.protocol.Engine`.

Imports vLLM, so only composition roots (the server main, benchmarks, vLLM tests) import this
module; the frontend itself sees only the protocol.
"""

from paved.engine import vllm_env

# Before vLLM is imported anywhere in this process (see vllm_env).
vllm_env.apply_defaults()

import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorProm  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.exceptions import GracefulHTTPError, VLLMClientError  # noqa: E402
from vllm.inputs.engine import tokens_input  # noqa: E402
from vllm.outputs import STREAM_FINISHED, RequestOutput  # noqa: E402
from vllm.pooling_params import PoolingParams  # noqa: E402
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams  # noqa: E402
from vllm.tokenizers.protocol import TokenizerLike  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.engine.exceptions import EngineDeadError  # noqa: E402
from vllm.v1.metrics.loggers import PrometheusStatLogger  # noqa: E402
from vllm.v1.metrics.perf import PerfMetricsProm  # noqa: E402
from vllm.v1.spec_decode.metrics import SpecDecodingProm  # noqa: E402

from paved.engine.protocol import (  # noqa: E402
    ChatPrompt,
    ChoiceDelta,
    Constraint,
    EmbedRequest,
    EmbedResult,
    EngineOverloadedError,
    EngineUnavailableError,
    GenerateOutput,
    GenerateRequest,
    GenerateStream,
    InvalidRequestError,
    ModelCard,
    ModelNotFoundError,
    Prompt,
    PromptTooLongError,
    SamplingOptions,
    TextPrompt,
    TokenLogprob,
    TokenPrompt,
    TopLogprob,
)
from paved.engine.text import render_chat_template_off_loop  # noqa: E402
from paved.engine.vllm_config import VllmModelConfig  # noqa: E402

logger = logging.getLogger(__name__)

# Compact JSON by default: with free whitespace a random or weak model can emit blanks until
# max_tokens. Only the engine-level switch works; xgrammar ignores the per-request one.
STRUCTURED_OUTPUTS_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}
# Texts longer than this are tokenized off the event loop (the tokenizer is thread-safe);
# shorter ones are cheaper inline than a thread hop.
_INLINE_TOKENIZE_CHARS = 4096
_SELF_CHECK_CHOICE = "paved"


class VllmEngine:
    """One model, one AsyncLLM (engine core in a child process), in this process."""

    def __init__(self, config: VllmModelConfig):
        self.config = config
        self._llm: AsyncLLM | None = None
        self._card: ModelCard | None = None
        self._ready = False
        self._registry = CollectorRegistry(auto_describe=True)
        self._paved = False
        self._defaults: dict[str, Any] = {}
        self._tokenizer_or_none: TokenizerLike | None = None
        self._vocab_size = 0
        # Caller's request id -> AsyncLLM's internal id, for `abort`.
        self._active: dict[str, str] = {}

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        config = self.config
        self._paved = config.kind == "generate" and config.paved_constraints and _paved_processor_ok()
        args = self._engine_args()
        started = time.monotonic()
        # Booting blocks for tens of seconds (engine core spawn, weights, KV cache); doing it
        # in a thread keeps /health/live answering meanwhile. AsyncLLM starts its output
        # handler lazily on the first request, on the serving loop.
        self._llm = await asyncio.to_thread(
            AsyncLLM.from_engine_args, args, stat_loggers=[_stat_logger_class(self._registry)]
        )
        llm = self._llm
        self._tokenizer_or_none = llm.get_tokenizer()
        self._vocab_size = llm.model_config.get_vocab_size()
        self._defaults = llm.model_config.get_diff_sampling_param()
        backends: tuple = ()
        if config.kind == "generate":
            backends = ("paved", "xgrammar") if self._paved else ("xgrammar",)
        self._card = ModelCard(
            id=config.name,
            kind=config.kind,
            max_model_len=llm.model_config.max_model_len,
            created=int(time.time()),
            constraint_backends=backends,
            max_logprobs=llm.model_config.max_logprobs,
        )
        await self._warm_up()
        self._ready = True
        logger.info(
            "model %s ready in %.1f s (constraint backends: %s)",
            config.name,
            time.monotonic() - started,
            ", ".join(backends) or "none",
        )

    def _engine_args(self) -> AsyncEngineArgs:
        config = self.config
        kwargs: dict[str, Any] = {
            # Resolved: vLLM keys its compile cache on the model path.
            "model": os.path.realpath(config.path),
            "served_model_name": config.name,
            "dtype": config.dtype,
            "enforce_eager": config.enforce_eager,
            "seed": config.seed,
            "disable_log_stats": False,
        }
        if config.max_model_len is not None:
            kwargs["max_model_len"] = config.max_model_len
        if config.max_num_seqs is not None:
            kwargs["max_num_seqs"] = config.max_num_seqs
        if config.kind == "embed":
            kwargs["runner"] = "pooling"
        else:
            kwargs["structured_outputs_config"] = dict(STRUCTURED_OUTPUTS_CONFIG)
            if self._paved:
                from paved.constraints.vllm_processor import LOGITS_PROCESSOR_FQCN, WORKER_EXTENSION

                # Listed here, not only found through paved's entry point: vLLM's V1 runner
                # replaces async scheduling's -1 output-token placeholders with real ids only
                # for processors in `logits_processors`; the entry point's instance then
                # stands by (vllm_processor.PavedPluginLogitsProcessor).
                # A model's own engine_args processors run beside paved's, not instead.
                own = config.engine_args.get("logits_processors") or ()
                kwargs["logits_processors"] = [LOGITS_PROCESSOR_FQCN] + [
                    p for p in own if p != LOGITS_PROCESSOR_FQCN
                ]
                # Compiles start before a request joins the batch (see _precompile).
                kwargs["worker_extension_cls"] = WORKER_EXTENSION
        kwargs.update(
            (k, v) for k, v in config.engine_args.items() if k != "logits_processors" or k not in kwargs
        )
        return AsyncEngineArgs(**kwargs)

    async def _warm_up(self) -> None:
        """Run what the first real requests would otherwise pay for: the first forward pass,
        xgrammar's tokenizer compilation, paved's vocabulary build; and prove that paved's
        processor is really in the decode loop (without it vLLM ignores the request's
        extra_args, which would silently drop every paved constraint)."""
        if self.config.kind == "embed":
            await self.embed(
                EmbedRequest(
                    request_id="warmup-embed", model=self.config.name, inputs=[TextPrompt("warm up")]
                )
            )
            return
        prompt = TextPrompt("warm up")
        await self._collect(
            GenerateRequest("warmup", self.config.name, prompt, SamplingOptions(max_tokens=2))
        )
        xgr = Constraint(
            "xgrammar", "json_schema", {"type": "object", "properties": {"a": {"type": "boolean"}}}
        )
        await self._collect(
            GenerateRequest(
                "warmup-xgrammar", self.config.name, prompt, SamplingOptions(max_tokens=8, constraint=xgr)
            )
        )
        if self._paved:
            spec = {
                "type": "choice",
                "items": [_SELF_CHECK_CHOICE],
                "k": 1,
                "separator": ", ",
                "distinct": False,
            }
            text = await self._collect(
                GenerateRequest(
                    "warmup-paved",
                    self.config.name,
                    prompt,
                    SamplingOptions(
                        max_tokens=16, temperature=1.0, constraint=Constraint("paved", "paved", spec)
                    ),
                )
            )
            if text != _SELF_CHECK_CHOICE:
                raise RuntimeError(
                    f"paved's logits processor is not enforcing constraints in model {self.config.name!r} "
                    f"(self-check produced {text!r}); refusing to serve. Set paved_constraints = false "
                    "to serve with xgrammar only."
                )

    async def _collect(self, request: GenerateRequest) -> str:
        stream = await self.generate(request)
        return "".join([c.text async for out in stream for c in out.choices])

    async def stop(self) -> None:
        self._ready = False
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)

    def ready(self) -> bool:
        return self._ready and self._llm is not None and not self._llm.errored

    def models(self) -> Sequence[ModelCard]:
        return [self._card] if self._card is not None else []

    def metrics(self) -> Iterable[Metric]:
        return self._registry.collect()

    # ---- requests --------------------------------------------------------------------
    # Both are set by start(); a request reaches them only after _engine_for() said so.
    @property
    def _tokenizer(self) -> TokenizerLike:
        if self._tokenizer_or_none is None:
            raise EngineUnavailableError(f"model {self.config.name!r} is still loading")
        return self._tokenizer_or_none

    @property
    def _loaded_card(self) -> ModelCard:
        if self._card is None:
            raise EngineUnavailableError(f"model {self.config.name!r} is still loading")
        return self._card

    def _engine_for(self, model: str) -> AsyncLLM:
        if model != self.config.name:
            raise ModelNotFoundError(f"model {model!r} is not served by this engine")
        if self._llm is None or self._card is None:
            raise EngineUnavailableError(f"model {model!r} is still loading")
        if self._llm.errored:
            raise EngineUnavailableError(f"model {model!r}: engine has stopped")
        return self._llm

    async def tokenize(self, model: str, text: str, *, add_special_tokens: bool) -> list[int]:
        self._engine_for(model)
        return await self._encode(text, add_special_tokens)

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self._tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def _render(self, prompt: Prompt, param: str) -> tuple[list[int], str | None]:
        """Prompt -> (token ids, text if known)."""
        if isinstance(prompt, TokenPrompt):
            ids = list(prompt.token_ids)
            bad = [t for t in ids if not 0 <= t < self._vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token id(s) {bad[:5]} are outside the vocabulary [0, {self._vocab_size})", param=param
                )
            return ids, None
        if isinstance(prompt, ChatPrompt):
            text = await render_chat_template_off_loop(self._tokenizer, prompt, param)
            # The template already placed BOS and other special tokens.
            return await self._encode(text, add_special_tokens=False), text
        return await self._encode(prompt.text, add_special_tokens=True), prompt.text

    def _sampling_params(
        self, s: SamplingOptions, prompt_len: int, stream: bool, param: str
    ) -> SamplingParams:
        max_model_len = self._loaded_card.max_model_len
        prefill_only = s.max_tokens == 0
        if s.max_tokens is None:
            max_tokens = self._defaults.get("max_tokens") or max(max_model_len - prompt_len, 1)
        else:
            # vLLM needs one sampled token even when only the prompt is scored; it is dropped.
            max_tokens = max(s.max_tokens, 1)
        if prompt_len + max_tokens > max_model_len:
            raise PromptTooLongError(
                prompt_tokens=prompt_len, max_tokens=max_tokens, max_model_len=max_model_len, param=param
            )
        if prefill_only and s.constraint is not None:
            raise InvalidRequestError(
                "max_tokens=0 scores the prompt only; it cannot take an output constraint"
            )
        kwargs: dict[str, Any] = {
            "n": s.n,
            "max_tokens": max_tokens,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "seed": s.seed,
            "stop": list(s.stop) or None,
            "logprobs": s.logprobs,
            "prompt_logprobs": s.prompt_logprobs,
            "min_tokens": s.min_tokens,
            "ignore_eos": s.ignore_eos,
            "logit_bias": s.logit_bias,
            "output_kind": RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(s, name)
            if value is None:
                value = self._defaults.get(name)
            if value is not None:
                kwargs[name] = value
        constraint = s.constraint
        if constraint is not None:
            if constraint.backend == "paved":
                from paved.constraints.spec import EXTRA_ARGS_KEY, KEY_ARGS_KEY

                kwargs["extra_args"] = {EXTRA_ARGS_KEY: constraint.value, KEY_ARGS_KEY: constraint.key}
            else:
                kwargs["structured_outputs"] = _structured_outputs(constraint)
        # Built per request and never shared: vLLM's deep copy of it (a big spec's every
        # string) would otherwise run on the event loop.
        kwargs["skip_clone"] = True
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError, VLLMClientError) as e:
            raise InvalidRequestError(str(e)) from e

    async def generate(self, request: GenerateRequest) -> GenerateStream:
        llm = self._engine_for(request.model)
        if self._loaded_card.kind != "generate":
            raise InvalidRequestError(
                f"model {request.model!r} is an embedding model; it cannot generate", param="model"
            )
        param = "messages" if isinstance(request.prompt, ChatPrompt) else "prompt"
        prompt_ids, prompt_text = await self._render(request.prompt, param)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param=param)
        sampling = request.sampling
        constraint = sampling.constraint
        if constraint is not None and constraint.backend == "paved":
            if not self._paved:
                raise InvalidRequestError("paved's constraint engine is not enabled for this model")
            if constraint.key is None:
                constraint = await _admitted(constraint)
                sampling = dataclasses.replace(sampling, constraint=constraint)
        params = self._sampling_params(sampling, len(prompt_ids), request.stream, param)
        if constraint is not None and constraint.backend == "paved":
            await self._precompile(llm, constraint)
        try:
            # Already tokenized: a rendered input skips vLLM's thread-pool hop for raw prompts.
            collector = await llm.add_request(request.request_id, tokens_input(prompt_ids), params)
        except EngineDeadError as e:
            raise EngineUnavailableError(f"model {request.model!r}: engine has stopped") from e
        except GracefulHTTPError as e:  # admission control (max_num_queued_reqs / tokens)
            raise EngineOverloadedError(str(e)) from e
        except (ValueError, TypeError, VLLMClientError) as e:
            # vLLM's validation, including logits processors' validate_params (paved specs).
            raise InvalidRequestError(str(e), param=getattr(e, "parameter", None)) from e
        self._active[request.request_id] = collector.request_id
        if request.echo and prompt_text is None:
            prompt_text = self._tokenizer.decode(prompt_ids)
        return _RequestStream(self, request, collector, prompt_ids, prompt_text)

    async def _precompile(self, llm: AsyncLLM, constraint: Constraint) -> None:
        """Wait, off the step thread and the event loop, until the engine core has compiled
        `constraint`, so adding the request never stalls the running batch's steps.

        The engine core answers utility calls between steps; polling backs off to 50 ms."""
        budget = self.config.constraint_compile_budget_s
        deadline = time.monotonic() + budget
        # Ask by key first: a spec the worker has (any repeat) is never sent again.
        spec: Any = None
        delay = 0.002
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise InvalidRequestError(
                    f"the output constraint did not compile within this model's compile time budget "
                    f"({budget:g} s, constraint_compile_budget_s); simplify it, or retry: the compile "
                    "goes on in the background and is cached",
                    code="constraint_compile_budget",
                )
            try:
                answers = await asyncio.wait_for(
                    llm.collective_rpc("paved_precompile", args=(constraint.key, spec)), left
                )
            except TimeoutError:
                continue
            except EngineDeadError as e:
                raise EngineUnavailableError(f"model {self.config.name!r}: engine has stopped") from e
            except Exception as e:  # noqa: BLE001 - the RPC is an optimization; the step compiles
                # E.g. engine_args replaced paved's worker extension: the automaton is then built
                # at the request's first step, as for any client of vLLM without it.
                logger.warning("paved precompile unavailable for model %s (%s)", self.config.name, e)
                return
            spec = None  # sent once; later calls only ask about the key
            pending = False
            for answer in answers:
                if answer.startswith("error: "):
                    raise InvalidRequestError(
                        f"the output constraint cannot be enforced for this model: {answer[7:]}"
                    )
                if answer == "unknown":
                    spec = constraint.value  # new to the worker (or evicted): send it
                pending = pending or answer in ("pending", "unknown")
            if not pending:  # "ready", or "unavailable" (no processor yet: it compiles in step)
                return
            if spec is not None:
                continue  # send it at once; nothing is compiling yet
            await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0)))
            delay = min(delay * 2, 0.05)

    async def abort(self, request_id: str) -> None:
        internal = self._active.get(request_id)
        if internal is not None and self._llm is not None:
            await self._llm.abort(internal, internal=True)

    async def embed(self, request: EmbedRequest) -> EmbedResult:
        llm = self._engine_for(request.model)
        if self._loaded_card.kind != "embed":
            raise InvalidRequestError(f"model {request.model!r} does not produce embeddings", param="model")
        prompts = [await self._render(p, "input") for p in request.inputs]
        for i, (ids, _) in enumerate(prompts):
            if not ids:
                raise InvalidRequestError(f"input[{i}] is empty", param="input")
            if len(ids) > self._loaded_card.max_model_len:
                raise PromptTooLongError(
                    prompt_tokens=len(ids),
                    max_tokens=0,
                    max_model_len=self._loaded_card.max_model_len,
                    param="input",
                )
        params = PoolingParams(task="embed", dimensions=request.dimensions)

        async def one(i: int, ids: list[int]) -> list[float]:
            final = None
            async for out in llm.encode(tokens_input(ids), params, f"{request.request_id}-{i}"):
                final = out
            if final is None:
                raise RuntimeError(f"vLLM ended input[{i}]'s embedding stream without an output")
            return final.outputs.data.tolist()

        try:
            vectors = await asyncio.gather(*(one(i, ids) for i, (ids, _) in enumerate(prompts)))
        except EngineDeadError as e:
            raise EngineUnavailableError(f"model {request.model!r}: engine has stopped") from e
        except GracefulHTTPError as e:
            raise EngineOverloadedError(str(e)) from e
        except (ValueError, TypeError, VLLMClientError) as e:
            raise InvalidRequestError(str(e), param=getattr(e, "parameter", None) or "input") from e
        return EmbedResult(embeddings=vectors, prompt_tokens=sum(len(ids) for ids, _ in prompts))


class _RequestStream:
    """Outputs of one admitted request. A class rather than an async generator so that
    `aclose()` aborts the engine request even if the stream was never iterated (a client can
    disconnect before the first byte)."""

    def __init__(self, engine: VllmEngine, request: GenerateRequest, collector, prompt_ids, prompt_text):
        self._engine = engine
        self._llm = engine._llm
        self._request = request
        self._collector = collector
        self._prompt_ids = prompt_ids
        self._prompt_text = prompt_text
        # Read once, not per token.
        self._num_top = request.sampling.logprobs
        self._prefill_only = request.sampling.max_tokens == 0
        self._first = True
        self._finished = False
        self._closed = False

    def __aiter__(self) -> "_RequestStream":
        return self

    async def __anext__(self) -> GenerateOutput:
        if self._finished or self._closed:
            raise StopAsyncIteration
        collector = self._collector
        try:
            # Drain without awaiting when possible: under load this skips a task switch.
            out: RequestOutput = collector.get_nowait() or await collector.get()
            while out is STREAM_FINISHED:
                out = collector.get_nowait() or await collector.get()
        except EngineDeadError as e:
            self._finished = True  # nothing left to abort
            await self.aclose()
            raise EngineUnavailableError(f"model {self._request.model!r}: engine has stopped") from e
        except BaseException:
            # Cancelled (client gone) or failed: free the engine's slot before propagating.
            await self.aclose()
            raise
        num_top, prefill_only = self._num_top, self._prefill_only
        result = GenerateOutput(
            choices=[_choice(o, num_top, prefill_only) for o in out.outputs], finished=out.finished
        )
        if self._first:
            self._first = False
            result.prompt_tokens = len(self._prompt_ids)
            result.cached_prompt_tokens = out.num_cached_tokens
            prompt_logprobs = self._request.sampling.prompt_logprobs
            if prompt_logprobs is not None and out.prompt_logprobs is not None:
                result.prompt_logprobs = _prompt_logprobs(
                    out.prompt_logprobs, self._prompt_ids, prompt_logprobs, self._engine._tokenizer
                )
            if self._request.echo:
                result.prompt_text = self._prompt_text
                result.prompt_token_ids = self._prompt_ids
        if out.finished:
            self._finished = True
            await self.aclose()
        return result

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine._active.pop(self._request.request_id, None)
        self._collector.close()
        if not self._finished and self._llm is not None and not self._llm.errored:
            await asyncio.shield(self._llm.abort(self._collector.request_id, internal=True))


# ---- conversions ---------------------------------------------------------------------------
async def _admitted(constraint: Constraint) -> Constraint:
    """A paved constraint built without `spec.admit` (warm-up, direct callers): admitted
    here, off the event loop."""
    from paved.constraints.spec import admit

    try:
        spec, key = await asyncio.to_thread(admit, constraint.value)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from e
    return Constraint("paved", "paved", spec, key)


def _structured_outputs(constraint: Constraint) -> StructuredOutputsParams:
    kind, value = constraint.kind, constraint.value
    if kind == "json_schema":
        return StructuredOutputsParams(json=value)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "regex":
        return StructuredOutputsParams(regex=value)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(value))
    if kind == "grammar":
        return StructuredOutputsParams(grammar=value)
    raise InvalidRequestError(f"constraint kind {kind!r} cannot be enforced by xgrammar")


def _choice(output, num_top: int | None, prefill_only: bool) -> ChoiceDelta:
    if prefill_only:
        # The one token vLLM had to sample is not part of the answer.
        return ChoiceDelta(index=output.index, finish_reason="length" if output.finish_reason else None)
    logprobs = None
    if num_top is not None and output.logprobs is not None:
        logprobs = [
            _token_logprob(token_id, position, num_top)
            for token_id, position in zip(output.token_ids, output.logprobs, strict=False)
        ]
    return ChoiceDelta(
        index=output.index,
        text=output.text,
        token_ids=output.token_ids,
        logprobs=logprobs,
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
    )


def _token_logprob(token_id: int, position: dict, num_top: int) -> TokenLogprob:
    chosen = position[token_id]
    top = sorted(
        (entry for entry in position.items() if entry[1].rank is not None and entry[1].rank <= num_top),
        key=lambda entry: entry[1].rank,
    )
    return TokenLogprob(
        token=chosen.decoded_token or "",
        token_id=token_id,
        logprob=_finite(chosen.logprob),
        top=[TopLogprob(lp.decoded_token or "", tid, _finite(lp.logprob)) for tid, lp in top[:num_top]],
    )


def _prompt_logprobs(positions, prompt_ids: list[int], num_top: int, tokenizer) -> list[TokenLogprob]:
    return [
        TokenLogprob(tokenizer.decode([token_id]), token_id, None)
        if position is None
        else _token_logprob(token_id, position, num_top)
        for token_id, position in zip(prompt_ids, positions, strict=False)
    ]


def _finite(value: float) -> float:
    # JSON has no -inf; a masked-out token's logprob is reported as the float minimum.
    return max(value, -3.4028234663852886e38)


# ---- paved's logits processor --------------------------------------------------------------
def _paved_processor_ok() -> bool:
    try:
        import paved.constraints.spec
        import paved.constraints.vllm_processor  # noqa: F401
    except ImportError as e:
        logger.warning("paved's constraint engine is unavailable (%s); JSON schemas use xgrammar only", e)
        return False
    return True


# ---- metrics -------------------------------------------------------------------------------
def _stat_logger_class(registry: CollectorRegistry) -> type:
    """vLLM's Prometheus stat logger, writing into `registry` instead of the global one.

    vLLM's logger first unregisters every `vllm:` collector from the global registry, so a
    second in-process engine would silently hide the first one's metrics. Bound per engine,
    each model keeps its own series (labelled model_name) and /metrics merges them.
    """

    # Any: mypy takes no class held in a variable as a base.
    def bound(metric_cls: Any) -> type:
        class Bound(metric_cls):
            def __init__(self, *args, **kwargs):
                kwargs.setdefault("registry", registry)
                super().__init__(*args, **kwargs)

        Bound.__name__ = metric_cls.__name__
        return Bound

    gauge, counter, histogram = bound(Gauge), bound(Counter), bound(Histogram)
    classes = {"_gauge_cls": gauge, "_counter_cls": counter, "_histogram_cls": histogram}
    return type(
        "PavedEngineStatLogger",
        (PrometheusStatLogger,),
        {
            **classes,
            "_spec_decoding_cls": type("SpecDecodingProm", (SpecDecodingProm,), {"_counter_cls": counter}),
            "_perf_metrics_cls": type("PerfMetricsProm", (PerfMetricsProm,), {"_counter_cls": counter}),
            "_kv_connector_cls": type("KVConnectorProm", (KVConnectorProm,), dict(classes)),
            "_ec_connector_cls": type("ECConnectorProm", (ECConnectorProm,), dict(classes)),
        },
    )

"""A simulated engine: the engine contract without a model, to serve, load-test and test against.

`SimEngine` keeps every rule of `paved.engine.protocol` the way `VllmEngine` does (deltas,
finish and stop reasons, usage counts, n > 1, logprobs, stop strings, echo, prefill-only
scoring, admission errors raised by `generate`, `aclose` aborting) and models a continuous
batching server's capacity so that frontends, gateways and autoscalers see real back pressure:

  * `tokens_per_s`: decode speed of each running sequence (one step = one token for every
    running sequence); 0 runs steps back to back.
  * `max_num_seqs`: sequences decoding at once (a request holds `n` of them).
  * `kv_tokens`: the KV budget. A request reserves n x (prompt + max_tokens) tokens when it
    starts and keeps them until it ends, so the sim never preempts; requests that do not fit
    wait. `vllm:kv_cache_usage_perc` is the reserved fraction.
  * `max_waiting`: the waiting queue's bound; beyond it `generate` raises
    EngineOverloadedError (HTTP 503).

Output is deterministic: words drawn from a generator seeded by the prompt (and the request's
seed and choice index unless temperature is 0), then EOS after a prompt-dependent number of
words; other sampling knobs are validated but do not change the text. Structured outputs are
real: a paved constraint is compiled by paved's native engine and every token is sampled from
the mask it computes, so JSON outputs parse and match their schema.
xgrammar constraints are refused (InvalidRequestError), never dropped.

The tokenizer is built in (one token per UTF-8 byte, plus EOS) or a Hugging Face tokenizer
directory (`tokenizer=DIR`, which also brings its chat template). Metrics are vLLM's names and
labels: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`,
`vllm:prompt_tokens`, `vllm:generation_tokens`, `vllm:request_success`.

    sim://MODEL[?tokens_per_s=F&max_num_seqs=N&kv_tokens=N&max_waiting=N&max_model_len=N
               &tokenizer=DIR&max_logprobs=N&fail_after=N&start_delay_s=F]

`fail_after=N` is fault injection for the platform's own tests: after N admitted requests every
further one is refused as unavailable (503), as a replica going bad mid-rollout would be.
`start_delay_s=F` makes `start` take F seconds more (a model's load time: cold starts, scale
from zero).
"""

from __future__ import annotations

import asyncio
import bisect
import codecs
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import Metric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from paved.engine.protocol import (
    ChatPrompt,
    ChoiceDelta,
    Constraint,
    EmbedRequest,
    EmbedResult,
    EngineOverloadedError,
    EngineUnavailableError,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    InvalidRequestError,
    ModelCard,
    ModelNotFoundError,
    Prompt,
    PromptTooLongError,
    SamplingOptions,
    TokenLogprob,
    TokenPrompt,
    TopLogprob,
)
from paved.engine.sim_config import SimConfig
from paved.engine.text import render_chat_template

if TYPE_CHECKING:
    from paved.constraints.compiler import SpecCompiler

logger = logging.getLogger(__name__)


_WORDS = tuple(
    (  # noqa: SIM905 (a word list reads better as prose)
        "the of and to in is that it for was on are as with be at by this have from or one had "
        "not but what all were when we there can an your which their said if do will each about "
        "how up out them then she many some so these would other into has more her two like him "
        "see time could no make than first been its who now people my made over did down only "
        "way find use may water long little very after words called just where most know "
    ).split()
)
# A constrained value closes (when the mask allows) with a chance rising to 1 over this many
# tokens; uniform sampling alone almost never picks a closing quote among ~200 allowed bytes.
_CLOSE_RAMP_TOKENS = 16
_CLOSERS = b'"}],'


# ---- tokenizers ------------------------------------------------------------------------------
class ByteTokenizer:
    """Ids 0-255 are the UTF-8 bytes, 256 is EOS; no BOS. Chat: `<role>content` per message."""

    eos_ids = (256,)

    def __init__(self):
        self.token_bytes = [bytes([i]) for i in range(256)] + [b""]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def render_chat(self, prompt: ChatPrompt, param: str) -> str:
        # No closing marker per message: a continued final message renders the same, open.
        text = "".join(f"<{m.get('role', '')}>{m.get('content') or ''}" for m in prompt.messages)
        return text + ("<assistant>" if prompt.add_generation_prompt else "")


class HFTokenizer:
    """A Hugging Face tokenizer directory: its vocabulary (as paved's constraint engine sees
    it), EOS ids (tokenizer plus generation_config) and chat template."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        from paved.constraints.vocab import token_bytes

        self._tok = AutoTokenizer.from_pretrained(path)
        self.token_bytes = token_bytes(self._tok)
        eos = set()
        if self._tok.eos_token_id is not None:
            eos.add(int(self._tok.eos_token_id))
        generation_config = os.path.join(path, "generation_config.json")
        if os.path.isfile(generation_config):
            with open(generation_config) as f:
                value = json.load(f).get("eos_token_id")
            eos.update([value] if isinstance(value, int) else value or [])
        self.eos_ids = tuple(sorted(eos))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, prompt: ChatPrompt, param: str) -> str:
        return render_chat_template(self._tok, prompt, param)


# ---- one request -----------------------------------------------------------------------------
class _Choice:
    def __init__(self, index: int, rng: random.Random, script: list[int] | None, state):
        self.index = index
        self.rng = rng
        self.script = script  # scripted token ids (test hook), else None
        self.state = state  # paved constraint State, or None
        self.pending: list[int] = []  # natural tokens of the current word, reversed
        self.words_left = rng.randint(4, 32)
        self.since_close = 0  # constrained tokens since the last closing one
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""  # decoded output, stop string removed
        self.sent_text = 0
        self.sent_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.reported = False


class _SimRequest:
    def __init__(
        self, engine: SimEngine, request: GenerateRequest, prompt_ids: list[int], prompt_text, budget, choices
    ):
        self.engine = engine
        self.request = request
        self.id = request.request_id
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.budget = budget  # tokens each choice may generate
        self.choices: list[_Choice] = choices
        self.n = len(choices)
        self.kv = self.n * (len(prompt_ids) + budget)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.first = True
        self.done = False  # no more outputs will be produced


class SimStream:
    """The outputs of one admitted sim request; `aclose` aborts it if unfinished."""

    def __init__(self, engine: SimEngine, req: _SimRequest):
        self._engine = engine
        self._req = req
        self._finished = False
        self._closed = False

    def __aiter__(self) -> SimStream:
        return self

    async def __anext__(self) -> GenerateOutput:
        if self._finished or self._closed:
            raise StopAsyncIteration
        try:
            item = (
                self._req.queue.get_nowait() if not self._req.queue.empty() else await self._req.queue.get()
            )
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._finished = True
            await self.aclose()
            raise item
        if item.finished:
            self._finished = True
            await self.aclose()
        return item

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine._close(self._req)


# ---- the engine ------------------------------------------------------------------------------
class SimEngine:
    """One simulated generation model."""

    def __init__(self, config: SimConfig):
        self.config = config
        self.name = config.model
        self._tokenizer_or_none: ByteTokenizer | HFTokenizer | None = None
        self._compiler: SpecCompiler | None = None
        self._card: ModelCard | None = None
        self._ready = False
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._waiting: list[_SimRequest] = []
        self._running: list[_SimRequest] = []
        self._requests: dict[str, _SimRequest] = {}
        self._kv_reserved = 0
        self._admitted_total = 0  # for fail_after
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._success = {"stop": 0, "length": 0, "abort": 0, "error": 0}

    @classmethod
    def from_uri(cls, uri: str, model: str | None = None) -> SimEngine:
        return cls(SimConfig.from_uri(uri, model))

    # ---- capacity, observable by tests and metrics ------------------------------------------
    @property
    def tokens_per_s(self) -> float:
        return self.config.tokens_per_s

    @tokens_per_s.setter
    def tokens_per_s(self, value: float) -> None:
        self.config = dataclasses.replace(self.config, tokens_per_s=value)

    @property
    def _tokenizer(self) -> ByteTokenizer | HFTokenizer:
        if self._tokenizer_or_none is None:
            raise EngineUnavailableError(f"model {self.name!r} is still loading")
        return self._tokenizer_or_none

    @property
    def num_running(self) -> int:
        """Sequences decoding now (n per running request), as vllm:num_requests_running."""
        return sum(r.n for r in self._running)

    @property
    def num_waiting(self) -> int:
        return sum(r.n for r in self._waiting)

    @property
    def kv_usage(self) -> float:
        return self._kv_reserved / self.config.kv_capacity

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        config = self.config
        if config.start_delay_s:
            await asyncio.sleep(config.start_delay_s)
        if config.tokenizer:
            self._tokenizer_or_none = await asyncio.to_thread(HFTokenizer, config.tokenizer)
        else:
            self._tokenizer_or_none = ByteTokenizer()
        self._vocab_size = len(self._tokenizer.token_bytes)
        # Best closer first: a string's quote, then the end of an object or array, then a comma.
        self._closers = sorted(
            (
                i
                for i, b in enumerate(self._tokenizer.token_bytes)
                if b and all(c in _CLOSERS for c in b) and i not in self._tokenizer.eos_ids
            ),
            key=lambda i: (_CLOSERS.index(self._tokenizer.token_bytes[i][0]), i),
        )
        if "paved" in config.constraint_backends:
            from paved.constraints import Vocab
            from paved.constraints.compiler import SpecCompiler

            vocab = Vocab(self._tokenizer.token_bytes, list(self._tokenizer.eos_ids), self._vocab_size)
            self._compiler = SpecCompiler(vocab)
        self._card = ModelCard(
            id=self.name,
            kind="generate",
            max_model_len=config.max_model_len,
            created=int(time.time()),
            owned_by="paved-sim",
            # validate() admits no other backend.
            constraint_backends=("paved",) if "paved" in config.constraint_backends else (),
            max_logprobs=config.max_logprobs,
        )
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name=f"sim-engine-{self.name}")
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for req in list(self._requests.values()):
            if not req.done:
                req.done = True
                req.queue.put_nowait(EngineUnavailableError(f"model {self.name!r}: engine has stopped"))
            self._release(req, "abort")

    def ready(self) -> bool:
        return self._ready and self._task is not None and not self._task.done()

    def models(self) -> Sequence[ModelCard]:
        return [self._card] if self._card is not None else []

    # ---- admission --------------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        if model != self.name:
            raise ModelNotFoundError(f"model {model!r} is not served by this engine")
        if self._card is None:
            raise EngineUnavailableError(f"model {model!r} is still loading")
        if not self.ready():
            raise EngineUnavailableError(f"model {model!r}: engine has stopped")

    async def tokenize(self, model: str, text: str, *, add_special_tokens: bool) -> list[int]:
        self._check_model(model)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _render(self, prompt: Prompt, param: str) -> tuple[list[int], str | None]:
        if isinstance(prompt, TokenPrompt):
            ids = list(prompt.token_ids)
            bad = [t for t in ids if not 0 <= t < self._vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token id(s) {bad[:5]} are outside the vocabulary [0, {self._vocab_size})", param=param
                )
            return ids, None
        if isinstance(prompt, ChatPrompt):
            text = self._tokenizer.render_chat(prompt, param)
            return self._tokenizer.encode(text, add_special_tokens=False), text
        return self._tokenizer.encode(prompt.text, add_special_tokens=True), prompt.text

    def _validate(self, s: SamplingOptions, prompt_len: int, param: str) -> int:
        """Checks vLLM's SamplingParams would fail; returns the per-choice token budget."""
        config = self.config
        if s.n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {s.n}", param="n")
        if s.n > config.max_num_seqs:
            raise InvalidRequestError(
                f"n={s.n} is more than this engine's max_num_seqs ({config.max_num_seqs})", param="n"
            )
        if s.max_tokens is not None and s.max_tokens < 0:
            raise InvalidRequestError(
                f"max_tokens must be at least 0, got {s.max_tokens}", param="max_tokens"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(s, name)
            if value is not None and not 0 <= value <= config.max_logprobs:
                raise InvalidRequestError(
                    f"{name} must be in [0, {config.max_logprobs}], got {value}", param=name
                )
        if s.temperature is not None and s.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {s.temperature}", param="temperature")
        if s.top_p is not None and not 0 < s.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {s.top_p}", param="top_p")
        if s.min_tokens < 0 or (s.max_tokens is not None and s.min_tokens > max(s.max_tokens, 1)):
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens], got {s.min_tokens}", param="min_tokens"
            )
        if any(not isinstance(stop, str) or not stop for stop in s.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", param="stop")
        max_model_len = config.max_model_len
        budget = max(max_model_len - prompt_len, 1) if s.max_tokens is None else max(s.max_tokens, 1)
        if prompt_len + budget > max_model_len:
            raise PromptTooLongError(
                prompt_tokens=prompt_len, max_tokens=budget, max_model_len=max_model_len, param=param
            )
        return budget

    def _constraint_state(self, c: Constraint | None, s: SamplingOptions, budget: int):
        """A fresh State per choice (callable), or None for an unconstrained request."""
        if c is None:
            return None
        if s.max_tokens == 0:
            raise InvalidRequestError(
                "max_tokens=0 scores the prompt only; it cannot take an output constraint"
            )
        if c.backend != "paved":
            return self._xgrammar_constraint(c)
        compiler = self._compiler
        if compiler is None:
            raise InvalidRequestError("paved's constraint engine is not enabled for this model")
        from paved.constraints import spec as specs

        try:
            # Specs from paved's frontends were admitted already (the same object): trusted.
            spec = c.value if specs.is_admitted(c.value, c.key) else specs.admit(c.value)[0]
            if s.ignore_eos:
                raise ValueError(f"{specs.EXTRA_ARGS_KEY} cannot be combined with ignore_eos")
            compiler.constraint(spec)  # compiled (and cached) at admission
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        return lambda: compiler.new_state(spec, budget)

    def _xgrammar_constraint(self, c: Constraint):
        """Hook: the sim does not run xgrammar, so such constraints are refused."""
        raise InvalidRequestError(
            f"{c.kind} constraints through the xgrammar backend are not supported by the sim engine "
            "(it enforces paved constraints only)",
            param="response_format",
        )

    def _reply(self, request: GenerateRequest, index: int) -> str | None:
        """Hook for tests: a scripted reply for choice `index` (None: the simulated text).

        A scripted reply is followed token by token while the constraint (if any) allows it; the
        choice then ends with finish_reason "stop" on its last token (once the constraint accepts).
        """
        return None

    async def generate(self, request: GenerateRequest) -> SimStream:
        self._check_model(request.model)
        if self.config.fail_after is not None:
            if self._admitted_total >= self.config.fail_after:
                raise EngineUnavailableError(
                    f"model {self.name!r}: failing on purpose after {self.config.fail_after} requests"
                )
            self._admitted_total += 1
        param = "messages" if isinstance(request.prompt, ChatPrompt) else "prompt"
        prompt_ids, prompt_text = self._render(request.prompt, param)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param=param)
        s = request.sampling
        budget = self._validate(s, len(prompt_ids), param)
        if s.constraint is None:
            new_state = None
        else:  # a check or compile can take long: off the loop, like VllmEngine's
            new_state = await asyncio.to_thread(self._constraint_state, s.constraint, s, budget)
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        kv = s.n * (len(prompt_ids) + budget)
        if kv > self.config.kv_capacity:
            raise InvalidRequestError(
                f"the request needs {kv} KV tokens (n={s.n} x (prompt {len(prompt_ids)} + {budget})), "
                f"more than this engine's kv_tokens ({self.config.kv_tokens}); lower max_tokens or n"
            )
        fits_now = not self._waiting and self._fits(s.n, kv)
        if not fits_now and len(self._waiting) >= self.config.max_waiting:
            raise EngineOverloadedError(
                f"model {self.name!r}: the waiting queue is full ({self.config.max_waiting} requests)"
            )
        seed = _seed(prompt_ids, s.seed)
        greedy = s.temperature == 0
        choices = []
        for index in range(s.n):
            script = self._reply(request, index)
            choices.append(
                _Choice(
                    index,
                    random.Random(seed if greedy else seed + index),  # noqa: S311 - simulated sampling, not secrets
                    list(reversed(self._tokenizer.encode(script, add_special_tokens=False)))
                    if script is not None
                    else None,
                    new_state() if new_state is not None else None,
                )
            )
        if request.echo and prompt_text is None:
            prompt_text = b"".join(self._tokenizer.token_bytes[t] for t in prompt_ids).decode(
                "utf-8", "replace"
            )
        req = _SimRequest(self, request, prompt_ids, prompt_text, budget, choices)
        self._requests[req.id] = req
        self._waiting.append(req)
        self._admit()  # starts now when a slot and KV are free: visible in num_running at once
        self._wake.set()
        return SimStream(self, req)

    async def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None or req.done:
            return
        for c in req.choices:
            if c.finish_reason is None:
                c.finish_reason = "abort"
        req.queue.put_nowait(self._output(req, finished=True))
        req.done = True
        self._release(req, "abort")

    async def embed(self, request: EmbedRequest) -> EmbedResult:
        self._check_model(request.model)
        raise InvalidRequestError(f"model {request.model!r} does not produce embeddings", param="model")

    # ---- scheduling -------------------------------------------------------------------------
    def _close(self, req: _SimRequest) -> None:
        """The stream was closed: abort the request unless it already ended."""
        if not req.done:
            req.done = True
            self._release(req, "abort")
        self._requests.pop(req.id, None)

    def _release(self, req: _SimRequest, reason: str) -> None:
        if req in self._running:
            self._running.remove(req)
            self._kv_reserved -= req.kv
        elif req in self._waiting:
            self._waiting.remove(req)
        else:
            return
        if reason == "abort":
            self._success["abort"] += req.n
            self._on_abort(req.id)
        self._admit()  # the freed slot and KV go to the head of the queue at once
        self._wake.set()

    def _on_abort(self, request_id: str) -> None:
        """Hook for tests: a request ended before finishing."""

    def _fits(self, n: int, kv: int) -> bool:
        config = self.config
        return self.num_running + n <= config.max_num_seqs and self._kv_reserved + kv <= config.kv_capacity

    def _admit(self) -> None:
        while self._waiting:
            req = self._waiting[0]
            if not self._fits(req.n, req.kv):
                return  # first come, first served: nothing overtakes the head of the queue
            self._waiting.pop(0)
            self._running.append(req)
            self._kv_reserved += req.kv
            self._prompt_tokens += len(req.prompt_ids)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_step = loop.time()
        while True:
            self._admit()
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                next_step = loop.time()
                continue
            for req in list(self._running):
                try:
                    self._step(req)
                except Exception as e:  # a bug in one request must not stop the others
                    logger.exception("sim engine: request %s failed", req.id)
                    req.done = True
                    req.queue.put_nowait(EngineUnavailableError(f"sim engine failed: {e}"))
                    self._success["error"] += req.n
                    self._release(req, "error")
            interval = 1.0 / self.config.tokens_per_s if self.config.tokens_per_s > 0 else 0.0
            next_step += interval
            delay = next_step - loop.time()
            if delay < -interval:  # fell behind (a busy loop): do not try to catch up
                next_step, delay = loop.time(), 0.0
            await asyncio.sleep(max(delay, 0.0))

    def _step(self, req: _SimRequest) -> None:
        s = req.request.sampling
        if s.max_tokens == 0:
            for c in req.choices:
                c.finish_reason = "length"
        else:
            for c in req.choices:
                if c.finish_reason is None:
                    self._decode(req, c, s)
        finished = all(c.finish_reason is not None for c in req.choices)
        if req.request.stream or finished:
            req.queue.put_nowait(self._output(req, finished))
        if finished:
            req.done = True
            for c in req.choices:
                if c.finish_reason is not None:  # every one is, as `finished` says
                    self._success[c.finish_reason] += 1
            self._release(req, "finished")

    def _decode(self, req: _SimRequest, c: _Choice, s: SamplingOptions) -> None:
        """Generate one token of choice `c`."""
        tok = self._tokenizer
        eos_ok = len(c.token_ids) >= s.min_tokens and not s.ignore_eos
        candidate = self._next_natural(c, eos_ok)
        allowed = c.state.allowed_tokens() if c.state is not None else None
        num_allowed = self._vocab_size
        if allowed is None:
            token = candidate
        else:
            num_allowed = max(len(allowed), 1)
            token = self._constrained(c, candidate, allowed)
        if token == candidate and token not in tok.eos_ids:
            (c.script if c.script is not None else c.pending).pop()
        elif c.script is not None and token not in tok.eos_ids:
            c.script = None  # the constraint overrode the script: sample from here on
        if c.state is not None and not c.state.advance(token):
            raise RuntimeError(f"token {token} is outside the constraint's mask")
        c.token_ids.append(token)
        self._generation_tokens += 1
        if s.logprobs is not None:
            c.logprobs.append(self._logprob(token, s.logprobs, num_allowed))
        if token in tok.eos_ids:
            c.finish_reason = "stop"
        else:
            before = len(c.text)
            c.text += c.decoder.decode(tok.token_bytes[token])
            if s.stop and len(c.token_ids) > s.min_tokens:
                self._check_stop(c, s.stop, before)
        scripted_end = c.script is not None and not c.script and len(c.token_ids) >= s.min_tokens
        if c.finish_reason is None and scripted_end and (c.state is None or c.state.is_accepting):
            c.finish_reason = "stop"  # the scripted reply is all the model says
        if c.finish_reason is None and len(c.token_ids) >= req.budget:
            c.finish_reason = "length"
        if c.finish_reason is not None and c.stop_reason is None:
            c.text += c.decoder.decode(b"", final=True)

    def _next_natural(self, c: _Choice, eos_ok: bool) -> int:
        """The unconstrained model's next token: the script's, else the next word's, else EOS."""
        eos = self._tokenizer.eos_ids[0]
        if c.script is not None:
            if c.script:
                return c.script[-1]
            if eos_ok:
                return eos
            c.script = None  # min_tokens or ignore_eos outlast the script: go on with words
        if not c.pending:
            if c.words_left <= 0 and eos_ok:
                return eos
            c.words_left -= 1
            word = c.rng.choice(_WORDS)
            c.pending = list(reversed(self._tokenizer.encode((" " if c.token_ids else "") + word, False)))
        return c.pending[-1]

    def _constrained(self, c: _Choice, candidate: int, allowed: list[int]) -> int:
        eos_ids = self._tokenizer.eos_ids
        if not allowed:
            return eos_ids[0]
        if c.script and _contains(allowed, candidate):
            return candidate
        # The shortest valid output once the constraint accepts: ends JSON as soon as it is whole.
        for eos in eos_ids:
            if _contains(allowed, eos):
                return eos
        c.since_close += 1
        if c.rng.random() < c.since_close / _CLOSE_RAMP_TOKENS:
            for t in self._closers:
                if _contains(allowed, t):
                    c.since_close = 0
                    return t
        if _contains(allowed, candidate):
            return candidate
        return allowed[c.rng.randrange(len(allowed))]

    @staticmethod
    def _check_stop(c: _Choice, stops: Sequence[str], before: int) -> None:
        longest = max(len(stop) for stop in stops)
        start = max(0, before - longest + 1)
        hits = [(i, stop) for stop in stops if (i := c.text.find(stop, start)) >= 0]
        if hits:
            at, stop = min(hits)
            c.text = c.text[:at]
            c.finish_reason, c.stop_reason = "stop", stop

    def _token_text(self, token: int) -> str:
        return self._tokenizer.token_bytes[token].decode("utf-8", "replace")

    def _logprob(self, token: int, k: int, num_allowed: int) -> TokenLogprob:
        chosen = -math.log(num_allowed) if num_allowed > 1 else 0.0
        if num_allowed == self._vocab_size:
            chosen = -0.5  # unconstrained: the simulated model is fairly sure of itself
        top = [TopLogprob(self._token_text(token), token, chosen)]
        for rank in range(1, k):
            alt = (token + rank) % self._vocab_size
            top.append(TopLogprob(self._token_text(alt), alt, chosen - rank))
        return TokenLogprob(self._token_text(token), token, chosen, top[:k])

    def _output(self, req: _SimRequest, finished: bool) -> GenerateOutput:
        """The delta since the last output (everything, for a non-streaming request)."""
        s = req.request.sampling
        choices = []
        for c in req.choices:
            if c.reported:
                continue
            hold = 0
            if c.finish_reason is None and s.stop:
                # A stop string may still complete: hold back what could be its start.
                hold = max(len(stop) for stop in s.stop) - 1
            visible = max(len(c.text) - hold, c.sent_text)
            text = c.text[c.sent_text : visible]
            ids = c.token_ids[c.sent_tokens :]
            if not text and not ids and c.finish_reason is None:
                continue
            choices.append(
                ChoiceDelta(
                    index=c.index,
                    text=text,
                    token_ids=ids,
                    logprobs=c.logprobs[c.sent_tokens :] if s.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
            c.sent_text, c.sent_tokens = visible, len(c.token_ids)
            c.reported = c.finish_reason is not None
        out = GenerateOutput(choices=choices, finished=finished)
        if req.first:
            req.first = False
            out.prompt_tokens = len(req.prompt_ids)
            out.cached_prompt_tokens = 0
            if s.prompt_logprobs is not None:
                out.prompt_logprobs = [
                    TokenLogprob(
                        self._token_text(t),
                        t,
                        None if i == 0 else -float(t % 7),
                        []
                        if i == 0
                        else [TopLogprob(self._token_text(t), t, -float(t % 7))][: s.prompt_logprobs],
                    )
                    for i, t in enumerate(req.prompt_ids)
                ]
            if req.request.echo:
                out.prompt_text = req.prompt_text
                out.prompt_token_ids = list(req.prompt_ids)
        return out

    # ---- metrics ----------------------------------------------------------------------------
    def metrics(self) -> Iterable[Metric]:
        labels, values = ["model_name", "engine"], [self.name, "0"]
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels=labels
        )
        running.add_metric(values, self.num_running)
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=labels
        )
        waiting.add_metric(values, self.num_waiting)
        kv = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=labels
        )
        kv.add_metric(values, self.kv_usage)
        prompt = CounterMetricFamily(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels=labels
        )
        prompt.add_metric(values, self._prompt_tokens)
        generation = CounterMetricFamily(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels=labels
        )
        generation.add_metric(values, self._generation_tokens)
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*labels, "finished_reason"],
        )
        for reason, count in self._success.items():
            success.add_metric([*values, reason], count)
        return [running, waiting, kv, prompt, generation, success]


def _contains(sorted_ids: list[int], token: int) -> bool:
    i = bisect.bisect_left(sorted_ids, token)
    return i < len(sorted_ids) and sorted_ids[i] == token


def _seed(prompt_ids: list[int], seed: int | None) -> int:
    digest = hashlib.blake2b(repr((prompt_ids, seed)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")

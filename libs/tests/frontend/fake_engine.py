"""A scripted engine implementing paved.engine.protocol.Engine, for fast frontend tests.

It produces deterministic text ("w0 w1 ..." or a scripted reply) one token per step, keeps
every request it admitted, and records aborts, so tests can check what the frontend asked
for and that it freed what it had to.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from prometheus_client.core import GaugeMetricFamily

from paved.engine.protocol import (
    ChatPrompt,
    ChoiceDelta,
    EmbedRequest,
    EmbedResult,
    GenerateOutput,
    GenerateRequest,
    InvalidRequestError,
    ModelCard,
    ModelNotFoundError,
    PromptTooLongError,
    TextPrompt,
    TokenLogprob,
    TokenPrompt,
    TopLogprob,
)

MAX_MODEL_LEN = 256


def tokens_of(text: str) -> list[str]:
    """The fake tokenizer: one token per character."""
    return list(text)


class FakeStream:
    def __init__(
        self, engine: FakeEngine, request: GenerateRequest, prompt: list[str], replies: list[list[str]]
    ):
        self.engine = engine
        self.request = request
        self.prompt = prompt
        self.replies = replies
        self.step = 0
        self.first = True
        self.finished = False
        self.closed = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> GenerateOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        try:
            await asyncio.sleep(self.engine.step_delay_s)
        except BaseException:
            await self.aclose()
            raise
        s = self.request.sampling
        choices = []
        budget = s.max_tokens if s.max_tokens is not None else MAX_MODEL_LEN - len(self.prompt)
        for index, reply in enumerate(self.replies):
            if self.step >= len(reply) or self.step >= budget:
                continue
            token = reply[self.step]
            done = self.step + 1 >= len(reply) or self.step + 1 >= budget
            finish = None
            if done:
                finish = "stop" if self.step + 1 >= len(reply) and not s.ignore_eos else "length"
            logprobs = None
            if s.logprobs is not None:
                top = [TopLogprob(token, 100 + self.step, -0.5)][: s.logprobs]
                logprobs = [TokenLogprob(token, 100 + self.step, -0.5, top)]
            choices.append(ChoiceDelta(index, token, [100 + self.step], logprobs, finish))
        self.step += 1
        out = GenerateOutput(choices=choices)
        if s.max_tokens == 0:
            out.choices = [ChoiceDelta(i, finish_reason="length") for i in range(s.n)]
        if self.first:
            self.first = False
            out.prompt_tokens = len(self.prompt)
            out.cached_prompt_tokens = 0
            if s.prompt_logprobs is not None:
                out.prompt_logprobs = [
                    TokenLogprob(t, i, None if i == 0 else -float(ord(t) % 7))
                    for i, t in enumerate(self.prompt)
                ]
            if self.request.echo:
                out.prompt_text = "".join(self.prompt)
        if s.max_tokens == 0 or all(self.step >= min(len(r), budget) for r in self.replies):
            out.finished = True
            self.finished = True
            await self.aclose()
        return out

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.engine.active.pop(self.request.request_id, None)
        if not self.finished:
            self.engine.aborted.append(self.request.request_id)


class FakeEngine:
    def __init__(
        self,
        *,
        name: str = "fake",
        embed_name: str | None = "fake-embed",
        backends: tuple = ("paved", "xgrammar"),
        step_delay_s: float = 0.0,
        reply: Callable[[GenerateRequest], str] | None = None,
    ):
        self.name = name
        self.embed_name = embed_name
        self.backends = backends
        self.step_delay_s = step_delay_s
        self.reply = reply
        self.requests: list[GenerateRequest] = []
        self.active: dict[str, FakeStream] = {}
        self.aborted: list[str] = []
        self.started = False
        self.stopped = False
        self.admission_error: Exception | None = None

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    def ready(self) -> bool:
        return self.started and not self.stopped

    def models(self) -> Sequence[ModelCard]:
        cards = [
            ModelCard(
                self.name, "generate", MAX_MODEL_LEN, int(time.time()), constraint_backends=self.backends
            )
        ]
        if self.embed_name:
            cards.append(ModelCard(self.embed_name, "embed", MAX_MODEL_LEN, int(time.time())))
        return cards

    def _prompt(self, request: GenerateRequest) -> list[str]:
        p = request.prompt
        if isinstance(p, ChatPrompt):
            return tokens_of("".join(f"<{m['role']}>{m['content']}" for m in p.messages))
        if isinstance(p, TokenPrompt):
            return [chr(97 + t % 26) for t in p.token_ids]
        return tokens_of(p.text)

    async def generate(self, request: GenerateRequest) -> FakeStream:
        if request.model != self.name:
            raise ModelNotFoundError(request.model)
        if self.admission_error is not None:
            raise self.admission_error
        prompt = self._prompt(request)
        s = request.sampling
        if s.max_tokens is not None and len(prompt) + max(s.max_tokens, 1) > MAX_MODEL_LEN:
            raise PromptTooLongError(
                prompt_tokens=len(prompt),
                max_tokens=s.max_tokens,
                max_model_len=MAX_MODEL_LEN,
                param="prompt",
            )
        self.requests.append(request)
        text = self.reply(request) if self.reply else " ".join(f"w{i}" for i in range(8))
        replies = [tokens_of(text) for _ in range(s.n)]
        stream = FakeStream(self, request, prompt, replies)
        self.active[request.request_id] = stream
        return stream

    async def embed(self, request: EmbedRequest) -> EmbedResult:
        if request.model != self.embed_name:
            raise ModelNotFoundError(request.model)
        vectors, tokens = [], 0
        for p in request.inputs:
            n = len(p.text) if isinstance(p, TextPrompt) else len(p.token_ids)
            if n > MAX_MODEL_LEN:
                raise InvalidRequestError("input too long", param="input")
            tokens += n
            vectors.append([float(n), 0.5, -0.25][: request.dimensions or 3])
        return EmbedResult(vectors, tokens)

    async def tokenize(self, model: str, text: str, *, add_special_tokens: bool) -> list[int]:
        return [ord(c) % 26 for c in text]

    async def abort(self, request_id: str) -> None:
        stream = self.active.get(request_id)
        if stream is not None:
            await stream.aclose()

    def metrics(self):
        family = GaugeMetricFamily(
            "fake_engine_active_requests", "Requests in flight.", labels=["model_name"]
        )
        family.add_metric([self.name], len(self.active))
        return [family]

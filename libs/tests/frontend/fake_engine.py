"""The frontend tests' engine: paved's simulated engine (paved.engine.sim) plus scripting hooks.

Everything the engine contract says is the sim's own behaviour (one token per UTF-8 byte,
deltas, finish reasons, stop strings, aborts on close, paved constraints sampled from the
native masks). This subclass only adds what the tests script or inspect:
  * the reply: "w0 w1 ... w7" or `reply(request)`, then finish_reason "stop";
  * `requests` (every admitted request), `active` (open streams), `aborted` (request ids that
    ended unfinished), `admission_error` (raised by the next `generate` calls);
  * `step_delay_s` (seconds per token, settable while serving);
  * a second, embedding model (`embed_name`) whose vector starts with the input's length;
  * xgrammar constraints are accepted and recorded, not enforced (the tests check routing;
    the sim itself refuses them);
  * a `fake_engine_active_requests` gauge beside the sim's vLLM gauges.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence

from prometheus_client.core import GaugeMetricFamily

from paved.engine.protocol import (
    Constraint,
    EmbedRequest,
    EmbedResult,
    GenerateRequest,
    InvalidRequestError,
    ModelCard,
    ModelNotFoundError,
    TextPrompt,
)
from paved.engine.sim import SimConfig, SimEngine, SimStream

MAX_MODEL_LEN = 256
DEFAULT_REPLY = " ".join(f"w{i}" for i in range(8))

# Characters a line-based SSE client splits a line on (httpx's aiter_lines and Python's
# str.splitlines); JSON text may carry the last three raw inside a string.
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
TEXT_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def line_break_json(i: int) -> str:
    """The i-th structured answer (compact JSON of TEXT_SCHEMA): its string holds raw U+0085,
    U+2028 and U+2029 (valid JSON) and escaped control characters, in varying places."""
    raw = "\x85\u2028\u2029"
    value = "".join(f"w{j}{raw[(i + j) % 3]}" for j in range(i % 5 + 1)) + "\\r\\n\\u000b"
    return json.dumps({"text": value}, ensure_ascii=False, separators=(",", ":"))


def line_break_text(i: int) -> str:
    """The i-th plain answer: raw line breaks of every kind (JSON escapes them in events)."""
    return f"a{LINE_BREAKS[i % 10 :]}b\r\nc"


def line_break_reply(request: GenerateRequest) -> str:
    """A `reply` for prompts "json I" (line_break_json) and "text I" (line_break_text)."""
    prompt = request.prompt
    content = prompt.messages[-1]["content"] if hasattr(prompt, "messages") else prompt.text
    kind, i = content.split()
    return line_break_json(int(i)) if kind == "json" else line_break_text(int(i))


# The stream type, under the name the tests have always imported.
FakeStream = SimStream


def tokens_of(text: str) -> list[str]:
    """The tokenizer as the tests count it: one token per character (per byte, for ASCII)."""
    return list(text)


class FakeEngine(SimEngine):
    def __init__(
        self,
        *,
        name: str = "fake",
        embed_name: str | None = "fake-embed",
        backends: tuple = ("paved", "xgrammar"),
        step_delay_s: float = 0.0,
        reply: Callable[[GenerateRequest], str] | None = None,
    ):
        super().__init__(
            SimConfig(
                name,
                tokens_per_s=_rate(step_delay_s),
                max_num_seqs=64,
                max_waiting=1024,
                max_model_len=MAX_MODEL_LEN,
                constraint_backends=("paved",) if "paved" in backends else (),
            )
        )
        self.embed_name = embed_name
        self.backends = backends
        self.reply = reply
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.started = False
        self.stopped = False
        self.admission_error: Exception | None = None

    # ---- scripting -------------------------------------------------------------------------
    @property
    def step_delay_s(self) -> float:
        return 1.0 / self.tokens_per_s if self.tokens_per_s else 0.0

    @step_delay_s.setter
    def step_delay_s(self, value: float) -> None:
        self.tokens_per_s = _rate(value)

    @property
    def active(self) -> dict:
        """Requests whose stream is still open."""
        return self._requests

    def _reply(self, request: GenerateRequest, index: int) -> str | None:
        return self.reply(request) if self.reply else DEFAULT_REPLY

    def _xgrammar_constraint(self, c: Constraint):
        if "xgrammar" not in self.backends:
            return super()._xgrammar_constraint(c)
        return None  # recorded in `requests`, not enforced

    def _on_abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    # ---- the engine ------------------------------------------------------------------------
    async def start(self) -> None:
        await super().start()
        self._card = dataclasses.replace(self._card, constraint_backends=tuple(self.backends))
        self.started = True

    async def stop(self) -> None:
        await super().stop()
        self.stopped = True

    def models(self) -> Sequence[ModelCard]:
        cards = list(super().models())
        if self.embed_name:
            cards.append(ModelCard(self.embed_name, "embed", MAX_MODEL_LEN, int(time.time())))
        return cards

    async def generate(self, request: GenerateRequest) -> SimStream:
        if request.model != self.name:
            raise ModelNotFoundError(request.model)
        if self.admission_error is not None:
            raise self.admission_error
        stream = await super().generate(request)
        self.requests.append(request)
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

    def metrics(self):
        family = GaugeMetricFamily(
            "fake_engine_active_requests", "Requests in flight.", labels=["model_name"]
        )
        family.add_metric([self.name], len(self._requests))
        return [*super().metrics(), family]


def _rate(step_delay_s: float) -> float:
    return 1.0 / step_delay_s if step_delay_s > 0 else 0.0

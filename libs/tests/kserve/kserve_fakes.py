"""Test helpers for the KServe tests: a scripted Engine, a server on a background loop, fixtures.

`FakeEngine` implements the engine protocol with deterministic output so the transports can be
checked exactly: token i of a completion is "w{i} "; a constrained request emits
`constrained_text`; the prompt "hang" streams until cancelled. Every admitted request and every
abort is recorded, which is how tests prove parameters and constraints reached the engine and
that cancelling a call aborted the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from paved.engine.protocol import (
    ChatPrompt,
    ChoiceDelta,
    EmbedRequest,
    EmbedResult,
    EngineUnavailableError,
    GenerateOutput,
    GenerateRequest,
    InvalidRequestError,
    ModelCard,
    ModelNotFoundError,
    TextPrompt,
    TokenLogprob,
    TopLogprob,
)

if TYPE_CHECKING:
    from paved.kserve.server import KServeServer

LLM = "fake-llm"
EMBED = "fake-embed"
XGB = "xgb_scorer"  # the model of xgb_model_dir()


# A small schema every KServe test constrains LLM output with.
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
    "required": ["ok", "level"],
    "additionalProperties": False,
}


class FakeEngine:
    def __init__(self, *, ready: bool = True, constrained_text: str = '{"ok":true,"level":"high"}'):
        self._ready = ready
        self.constrained_text = constrained_text
        self.requests: list[GenerateRequest] = []
        self.embed_requests: list[EmbedRequest] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.cards = [
            ModelCard(LLM, "generate", 256, 0, constraint_backends=("paved", "xgrammar"), max_logprobs=5),
            ModelCard(EMBED, "embed", 128, 0),
        ]

    def set_ready(self, ready: bool) -> None:
        self._ready = ready

    async def start(self) -> None:
        self._ready = True

    async def stop(self) -> None:
        self._ready = False

    def ready(self) -> bool:
        return self._ready

    def models(self) -> Sequence[ModelCard]:
        return self.cards

    def metrics(self) -> Iterable:
        return []

    async def tokenize(self, model: str, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(range(len(text.split())))

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def embed(self, request: EmbedRequest) -> EmbedResult:
        self.embed_requests.append(request)
        (prompt,) = request.inputs
        size = request.dimensions or 4
        text = prompt.text if isinstance(prompt, TextPrompt) else " ".join(map(str, prompt.token_ids))
        return EmbedResult(
            embeddings=[[float(len(text))] + [0.5] * (size - 1)], prompt_tokens=len(text.split())
        )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        if request.model != LLM:
            raise ModelNotFoundError(f"model {request.model!r} is not served by this engine")
        if not self._ready:
            raise EngineUnavailableError("fake engine is not ready")
        prompt = request.prompt
        if isinstance(prompt, ChatPrompt):
            text = " ".join(m["content"] for m in prompt.messages)
        elif isinstance(prompt, TextPrompt):
            text = prompt.text
        else:
            text = " ".join(map(str, prompt.token_ids))
        max_tokens = request.sampling.max_tokens
        if max_tokens is not None and len(text.split()) + max_tokens > 256:
            raise InvalidRequestError("prompt plus max_tokens exceeds the fake context of 256")
        self.requests.append(request)
        return self._stream(request, text)

    async def _stream(self, request: GenerateRequest, prompt: str) -> AsyncIterator[GenerateOutput]:
        s = request.sampling
        finished = False
        try:
            if prompt == "hang":
                i = 0
                while True:
                    await asyncio.sleep(0.01)
                    yield GenerateOutput([ChoiceDelta(0, f"w{i} ", [i])], prompt_tokens=1 if i == 0 else None)
                    i += 1
            if s.constraint is not None:
                pieces = [self.constrained_text]
            else:
                pieces = [f"w{i} " for i in range(s.max_tokens if s.max_tokens is not None else 8)]
            reason = "stop" if s.constraint is not None else "length"
            for step, piece in enumerate(pieces):
                last = step == len(pieces) - 1
                choices = []
                for index in range(s.n):
                    logprobs = None
                    if s.logprobs is not None:
                        top = [TopLogprob(f"alt{k}", 100 + k, -1.0 - k) for k in range(s.logprobs)]
                        logprobs = [TokenLogprob(piece, step, -0.5, top)]
                    choices.append(
                        ChoiceDelta(
                            index, piece, [step], logprobs=logprobs, finish_reason=reason if last else None
                        )
                    )
                yield GenerateOutput(
                    choices, prompt_tokens=len(prompt.split()) if step == 0 else None, finished=last
                )
                await asyncio.sleep(0)
            finished = True
            self.finished.append(request.request_id)
        finally:
            if not finished:
                self.aborted.append(request.request_id)


class LoopThread:
    """An asyncio loop on a daemon thread, for servers the (synchronous) clients talk to."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="kserve-test-loop")
        self._thread.start()

    def run(self, coro, timeout: float = 60):
        future: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def loopback_server(engines: Sequence[Any], *, xgb: bool = True, **options: Any) -> KServeServer:
    """A KServeServer (not started) on 127.0.0.1 with free gRPC and HTTP ports, unless `options`
    say otherwise: `engines`' models and, if `xgb`, the XGB model of xgb_model_dir()."""
    from paved.kserve.server import KServeServer
    from paved.kserve.xgboost_model import XGBoostModel

    classic = [XGBoostModel.from_directory(xgb_model_dir())] if xgb else []
    return KServeServer(engines, classic, **{"host": "127.0.0.1", "grpc_port": 0, "http_port": 0, **options})


@contextlib.contextmanager
def serving(
    loop: LoopThread, server: KServeServer | Awaitable[KServeServer], *, ready: bool = True
) -> Iterator[KServeServer]:
    """`server` started on `loop` (or awaited there, for a start such as serve_kserve's), and
    unless `ready=False` with its classic models loaded; stopped with a 1 s grace on exit."""

    async def start() -> KServeServer:
        if inspect.isawaitable(server):
            return await server
        await server.start()
        return server

    started = loop.run(start())
    try:
        if ready:
            loop.run(started.wait_ready(60))
        yield started
    finally:
        loop.run(started.stop(grace_s=1))


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def xgb_model_dir() -> str:
    """//models/xgb from the runfiles; outside Bazel (plain pytest), generated once into a temp dir."""
    from paved.runfiles import runfile

    try:
        return os.path.dirname(runfile("models/xgb/config.json"))
    except FileNotFoundError:
        pass
    out = os.path.join(tempfile.gettempdir(), "paved-kserve-test-xgb")
    if not os.path.exists(os.path.join(out, "config.json")):
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.path.join(here, "..", "..", "..", "models", "xgb", "generate.py")
        spec = importlib.util.spec_from_file_location("xgb_generate", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        os.makedirs(out, exist_ok=True)
        module.train(100, 6).save_model(os.path.join(out, "model.ubj"))
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(module.config(XGB), f)
    return out


# ---- tritonclient request helpers (module: tritonclient.grpc or tritonclient.http) ----------
def tensor(module, name, value, datatype, **kwargs):
    t = module.InferInput(name, list(value.shape), datatype)
    t.set_data_from_numpy(value, **kwargs)
    return t


def llm_inputs(module, text, *, stream=None, params=None, exclude=None, **flags):
    """Triton vLLM-backend inputs: text_input, then the optional tensors that are given."""
    inputs = [tensor(module, "text_input", np.array([text.encode()], dtype=object), "BYTES")]
    if stream is not None:
        inputs.append(tensor(module, "stream", np.array([stream]), "BOOL"))
    if params is not None:
        raw = params if isinstance(params, str) else json.dumps(params)
        inputs.append(tensor(module, "sampling_parameters", np.array([raw.encode()], dtype=object), "BYTES"))
    if exclude is not None:
        inputs.append(tensor(module, "exclude_input_in_output", np.array([exclude]), "BOOL"))
    for name, value in flags.items():
        inputs.append(tensor(module, name, np.array([value]), "BOOL"))
    return inputs


def stream(gc, requests, *, model=LLM, headers=None, cancel_after=None, timeout=10):
    """Send (inputs, kwargs) requests for `model` on one ModelStreamInfer of the
    tritonclient.grpc client `gc`; collect (result, error) responses until every request has its
    final response or an error (or `cancel_after` responses, then cancel the stream)."""
    results: queue.Queue = queue.Queue()
    gc.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
    try:
        for inputs, kwargs in requests:
            gc.async_stream_infer(model, inputs, **kwargs)
        out, finals = [], 0
        while finals < len(requests):
            result, error = results.get(timeout=timeout)
            out.append((result, error))
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                finals += 1
            if cancel_after is not None and len(out) >= cancel_after:
                break
        return out
    finally:
        gc.stop_stream(cancel_requests=cancel_after is not None)


# `python -c` rather than `-m`: the tests' sys.path (runfiles) is passed on as PYTHONPATH.
KSERVE_MAIN = "import sys; from paved.kserve.main import main; sys.exit(main(sys.argv[1:]))"


def run_kserve_main(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """paved.kserve.main with `args`, run to its end (for the ones that exit: bad flags, ...)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(
        [sys.executable, "-c", KSERVE_MAIN, *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@contextlib.contextmanager
def kserve_main(*args: str) -> Iterator[tuple[int, int]]:
    """paved.kserve.main as a process with `args` on any free ports: yields (gRPC port, HTTP
    port) once it printed them; on leaving, SIGTERM, which must end it with status 0 (it is
    killed whatever happens)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    command = [sys.executable, "-c", KSERVE_MAIN, *args, "--grpc-port", "0", "--http-port", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"gRPC (\d+) HTTP (\d+)", line)
        assert match, f"paved.kserve.main printed {line!r} (exit {proc.poll()})"
        yield int(match.group(1)), int(match.group(2))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

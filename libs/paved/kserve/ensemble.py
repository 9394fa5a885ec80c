"""Triton's ensemble scheduler: a model (platform "ensemble") whose requests flow through other
models of the same server, step by step, along the tensors its config names.

  ensemble_scheduling { step [
    { model_name: "pre"  model_version: -1  input_map { key: "RAW" value: "in" }
      output_map { key: "OUT__0" value: "features" } },
    { model_name: "score" model_version: -1 input_map { key: "INPUT__0" value: "features" }
      output_map { key: "OUTPUT__0" value: "scores" } } ] }
`input_map` maps a step model's input to an ensemble tensor, `output_map` a step model's
output to an ensemble tensor; ensemble tensors are the ensemble's own inputs and outputs plus
any intermediate names. `model_version` -1 is the latest ready version.

Checked at create (ModelConfigError naming the step and tensor): each tensor is written by at
most one step and never over an ensemble input; every tensor a step reads is an ensemble input
or some step's output; every ensemble output is some step's output; the graph has no cycle
(steps may be listed in any order); a step never calls the ensemble itself; every ensemble
input is read by some step.

At request time each step calls its model through the repository (`get_ready` + `infer`), so
steps run on any backend (the LLM included) and load independently of the ensemble. A step
starts as soon as every tensor it reads is known; independent steps run concurrently. A
step's inputs are checked against its model like a client's (a datatype or shape that does not
fit fails the request with the model's message, prefixed by the ensemble and step). Request
parameters go to every step (a step model that takes none refuses them).

Decoupled steps (an LLM, a decoupled python model): every response a decoupled step sends
carries the rest of the graph once more, so downstream steps run per response and the ensemble
sends one response per completed pass, like Triton. On the unary ModelInfer path that works
when the step sends exactly one response (e.g. an LLM with stream=false); a streaming step
needs ModelStreamInfer / generate_stream. Two decoupled steps ready at the same moment
(independent of each other) are refused with UNIMPLEMENTED: the pairing of their responses is
not defined. Ensemble outputs a pass did not produce (a step's optional output) are left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2

from paved.engine.streams import Closing, aclose
from paved.kserve.backends import ModelConfigError, ModelSource, RepositoryView
from paved.kserve.errors import KServeError, unsupported
from paved.kserve.model import InferRequest, InferResponse, ModelState, ServedModel
from paved.kserve.model_config import ConfigTensorSpec, check_config
from paved.kserve.tensor_model import internal
from paved.kserve.tensors import datatype_of

# Nested ensembles deeper than this are taken for a cycle through several ensembles.
MAX_DEPTH = 8
_depth: contextvars.ContextVar[int] = contextvars.ContextVar("paved_ensemble_depth", default=0)


def create(source: ModelSource) -> ServedModel:
    return EnsembleModel(source)


@dataclass(frozen=True)
class Step:
    index: int
    model_name: str
    version: str  # "" = latest ready
    input_map: dict[str, str]  # step model input -> ensemble tensor
    output_map: dict[str, str]  # step model output -> ensemble tensor

    @property
    def where(self) -> str:
        return f"step {self.index} (model '{self.model_name}')"


class EnsembleModel(ServedModel):
    platform = "ensemble"
    backend = ""

    def __init__(self, source: ModelSource):
        config = source.config
        check_config(config, {"ensemble_scheduling"}, backend="ensemble")
        from paved.kserve.model_config import specs_from_config

        inputs, outputs = specs_from_config(config)
        where = f"ensemble '{config.name}'"
        if not inputs or not outputs:
            raise ModelConfigError(f"{where}: needs inputs and outputs")
        for spec in (*inputs, *outputs):
            if spec.reshape is not None:
                raise ModelConfigError(
                    f"{where}: tensor '{spec.name}': reshape is not supported in an ensemble"
                )
        self._config = config
        self.name = config.name
        self.version = source.version
        self.max_batch_size = config.max_batch_size
        self.inputs: tuple[ConfigTensorSpec, ...] = inputs
        self.outputs: tuple[ConfigTensorSpec, ...] = outputs
        self.repository: RepositoryView = source.repository
        self.steps = _steps(config, where)
        _check_graph(self.steps, inputs, outputs, where)

    # ---- description -----------------------------------------------------------------------
    def config(self) -> model_config_pb2.ModelConfig:
        config = model_config_pb2.ModelConfig()
        config.CopyFrom(self._config)
        return config

    def state(self) -> tuple[ModelState, str]:
        """READY when every step's model is (Triton loads an ensemble once its models are);
        otherwise the first step model's state and reason."""
        for step in self.steps:
            try:
                self.repository.get_ready(step.model_name, step.version)
            except KServeError as e:
                get = getattr(self.repository, "get", None)
                state: ModelState = "UNAVAILABLE"
                if get is not None:
                    with contextlib.suppress(KServeError):
                        state = get(step.model_name, step.version).state()[0]
                        state = "LOADING" if state == "READY" else state
                return state, f"{step.where}: {e.message}"
        return "READY", ""

    # ---- inference -------------------------------------------------------------------------
    async def infer(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        depth = _depth.get()
        if depth >= MAX_DEPTH:
            raise unsupported(f"ensemble '{self.name}': ensembles nested deeper than {MAX_DEPTH} (a cycle?)")
        env: dict[str, np.ndarray | None] = {s.name: request.inputs.get(s.name) for s in self.inputs}
        passes = self._flow(request, env, frozenset(s.index for s in self.steps), depth + 1)
        return Closing(self._responses(passes), passes.aclose)

    async def _responses(self, passes: AsyncIterator[dict]) -> AsyncIterator[InferResponse]:
        # One response held back so that the last one can carry final=True.
        held: InferResponse | None = None
        async for env in passes:
            if held is not None:
                yield held
            held = InferResponse(self._outputs(env), final=False)
        if held is not None:
            held.final = True
            yield held
        else:
            yield InferResponse({}, final=True)

    def _outputs(self, env: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        out = {}
        for spec in self.outputs:
            value = env.get(spec.name)
            if value is None:
                continue
            datatype = datatype_of(value)
            if datatype != spec.datatype:
                raise internal(
                    f"ensemble '{self.name}': output '{spec.name}' is {datatype} from its step but the "
                    f"ensemble config says {spec.datatype}"
                )
            shape = list(value.shape)[1:] if self.max_batch_size > 0 else list(value.shape)
            if len(shape) != len(spec.dims) or any(
                d != -1 and d != s for d, s in zip(spec.dims, shape, strict=True)
            ):
                raise internal(
                    f"ensemble '{self.name}': output '{spec.name}' has shape {list(value.shape)} from its "
                    f"step, which does not fit the ensemble config's {spec.full_shape(self.max_batch_size)}"
                )
            out[spec.name] = value
        return out

    async def _flow(
        self, request: InferRequest, env: dict[str, np.ndarray | None], pending: frozenset[int], depth: int
    ) -> AsyncGenerator[dict[str, np.ndarray | None]]:
        """Every completed pass through the steps in `pending`, given the tensors in `env`
        (a tensor known to be absent is None)."""
        env = dict(env)
        waiting = set(pending)
        running: dict[asyncio.Task, Step] = {}
        try:
            while True:
                fanout: tuple[Step, ServedModel] | None = None
                for index in sorted(waiting):
                    step = self.steps[index]
                    if not all(t in env for t in step.input_map.values()):
                        continue
                    model = self._model(step)
                    if model.decoupled:
                        if fanout is not None:
                            raise unsupported(
                                f"ensemble '{self.name}': decoupled {fanout[0].where} and {step.where} "
                                "are ready at once; independent decoupled steps are not supported"
                            )
                        fanout = (step, model)
                        continue
                    waiting.discard(index)
                    context = contextvars.copy_context()
                    context.run(_depth.set, depth)
                    task = asyncio.create_task(self._unary(step, model, request, env), context=context)
                    running[task] = step
                if not running:
                    if fanout is None:
                        yield env
                        return
                    step, model = fanout
                    rest = frozenset(waiting - {step.index})
                    # Closed explicitly: a client that goes away must abort the step's request now.
                    async with contextlib.aclosing(self._stream(step, model, request, env, depth)) as stream:
                        async for outputs in stream:
                            downstream = self._flow(request, {**env, **outputs}, rest, depth)
                            async with contextlib.aclosing(downstream) as passes:
                                async for done in passes:
                                    yield done
                    return
                finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    running.pop(task)
                    env.update(task.result())
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)

    def _model(self, step: Step) -> ServedModel:
        try:
            return self.repository.get_ready(step.model_name, step.version)
        except KServeError as e:
            raise KServeError(e.code, f"ensemble '{self.name}' {step.where}: {e.message}") from None

    async def _call(self, model: ServedModel, request: InferRequest) -> AsyncIterator[InferResponse]:
        # RepositoryView.infer is declared plain but ModelRepository.infer is a coroutine
        # function: take either.
        result: Any = self.repository.infer(model, request)
        return await result if inspect.isawaitable(result) else result

    def _step_request(self, step: Step, model: ServedModel, request: InferRequest, env: dict) -> InferRequest:
        inputs = {name: env[tensor] for name, tensor in step.input_map.items() if env[tensor] is not None}
        try:
            model.check_required(list(inputs))
            for name, value in inputs.items():
                model.check_input(name, datatype_of(value), value.shape)
            model.check_outputs(step.output_map)
        except KServeError as e:
            raise KServeError(e.code, f"ensemble '{self.name}' {step.where}: {e.message}") from None
        return InferRequest(
            model_name=model.name,
            id=request.id,
            inputs=inputs,
            parameters=dict(request.parameters),
            outputs=list(step.output_map),
            decoupled=request.decoupled,
        )

    def _mapped(self, step: Step, response: InferResponse) -> dict[str, np.ndarray | None]:
        return {tensor: response.outputs.get(name) for name, tensor in step.output_map.items()}

    async def _unary(
        self, step: Step, model: ServedModel, request: InferRequest, env: dict
    ) -> dict[str, np.ndarray | None]:
        step_request = self._step_request(step, model, request, env)
        try:
            responses = await self._call(model, step_request)
            try:
                results = [r async for r in responses]
            finally:
                await aclose(responses)
        except KServeError as e:
            raise KServeError(e.code, f"ensemble '{self.name}' {step.where}: {e.message}") from None
        if len(results) != 1:
            raise internal(
                f"ensemble '{self.name}' {step.where}: the model sent {len(results)} responses, not 1"
            )
        return self._mapped(step, results[0])

    async def _stream(
        self, step: Step, model: ServedModel, request: InferRequest, env: dict, depth: int
    ) -> AsyncGenerator[dict[str, np.ndarray | None]]:
        step_request = self._step_request(step, model, request, env)
        token = _depth.set(depth)
        try:
            responses = await self._call(model, step_request)
        except KServeError as e:
            raise KServeError(e.code, f"ensemble '{self.name}' {step.where}: {e.message}") from None
        finally:
            _depth.reset(token)
        try:
            while True:
                try:
                    response = await anext(responses)
                except StopAsyncIteration:
                    return
                except KServeError as e:
                    raise KServeError(e.code, f"ensemble '{self.name}' {step.where}: {e.message}") from None
                if not response.outputs:  # an empty final response only ends the stream
                    continue
                yield self._mapped(step, response)
        finally:
            await aclose(responses)


# ---- config -----------------------------------------------------------------------------------
def _steps(config: model_config_pb2.ModelConfig, where: str) -> tuple[Step, ...]:
    scheduling = config.ensemble_scheduling
    if not config.HasField("ensemble_scheduling") or not scheduling.step:
        raise ModelConfigError(f"{where}: ensemble_scheduling needs at least one step")
    for i, raw in enumerate(scheduling.step):
        unknown = sorted(
            fd.name
            for fd, _ in raw.ListFields()
            if fd.name not in ("model_name", "model_version", "input_map", "output_map")
        )
        if unknown:
            raise ModelConfigError(f"{where}: step {i}: {unknown} are not supported by this server")
    steps = []
    for i, raw in enumerate(scheduling.step):
        if not raw.model_name:
            raise ModelConfigError(f"{where}: step {i} has no model_name")
        if raw.model_version < -1 or raw.model_version == 0:
            raise ModelConfigError(f"{where}: step {i}: model_version must be -1 (latest) or >= 1")
        if raw.model_name == config.name:
            raise ModelConfigError(f"{where}: step {i} calls the ensemble itself")
        if not raw.input_map or not raw.output_map:
            raise ModelConfigError(
                f"{where}: step {i} (model '{raw.model_name}') needs an input_map and an output_map"
            )
        steps.append(
            Step(
                index=i,
                model_name=raw.model_name,
                version="" if raw.model_version == -1 else str(raw.model_version),
                input_map=dict(raw.input_map),
                output_map=dict(raw.output_map),
            )
        )
    return tuple(steps)


def _check_graph(
    steps: tuple[Step, ...],
    inputs: tuple[ConfigTensorSpec, ...],
    outputs: tuple[ConfigTensorSpec, ...],
    where: str,
) -> None:
    ensemble_inputs = {s.name for s in inputs}
    producer: dict[str, Step] = {}
    for step in steps:
        for tensor in step.output_map.values():
            if tensor in ensemble_inputs:
                raise ModelConfigError(f"{where}: {step.where} writes '{tensor}', which is an ensemble input")
            if tensor in producer:
                raise ModelConfigError(
                    f"{where}: tensor '{tensor}' is written by both {producer[tensor].where} and {step.where}"
                )
            producer[tensor] = step
    for step in steps:
        for name, tensor in step.input_map.items():
            if tensor not in ensemble_inputs and tensor not in producer:
                raise ModelConfigError(
                    f"{where}: {step.where} input '{name}' reads tensor '{tensor}', which is neither an "
                    "ensemble input nor any step's output"
                )
    for spec in outputs:
        if spec.name not in producer:
            raise ModelConfigError(f"{where}: ensemble output '{spec.name}' is not written by any step")
    read = {t for step in steps for t in step.input_map.values()}
    unused = sorted(ensemble_inputs - read)
    if unused:
        raise ModelConfigError(f"{where}: ensemble input(s) {unused} are not read by any step")
    # Kahn's algorithm: a step is placed once every step it reads from is placed.
    depends = {s.index: {producer[t].index for t in s.input_map.values() if t in producer} for s in steps}
    placed: set[int] = set()
    while len(placed) < len(steps):
        free = [i for i, deps in depends.items() if i not in placed and deps <= placed]
        if not free:
            cycle = sorted(steps[i].where for i in depends if i not in placed)
            raise ModelConfigError(f"{where}: the steps form a cycle: {', '.join(cycle)}")
        placed.update(free)

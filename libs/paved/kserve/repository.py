"""The model repository behind both transports: the models a KServe server serves.

Two kinds exist (a `ServedModel` is defined in paved.kserve.model): engine-backed LLMs
(paved.kserve.llm, one per `ModelCard` of the engines given to the server, version "1") and
classic models: lone model directories and the models of a Triton model repository directory
(`load_repository_dir`), each version its own `ServedModel` built by its backend
(paved.kserve.backends).

Version resolution (as Triton): a request for version "" gets the highest version that is
READY, else the highest one held (so its state explains why it cannot serve). A model whose
config could not be read or built is held as an `UnavailableModel` with the reason, listed in
the repository index, while the rest of the repository serves.

Statistics (Triton's ModelStatistics; paved.kserve.statistics): `infer` records every request
it runs on the model version that ran it, and `statistics` answers them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import cast

import grpc
from tritonclient.grpc import model_config_pb2

from paved.engine.protocol import Engine
from paved.engine.streams import Closing
from paved.kserve.errors import KServeError, invalid_argument, not_found, unavailable
from paved.kserve.llm import LlmModel
from paved.kserve.metrics import batch_rows

# The model-side names, importable from here as before (the transports import them so).
from paved.kserve.model import MODEL_VERSION as MODEL_VERSION
from paved.kserve.model import TRANSPORT_PARAMETERS as TRANSPORT_PARAMETERS
from paved.kserve.model import Admission as Admission
from paved.kserve.model import InferRequest as InferRequest
from paved.kserve.model import InferResponse as InferResponse
from paved.kserve.model import ModelState as ModelState
from paved.kserve.model import ServedModel as ServedModel
from paved.kserve.model import Ticket as Ticket
from paved.kserve.model import custom_parameters as custom_parameters
from paved.kserve.statistics import RequestTiming, current_timing

logger = logging.getLogger(__name__)


def version_key(version: str) -> int:
    """Numeric order of version names ("" sorts first)."""
    return int(version) if version.isdigit() else -1


class UnavailableModel(ServedModel):
    """Stands in for a model (or one version of it) that cannot be served: its state is
    UNAVAILABLE with `reason`, and every request for it is refused with that reason."""

    def __init__(
        self, name: str, version: str, reason: str, config: model_config_pb2.ModelConfig | None = None
    ):
        self.name = name
        self.version = version
        self.reason = reason
        self._config = config
        if config is not None:
            self.platform, self.backend, self.max_batch_size = (
                config.platform,
                config.backend,
                config.max_batch_size,
            )

    def state(self) -> tuple[ModelState, str]:
        return "UNAVAILABLE", self.reason

    def config(self) -> model_config_pb2.ModelConfig:
        config = model_config_pb2.ModelConfig(name=self.name)
        if self._config is not None:
            config.CopyFrom(self._config)
        return config

    async def infer(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        raise unavailable(f"model '{self.name}' is not available: {self.reason}")


class ModelRepository:
    """Classic models owned by the server (every version of each) plus the models of the
    engines it fronts. It is the `RepositoryView` its classic models are given (get_ready,
    infer), so a model may call another at request time."""

    def __init__(
        self,
        engines: Sequence[Engine] = (),
        classic: Sequence[ServedModel] = (),
        admission: Admission | None = None,
        draining: Callable[[], bool] | None = None,
    ):
        self._llm_cls = LlmModel
        self.admission = admission
        # True once the owning process is shutting down: ServerReady turns false so load
        # balancers stop routing here while in-flight requests finish.
        self._draining = draining or (lambda: False)
        # Triton's --strict-readiness: False reports the server ready while it serves at all,
        # whatever its models' states (their own readiness still says).
        self.strict_readiness = True
        self.engines = list(engines)
        # name -> version -> model
        self.classic: dict[str, dict[str, ServedModel]] = {}
        for model in classic:
            self.add(model)
        self._llm: dict[str, LlmModel] = {}
        self._loads: list[asyncio.Task] = []

    def add(self, model: ServedModel) -> None:
        """Hold `model` (before `start_loading`); ValueError when its name and version are held."""
        versions = self.classic.setdefault(model.name, {})
        if model.version in versions:
            raise ValueError(
                f"two classic models share the name {model.name!r} and version {model.version!r}"
            )
        versions[model.version] = model

    def load_repository_dir(self, directory: str) -> None:
        """Hold every model of the Triton model repository `directory` (its subdirectories;
        hidden ones skipped): each selected version built by its backend, or an
        `UnavailableModel` with the reason when the config, the backend or the build refuses.
        OSError / ValueError when `directory` itself cannot be listed or a name is taken."""
        from paved.kserve import backends
        from paved.kserve.model_config import read_model_config, versions_to_load

        if not os.path.isdir(directory):
            raise ValueError(f"model repository {directory} is not a directory")
        for entry in sorted(os.listdir(directory)):
            path = os.path.join(directory, entry)
            if entry.startswith(".") or not os.path.isdir(path):
                continue
            if entry in self.classic:
                raise ValueError(f"model {entry!r} of {directory} is already served")
            config = None
            try:
                config = read_model_config(path)
                backend = backends.backend_of(config)
                create = backends.factory(backend)
                versions = versions_to_load(path, config)
            except backends.ModelConfigError as e:
                logger.error("model %s of %s cannot be loaded: %s", entry, directory, e)
                self.add(UnavailableModel(entry, "", str(e), config))
                continue
            for version in versions:
                source = backends.ModelSource(
                    name=entry,
                    version=version,
                    directory=path,
                    version_dir=os.path.join(path, version),
                    config=_copy(config),
                    # ModelRepository.infer is a coroutine function returning the stream; the
                    # Protocol declares it plain (see backends.RepositoryView).
                    repository=cast("backends.RepositoryView", self),
                )
                try:
                    model = create(source)
                    if model.name != entry or model.version != version:
                        raise backends.ModelConfigError(
                            f"backend {backend!r} built model {model.name!r} version {model.version!r} "
                            f"for {entry!r} version {version!r}"
                        )
                except Exception as e:  # noqa: BLE001 - a refusal or a backend's bug: the reason is listed
                    logger.error(
                        "model %s version %s of %s cannot be loaded: %s", entry, version, directory, e
                    )
                    model = UnavailableModel(entry, version, str(e) or type(e).__name__, config)
                self.add(model)

    # ---- lifecycle -------------------------------------------------------------------------
    def _all(self) -> list[ServedModel]:
        return [m for versions in self.classic.values() for m in versions.values()]

    def start_loading(self) -> None:
        """Load classic models in the background; ServerReady stays false until all are loaded."""
        for model in self._all():
            self._loads.append(
                asyncio.create_task(self._load(model), name=f"kserve-load-{model.name}-{model.version}")
            )

    async def _load(self, model: ServedModel) -> None:
        try:
            await model.load()
        except Exception:  # the model reports UNAVAILABLE with the reason; the server lives on
            logger.exception("loading model %s version %s failed", model.name, model.version)

    async def wait_loaded(self) -> None:
        await asyncio.gather(*self._loads)

    async def close(self) -> None:
        for task in self._loads:
            task.cancel()
        await asyncio.gather(*self._loads, return_exceptions=True)
        for model in self._all():
            await model.close()

    def ready(self) -> bool:
        """Server readiness (Triton's strict readiness): not draining, every classic model
        version loaded and every engine ready. A model listed UNAVAILABLE keeps it false.
        With `strict_readiness` False: not draining."""
        if self._draining():
            return False
        if not self.strict_readiness:
            return True
        return all(m.ready() for m in self._all()) and all(e.ready() for e in self.engines)

    # ---- lookup ----------------------------------------------------------------------------
    def models(self) -> list[ServedModel]:
        """Every model version held (classic ones in the order added, versions ascending), then the LLMs."""
        self._refresh_llm()
        classic = [
            versions[v] for versions in self.classic.values() for v in sorted(versions, key=version_key)
        ]
        return [*classic, *self._llm.values()]

    def versions(self, name: str) -> list[str]:
        """The versions held of model `name` (ascending; a stand-in without a version is not
        one); NOT_FOUND / UNAVAILABLE as `get`."""
        versions = self.classic.get(name)
        if versions is None:
            self.get(name)
            return [MODEL_VERSION]
        return sorted((v for v in versions if v), key=version_key)

    def _refresh_llm(self) -> None:
        # Engines may learn their cards only once started, so the table follows them.
        seen = set()
        for engine in self.engines:
            for card in engine.models():
                seen.add(card.id)
                if card.id in self.classic:
                    raise ValueError(f"model name {card.id!r} is served by an engine and as a classic model")
                current = self._llm.get(card.id)
                if current is None or current.card != card or current.engine is not engine:
                    self._llm[card.id] = self._llm_cls(engine, card, self.admission)
        for name in set(self._llm) - seen:
            del self._llm[name]

    def serves(self, name: str) -> bool:
        """Whether a model of this name is served now (the metrics' model label)."""
        if name in self.classic or name in self._llm:
            return True
        try:
            self._refresh_llm()
        except ValueError:  # a name clash: get() raises it to the caller, a label need not
            return False
        return name in self._llm

    def get(self, name: str, version: str = "") -> ServedModel:
        """The model version a request names: "" is the highest READY version (else the
        highest held); NOT_FOUND for an unknown name or version."""
        versions = self.classic.get(name)
        if versions is not None:
            if version:
                model = versions.get(version)
                if model is None and "" in versions:
                    return versions[""]  # the config failed: every version answers its reason
            else:
                ranked = sorted(versions.values(), key=lambda m: (m.ready(), version_key(m.version)))
                model = ranked[-1]
            if model is None:
                raise not_found(f"Request for unknown model: '{name}' version {version} is not found")
            return model
        self._refresh_llm()
        llm = self._llm.get(name)
        if llm is None:
            if not all(e.ready() for e in self.engines):
                # An engine still booting (or down) may be the one serving it: retry later.
                raise unavailable(f"model '{name}' is not available: engines are still loading")
            raise not_found(f"Request for unknown model: '{name}' is not found")
        if version not in ("", MODEL_VERSION):
            raise not_found(f"Request for unknown model: '{name}' version {version} is not found")
        return llm

    def get_ready(self, name: str, version: str = "") -> ServedModel:
        model = self.get(name, version)
        state, reason = model.state()
        if state != "READY":
            raise unavailable(
                f"model '{name}' is not ready ({state.lower()}{': ' + reason if reason else ''})"
            )
        return model

    async def infer(self, model: ServedModel, request: InferRequest) -> AsyncIterator[InferResponse]:
        """Admit and run `request` on `model`, keeping only the requested outputs; the request
        is recorded in the model's statistics once it ends."""
        if request.outputs is not None:
            model.check_outputs(request.outputs)
        model.check_batch(request.inputs)
        timing = RequestTiming(model.statistics)
        token = current_timing.set(timing)
        try:
            responses = await model.infer(request)
        except BaseException as e:
            if _failed(e, executed=timing.dispatched_ns is not None):
                _record_failure(timing, model, request)
            raise
        finally:
            current_timing.reset(token)
        responses = _timed(responses, timing, model, request)
        if request.outputs is None:
            return responses
        return _select(responses, request.outputs)

    def statistics(self, name: str = "", version: str = "") -> list[dict]:
        """Triton's `model_stats` entries (paved.kserve.statistics): every READY version of
        every model for name "", of model `name` for version "", else that version.
        INVALID_ARGUMENT, in Triton's words, for a model or version that is not READY."""
        if not name:
            if version:
                raise invalid_argument("model version was given without a model name")
            ready = [m for m in self.models() if m.ready()]
        else:
            try:
                held = [self.get(name, version)] if version else self._versions_of(name)
            except KServeError:
                held = []
            ready = [m for m in held if m.ready() and m.version]
            if not ready:
                raise invalid_argument(
                    f"requested model version is not available for model '{name}'"
                    if version and self.serves(name)
                    else f"requested model '{name}' is not available"
                )
        ordered = sorted(ready, key=lambda m: (m.name, version_key(m.version)))
        return [m.statistics.to_dict(m.name, m.version) for m in ordered]

    def _versions_of(self, name: str) -> list[ServedModel]:
        versions = self.classic.get(name)
        if versions is not None:
            return list(versions.values())
        return [self.get(name)]


# Refusals before a model runs a request (Triton counts none of them in its statistics).
_REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


def _failed(error: BaseException, *, executed: bool) -> bool:
    """Whether `error` from a model's infer counts as a failed request in its statistics: not a
    cancellation (never counted), and not a refusal unless a batcher already executed it."""
    if not isinstance(error, Exception) or _cancelled(error):
        return False
    if executed:
        return True
    return not (isinstance(error, KServeError) and error.code in _REFUSALS)


def _record_failure(timing: RequestTiming, model: ServedModel, request: InferRequest) -> None:
    duration = time.monotonic_ns() - timing.started_ns
    if timing.dispatched_ns is None:  # no batcher ran it: the request was the model's execution
        model.statistics.execution(batch_rows(model.max_batch_size, request.inputs), duration)
    model.statistics.failed(duration)


def _record_success(timing: RequestTiming, model: ServedModel, request: InferRequest) -> None:
    now = time.monotonic_ns()
    duration = now - timing.started_ns
    rows = batch_rows(model.max_batch_size, request.inputs)
    if timing.dispatched_ns is not None:
        model.statistics.succeeded(rows, duration, timing.queue_ns, timing.compute_ns(now))
    else:
        model.statistics.execution(rows, duration)
        model.statistics.succeeded(rows, duration, 0, duration)


def _timed(
    responses: AsyncIterator[InferResponse], timing: RequestTiming, model: ServedModel, request: InferRequest
) -> AsyncIterator[InferResponse]:
    """`responses`, recording the request when its final response arrives (or the stream
    ends without one) or when the stream fails (as `_failed` decides); a stream its reader
    closes early (a cancelled request) is not recorded."""

    async def timed():
        recorded = False
        try:
            async for response in responses:
                if response.final and not recorded:
                    recorded = True
                    _record_success(timing, model, request)
                yield response
        except Exception as e:
            if not recorded and _failed(e, executed=timing.dispatched_ns is not None):
                recorded = True
                _record_failure(timing, model, request)
            raise
        if not recorded:
            _record_success(timing, model, request)

    return Closing(timed(), responses.aclose if hasattr(responses, "aclose") else None)


def _cancelled(error: Exception) -> bool:
    return isinstance(error, KServeError) and error.code in (
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )


def _copy(config: model_config_pb2.ModelConfig) -> model_config_pb2.ModelConfig:
    # Each version gets its own config: a backend may fill in fields (auto-complete).
    out = model_config_pb2.ModelConfig()
    out.CopyFrom(config)
    return out


def _select(responses: AsyncIterator[InferResponse], names: list[str]) -> AsyncIterator[InferResponse]:
    async def select():
        async for response in responses:
            response.outputs = {n: v for n, v in response.outputs.items() if n in names}
            yield response

    return Closing(select(), responses.aclose if hasattr(responses, "aclose") else None)

"""The model repository behind both transports: the models a KServe server serves.

Two kinds exist (a `ServedModel` is defined in paved.kserve.model): engine-backed LLMs
(paved.kserve.llm, one per `ModelCard` of the engines given to the server) and classic models
loaded from a directory (paved.kserve.xgboost_model).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence

from paved.engine.protocol import Engine
from paved.engine.streams import Closing
from paved.kserve.errors import not_found, unavailable
from paved.kserve.llm import LlmModel

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

logger = logging.getLogger(__name__)


class ModelRepository:
    """Classic models owned by the server plus the models of the engines it fronts."""

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
        self.engines = list(engines)
        self.classic = {m.name: m for m in classic}
        if len(self.classic) != len(classic):
            raise ValueError("two classic models share a name")
        self._llm: dict[str, LlmModel] = {}
        self._loads: list[asyncio.Task] = []

    # ---- lifecycle -------------------------------------------------------------------------
    def start_loading(self) -> None:
        """Load classic models in the background; ServerReady stays false until all are loaded."""
        for model in self.classic.values():
            self._loads.append(asyncio.create_task(self._load(model), name=f"kserve-load-{model.name}"))

    async def _load(self, model: ServedModel) -> None:
        try:
            await model.load()
        except Exception:  # the model reports UNAVAILABLE with the reason; the server lives on
            logger.exception("loading model %s failed", model.name)

    async def wait_loaded(self) -> None:
        await asyncio.gather(*self._loads)

    async def close(self) -> None:
        for task in self._loads:
            task.cancel()
        await asyncio.gather(*self._loads, return_exceptions=True)
        for model in self.classic.values():
            await model.close()

    def ready(self) -> bool:
        """Server readiness: not draining, every classic model loaded and every engine ready."""
        if self._draining():
            return False
        return all(m.ready() for m in self.classic.values()) and all(e.ready() for e in self.engines)

    # ---- lookup ----------------------------------------------------------------------------
    def models(self) -> list[ServedModel]:
        self._refresh_llm()
        return [*self.classic.values(), *self._llm.values()]

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
        model = self.classic.get(name)
        if model is None:
            self._refresh_llm()
            model = self._llm.get(name)
        if model is None:
            if not all(e.ready() for e in self.engines):
                # An engine still booting (or down) may be the one serving it: retry later.
                raise unavailable(f"model '{name}' is not available: engines are still loading")
            raise not_found(f"Request for unknown model: '{name}' is not found")
        if version not in ("", MODEL_VERSION):
            raise not_found(f"Request for unknown model: '{name}' version {version} is not found")
        return model

    def get_ready(self, name: str, version: str = "") -> ServedModel:
        model = self.get(name, version)
        state, reason = model.state()
        if state != "READY":
            raise unavailable(
                f"model '{name}' is not ready ({state.lower()}{': ' + reason if reason else ''})"
            )
        return model

    async def infer(self, model: ServedModel, request: InferRequest) -> AsyncIterator[InferResponse]:
        """Admit and run `request` on `model`, keeping only the requested outputs."""
        if request.outputs is not None:
            model.check_outputs(request.outputs)
        responses = await model.infer(request)
        if request.outputs is None:
            return responses
        return _select(responses, request.outputs)


def _select(responses: AsyncIterator[InferResponse], names: list[str]) -> AsyncIterator[InferResponse]:
    async def select():
        async for response in responses:
            response.outputs = {n: v for n, v in response.outputs.items() if n in names}
            yield response

    return Closing(select(), responses.aclose if hasattr(responses, "aclose") else None)

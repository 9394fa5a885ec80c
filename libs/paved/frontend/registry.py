"""Which engine serves which model, whether everything is ready, and admission control.

Admission is counted in sequences (n choices x prompts), the unit an engine's batch is made
of, from the moment a request is accepted until its response ends. A full model answers
503 with Retry-After at once instead of queueing without bound: the client (or the load
balancer) can go elsewhere while this instance works through its backlog.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from paved.engine.protocol import (
    Engine,
    EngineOverloadedError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelCard,
    ModelNotFoundError,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUED_SEQUENCES = 1024
# What a request's sequences are, by the field that sets their number.
_WEIGHTS = {
    "n": "n x prompts",
    "prompt": "n x prompts",
    "input": "one per input",
    "candidates": "one per candidate",
}


@dataclass
class ServedModel:
    card: ModelCard
    engine: Engine
    max_queued_sequences: int
    queued_sequences: int = 0


class Ticket:
    """Admission for `weight` sequences; release exactly once when the response ends."""

    __slots__ = ("_model", "_weight")

    def __init__(self, model: ServedModel, weight: int):
        self._model: ServedModel | None = model
        self._weight = weight

    def release(self) -> None:
        if self._model is not None:
            self._model.queued_sequences -= self._weight
            self._model = None


class ModelRegistry:
    def __init__(self, engines: Sequence[Engine], max_queued_sequences: Mapping[str, int] | None = None):
        self.engines = list(engines)
        self._limits = dict(max_queued_sequences or {})
        self._models: dict[str, ServedModel] = {}
        self._started = False
        self.draining = False

    async def start(self) -> None:
        """Start engines one at a time: each boot saturates a core for tens of seconds."""
        for engine in self.engines:
            await engine.start()
            for card in engine.models():
                if card.id in self._models:
                    raise ValueError(f"model {card.id!r} is served by two engines")
                limit = self._limits.get(card.id, DEFAULT_MAX_QUEUED_SEQUENCES)
                self._models[card.id] = ServedModel(card, engine, limit)
        self._started = True

    async def stop(self) -> None:
        for engine in reversed(self.engines):
            try:
                await engine.stop()
            except Exception:
                logger.exception("stopping an engine failed")

    def ready(self) -> bool:
        return self._started and not self.draining and all(e.ready() for e in self.engines)

    def cards(self) -> list[ModelCard]:
        return [m.card for m in self._models.values()]

    def served(self) -> list[ServedModel]:
        return list(self._models.values())

    def get(self, model: str) -> ServedModel:
        served = self._models.get(model)
        if served is not None:
            if self.draining:
                raise EngineUnavailableError("the server is shutting down")
            return served
        if not self._started:
            raise EngineUnavailableError("models are still loading")
        raise ModelNotFoundError(
            f"the model {model!r} does not exist; GET /v1/models lists the served models"
        )

    def admit(self, served: ServedModel, weight: int, param: str = "n") -> Ticket:
        """`weight` sequences of one request (`param` names what the client would lower)."""
        if weight > served.max_queued_sequences:
            raise InvalidRequestError(
                f"this request needs {weight} sequences ({_WEIGHTS.get(param, param)}), more than model "
                f"{served.card.id!r} admits at once ({served.max_queued_sequences}); send fewer "
                "in one request",
                param=param,
            )
        if served.queued_sequences + weight > served.max_queued_sequences:
            raise EngineOverloadedError(
                f"model {served.card.id!r} is at capacity "
                f"({served.max_queued_sequences} sequences in flight); retry shortly",
                reason="queue_full",
            )
        served.queued_sequences += weight
        return Ticket(served, weight)

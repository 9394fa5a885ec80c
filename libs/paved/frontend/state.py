"""What the routes share: the model registry, metrics and server settings (app.state.paved)."""

from __future__ import annotations

from dataclasses import dataclass

from paved.frontend.metrics import FrontendMetrics
from paved.frontend.registry import ModelRegistry


@dataclass
class AppState:
    models: ModelRegistry
    metrics: FrontendMetrics

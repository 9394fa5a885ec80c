"""Per-model-version inference statistics, as Triton reports them (ModelStatistics over gRPC,
GET /v2/models[/{name}[/versions/{v}]]/stats over HTTP).

Who records what:
- paved.kserve.repository.ModelRepository.infer times every request it runs on a model (client
  requests, BLS calls and ensemble steps alike, as Triton counts them) and records it once it
  ends: `success` (its rows into `inference_count`) or `fail`. A request refused before it
  reached an execution (a wrong input, a decoupled model called unary, ...) is neither, as in
  Triton; nor is one its client cancelled.
- paved.kserve.batcher.DynamicBatcher, for the models it schedules (XGBoost, PyTorch, ONNX,
  python), records each execution (`execution_count`, `batch_stats` by batch rows with the
  execution's duration; failed executions included, as in Triton) and marks each request of
  it dispatched (its queue time: enqueued to dispatched) and its execution ended (its compute
  time: dispatched to then), through `current_timing`, which the repository sets around the
  model's `infer`.
- A model without a batcher (an LLM, an ensemble) runs each request as one execution: its
  compute time is the request's duration and its queue time 0.

What paved does not measure (reported with the request count and 0 ns, so the shape is
Triton's): compute_input and compute_output (tensors are decoded and encoded by the
transports), cache_hit / cache_miss (no response cache); `response_stats` (per-response
statistics of decoupled models) and `memory_usage` are empty.
"""

from __future__ import annotations

import contextvars
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += max(ns, 0)

    def to_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class _Batch:
    compute_infer: Duration = field(default_factory=Duration)


class ModelStatistics:
    """Cumulative counters of one model version since it was created. Thread-safe (the
    batcher records from its scheduler; requests end on the event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.last_inference_ms = 0
        self.inference_count = 0
        self.execution_count = 0
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_infer = Duration()
        self._batches: dict[int, _Batch] = {}

    def execution(self, batch_size: int, compute_ns: int) -> None:
        """One model execution of `batch_size` rows (failed ones too)."""
        with self._lock:
            self.execution_count += 1
            self._batches.setdefault(batch_size, _Batch()).compute_infer.add(compute_ns)

    def succeeded(self, rows: int, duration_ns: int, queue_ns: int, compute_ns: int) -> None:
        with self._lock:
            self.inference_count += rows
            self.success.add(duration_ns)
            self.queue.add(queue_ns)
            self.compute_infer.add(compute_ns)
            self.last_inference_ms = time.time_ns() // 1_000_000

    def failed(self, duration_ns: int) -> None:
        with self._lock:
            self.fail.add(duration_ns)
            self.last_inference_ms = time.time_ns() // 1_000_000

    def to_dict(self, name: str, version: str) -> dict[str, Any]:
        """One `model_stats` entry as Triton's HTTP endpoint writes it (every key, ints as numbers)."""
        with self._lock:
            # Unmeasured stages count the requests that passed them, at 0 ns.
            passed = Duration(self.success.count, 0).to_dict()
            inference = {
                "success": self.success.to_dict(),
                "fail": self.fail.to_dict(),
                "queue": self.queue.to_dict(),
                "compute_input": passed,
                "compute_infer": self.compute_infer.to_dict(),
                "compute_output": dict(passed),
                "cache_hit": Duration().to_dict(),
                "cache_miss": Duration().to_dict(),
            }
            batches = [
                {
                    "batch_size": size,
                    "compute_input": Duration(b.compute_infer.count, 0).to_dict(),
                    "compute_infer": b.compute_infer.to_dict(),
                    "compute_output": Duration(b.compute_infer.count, 0).to_dict(),
                }
                for size, b in sorted(self._batches.items())
            ]
            return {
                "name": name,
                "version": version,
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": inference,
                "response_stats": {},
                "batch_stats": batches,
                "memory_usage": [],
            }


@dataclass
class RequestTiming:
    """One request's path through a batcher (monotonic ns), filled in by the batcher that
    executes it. A request may end before its execution does (a python model's responses
    arrive while execute() still runs): its compute time then ends with the request."""

    statistics: ModelStatistics
    started_ns: int = field(default_factory=time.monotonic_ns)
    dispatched_ns: int | None = None
    queue_ns: int = 0
    executed_ns: int | None = None

    def dispatched(self, enqueued_ns: int, now_ns: int) -> None:
        self.dispatched_ns = now_ns
        self.queue_ns = max(now_ns - enqueued_ns, 0)

    def execution_ended(self, now_ns: int) -> None:
        self.executed_ns = now_ns

    def compute_ns(self, ended_ns: int) -> int:
        """Dispatch to the end of the execution (or of the request, if that came first)."""
        if self.dispatched_ns is None:
            return 0
        end = ended_ns if self.executed_ns is None else min(self.executed_ns, ended_ns)
        return max(end - self.dispatched_ns, 0)


# The request a model's `infer` is running for (set by the repository around it): a batcher
# reads it when the request is submitted. Tasks the model starts inherit it.
current_timing: contextvars.ContextVar[RequestTiming | None] = contextvars.ContextVar(
    "paved_kserve_request_timing", default=None
)

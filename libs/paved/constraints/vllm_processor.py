"""paved's constraint engine as a vLLM logits processor, for both of vLLM's model runners.

vLLM loads a processor into whichever model runner is active: the V1 runner (CPU, and GPU
without Triton or with a feature V2 lacks) and Model Runner V2 (GPU default in vLLM 0.33).
The two runners use different base classes and the V2 loader rejects V1 classes, so the
class derives from both interfaces and picks its bookkeeping from the constructor signature.
Requests opt in with `SamplingParams.extra_args["paved_constraint"] = spec` (see
`paved.constraints.spec`); all other rows are left untouched and cost nothing.

Two ways in, one instance: paved's engine passes `PavedLogitsProcessor` in
`logits_processors`, because under async scheduling (vLLM 0.33's GPU default) the V1 runner
replaces its `-1` output-token placeholders with the sampled ids only when
`logits_processors` is non-empty (`logitsprocs_need_output_token_ids =
bool(custom_logitsprocs)` in gpu_model_runner.py; entry-point plugins do not count). The
`vllm.logits_processors` entry point (for other vLLM clients: `vllm serve`, Triton's
backend) loads `PavedPluginLogitsProcessor`, which stands by whenever the engine also lists
paved's processor in `logits_processors`, so no row is masked twice.

Invariants the adapter keeps:
  * a row's State has consumed exactly the request's committed tokens before its mask is
    computed (see `tracking.TrackedRequest`), whatever chunked prefill or preemption did;
  * EOS is allowed only where the constraint accepts, and the budget (max_tokens, bounded by
    the model's context) is known to the State so output closes before it runs out;
  * bad specs fail in `validate_params` (HTTP 400 at admission), never inside the step;
  * nothing heavy runs on the step thread: specs are validated once per process
    (`spec.admit`, off the event loop) and trusted here; compiles run on a small pool in the
    worker process, started through `PavedWorkerExtension.paved_precompile` before the
    request is added (paved's VllmEngine waits for it, as vLLM's structured-output manager
    keeps a request waiting while its grammar compiles). A request whose spec was not
    precompiled (another client of the same vLLM) compiles at its first step.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TypeVar

import _paved_constraints as native
import numpy as np
import torch
from vllm.v1.sample.logits_processor.interface import BatchUpdate, MoveDirectionality
from vllm.v1.sample.logits_processor.interface import LogitsProcessor as V1LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor

from paved.constraints import spec as specs
from paved.constraints.background import background_executor
from paved.constraints.compiler import compile_spec
from paved.constraints.tracking import CompileCache, TrackedRequest, first_seen
from paved.constraints.vocab import token_bytes

logger = logging.getLogger(__name__)

LOGITS_PROCESSOR_FQCN = "paved.constraints.vllm_processor:PavedLogitsProcessor"
# What paved's dist-info registers in the `vllm.logits_processors` entry-point group.
PLUGIN_FQCN = "paved.constraints.vllm_processor:PavedPluginLogitsProcessor"
# vLLM resolves worker extensions by dotted name (module.Class), not module:Class.
WORKER_EXTENSION = "paved.constraints.vllm_processor.PavedWorkerExtension"
# Threads that split a step's rows; the engine core's own thread waits on them.
NUM_THREADS = int(os.environ.get("PAVED_CONSTRAINT_THREADS", "2"))
# One budget per engine for compiled automata and their mask caches (each cache is also
# capped natively at 64 MiB); least recently used constraints are dropped past it.
CACHE_BYTES = int(os.environ.get("PAVED_CONSTRAINT_CACHE_BYTES", str(1 << 30)))
CACHE_ENTRIES = 256
# Longest a test hook may hold compiles (paved_hold_compiles).
HOLD_LIMIT_S = 60.0
# Background compiles per engine; more would only compete with the step for two cores.
COMPILE_THREADS = 1


def _eos_ids(model_config, tokenizer) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for source in (model_config.hf_config, model_config.try_get_generation_config()):
        value = (
            source.get("eos_token_id") if isinstance(source, dict) else getattr(source, "eos_token_id", None)
        )
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return sorted(ids)


class _Engine:
    """Per-engine pieces: vocabulary, compile cache, batch masker (built on first use)."""

    def __init__(
        self, token_bytes_by_id: list[bytes], eos_ids: list[int], vocab_size: int, max_model_len: int
    ):
        self.vocab_size = vocab_size
        # A tokenizer may know ids the model has no embedding row for (tokens added after
        # training); vLLM's logits stop at vocab_size, so those ids are never sampled and are
        # left out here (the engine refuses a vocabulary larger than vocab_size).
        token_bytes_by_id = token_bytes_by_id[:vocab_size]
        eos_ids = [i for i in eos_ids if i < vocab_size]
        self.vocab = native.Vocab(token_bytes_by_id, eos_ids, vocab_size)
        self.max_model_len = max_model_len
        self.cache = CompileCache(self._compile, CACHE_ENTRIES, CACHE_BYTES)
        self.compiles = background_executor(COMPILE_THREADS, "paved-compile")
        # Tests hold compiles here to observe a request waiting for its automaton.
        self.compile_gate = threading.Event()
        self.compile_gate.set()
        self.masker = native.BatchMasker(vocab_size, NUM_THREADS)
        # Device-path host buffers, grown to the largest batch seen and reused every step.
        self._unique = np.empty((0, native.bitmask_words(vocab_size)), dtype=np.int32)
        self._row_index = np.empty(0, dtype=np.int32)

    @classmethod
    def from_vllm_config(cls, vllm_config) -> _Engine:
        from transformers import AutoTokenizer

        model_config = vllm_config.model_config
        tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer,
            revision=model_config.tokenizer_revision,
            trust_remote_code=model_config.trust_remote_code,
        )
        return cls(
            token_bytes(tokenizer),
            _eos_ids(model_config, tokenizer),
            model_config.get_vocab_size(),
            model_config.max_model_len,
        )

    def _compile(self, spec: dict):
        if not self.compile_gate.is_set():
            # Bounded: a test that forgets to release must not wedge the engine for good.
            self.compile_gate.wait(HOLD_LIMIT_S)
        return compile_spec(self.vocab, spec)

    def precompile(self, key: str, spec: dict | None) -> str:
        """Start (or look up) the compile of `spec` under `key`, without waiting: "ready",
        "pending", "unknown" (no such compile and no spec given) or "error: <why>"."""
        if spec is None:
            if self.cache.peek(key) is not None:
                return "ready"
            future = self.cache.inflight(key)
            if future is None:
                return "unknown"
        else:
            specs.check_shape(spec)
            future = self.cache.start(key, spec, self.compiles)
        if not future.done():
            return "pending"
        error = future.exception()
        return "ready" if error is None else f"error: {error}"

    def track(self, params, prompt_ids) -> TrackedRequest | None:
        extra = params.extra_args or {}
        spec = extra.get(specs.EXTRA_ARGS_KEY)
        if spec is None:
            return None
        # validate_params admitted this spec in the API process; only cheap invariants here.
        specs.check_shape(spec)
        key = extra.get(specs.KEY_ARGS_KEY)
        if not isinstance(key, str):
            key = specs.spec_key(spec)
        prompt_len = len(prompt_ids or ())
        budget = params.max_tokens
        context_left = self.max_model_len - prompt_len
        budget = context_left if budget is None else min(budget, context_left)
        orig_prompt_len, budget = first_seen(params, prompt_len, budget)
        prefix = list(prompt_ids[orig_prompt_len:]) if prompt_ids and prompt_len > orig_prompt_len else []
        constraint = self.cache.get(key, spec)
        try:
            state = constraint.new_state(budget)
        except ValueError as e:
            # The budget cannot fit even the shortest valid output. Enforce the constraint
            # without budget-awareness: the output is cut at max_tokens and reported as
            # finish_reason "length", as for any request that asks for too few tokens.
            logger.warning("paved constraint: %s; enforcing it without a budget", e)
            state = constraint.new_state(None)
        return TrackedRequest(state, prefix)

    def mask(self, logits: torch.Tensor, states: list) -> None:
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
            # In place through the shared buffer: no copy, GIL released inside.
            self.masker.apply(states, logits.numpy())
            return
        # Device path: each distinct mask crosses to the device once and is gathered there; a
        # batch of one schema's requests sits in few automaton states (bench: 64 rows, 17 masks).
        rows = logits.shape[0]
        if rows > len(self._row_index):
            self._unique = np.empty((rows, self._unique.shape[1]), dtype=np.int32)
            self._row_index = np.empty(rows, dtype=np.int32)
        unique, row_index = self._unique[:rows], self._row_index[:rows]
        n = self.masker.fill_unique_bitmask(states, unique, row_index)
        apply_bitmask_torch(logits, torch.from_numpy(unique[:n]), torch.from_numpy(row_index))

    def forced_eos_state(self):
        return self.cache.get("__eos_only__", {"type": "regex", "pattern": "()"}).new_state(None)


# Engines of this process (normally one), for the worker extension's RPCs.
_ENGINES: list[_Engine] = []
_ENGINES_LOCK = threading.Lock()


def _register(engine: _Engine) -> _Engine:
    with _ENGINES_LOCK:
        _ENGINES.append(engine)
    return engine


class PavedWorkerExtension:
    """Methods vLLM mixes into its worker (`worker_extension_cls`), reached with
    `AsyncLLM.collective_rpc`. Each returns at once: the engine core runs utility calls between
    steps, so nothing here may block it."""

    def paved_precompile(self, key: str, spec: dict | None = None) -> str:
        """Start compiling `spec` under `key` (spec None: report on `key`). See
        `_Engine.precompile` for the answers; "unavailable" before the processor's engine is
        built (the first constrained step builds it; paved's warm-up does that at start)."""
        with _ENGINES_LOCK:
            engines = list(_ENGINES)
        if not engines:
            return "unavailable"
        answers = [engine.precompile(key, spec) for engine in engines]
        for answer in answers:
            if answer != "ready":
                return answer
        return "ready"

    def paved_hold_compiles(self, hold: bool) -> bool:
        """Test hook: while held, compiles wait before starting (a request stays "pending")."""
        with _ENGINES_LOCK:
            engines = list(_ENGINES)
        for engine in engines:
            if hold:
                engine.compile_gate.clear()
            else:
                engine.compile_gate.set()
        return bool(engines)


def apply_bitmask_torch(logits: torch.Tensor, unique: torch.Tensor, row_index: torch.Tensor) -> None:
    """Device-side apply to [B, V] logits, in place, of host masks: int32 [U, W] distinct rows
    and int32 [B] row_index (row i's mask is unique[row_index[i]]). The host arrays may be
    reused once this returns: copies from pageable memory are staged before returning, and on
    the CPU the gather below makes a new tensor."""
    bits = unique.to(logits.device)[row_index.to(logits.device).long()]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[1]]
    logits.masked_fill_(~allowed, float("-inf"))


_V = TypeVar("_V")


def _swap(table: dict[int, _V], src: int, dst: int) -> None:
    a, b = table.pop(src, None), table.pop(dst, None)
    if a is not None:
        table[dst] = a
    if b is not None:
        table[src] = b


def _move(table: dict[int, _V], src: int, dst: int) -> None:
    moved = table.pop(src, None)
    table.pop(dst, None)
    if moved is not None:
        table[dst] = moved


class PavedLogitsProcessor(V1LogitsProcessor, V2LogitsProcessor):
    """Masks logits of requests that carry a paved constraint spec."""

    def __init__(self, vllm_config, *args):
        self._vllm_config = vllm_config
        self._engine: _Engine | None = None
        # V1: persistent-batch index -> tracked request; V2: request slot -> tracked request.
        self._rows: dict[int, TrackedRequest] = {}
        # V1 keeps the live output-token list of each row; V2 reads tokens from req_states.
        self._outputs: dict[int, list[int]] = {}
        self._req_states_or_none = args[0] if len(args) == 1 else None

    @classmethod
    def for_vocab(
        cls,
        token_bytes_by_id: list[bytes],
        eos_ids: list[int],
        max_model_len: int,
        req_states=None,
        vllm_config=None,
    ) -> PavedLogitsProcessor:
        """An instance over an explicit vocabulary instead of the model's tokenizer (tests,
        tools); constructed as vLLM constructs it, with `vllm_config` (may be None)."""
        # vLLM's two constructor shapes: V2 (config, req_states), V1 (config, device, pin).
        args = (req_states,) if req_states is not None else (None, False)
        proc = cls(vllm_config, *args)
        proc._engine = _Engine(token_bytes_by_id, eos_ids, len(token_bytes_by_id), max_model_len)
        return proc

    @property
    def _req_states(self):
        """Model Runner V2's request states, which only it passes to the constructor."""
        if self._req_states_or_none is None:
            raise RuntimeError("a Model Runner V2 hook ran on a processor built without req_states")
        return self._req_states_or_none

    def _get_engine(self) -> _Engine:
        if self._engine is None:
            self._engine = _register(_Engine.from_vllm_config(self._vllm_config))
        return self._engine

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """Runs in the API process, on its event loop: O(1) for a spec paved's own frontend
        admitted (the same object, see `spec.is_admitted`); anything else is validated here
        (memoized) and normalized in place, so the engine core only ever sees normal specs."""
        extra = sampling_params.extra_args or {}
        raw = extra.get(specs.EXTRA_ARGS_KEY)
        if raw is None:
            return
        if not specs.is_admitted(raw, extra.get(specs.KEY_ARGS_KEY)):
            spec, key = specs.admit(raw)
            extra[specs.EXTRA_ARGS_KEY] = spec
            extra[specs.KEY_ARGS_KEY] = key
        if sampling_params.ignore_eos:
            raise ValueError(f"{specs.EXTRA_ARGS_KEY} cannot be combined with ignore_eos")
        if getattr(sampling_params, "structured_outputs", None) is not None:
            raise ValueError(f"{specs.EXTRA_ARGS_KEY} cannot be combined with structured_outputs")

    def is_argmax_invariant(self) -> bool:
        return False

    # ---- V1 model runner -------------------------------------------------------------
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
            self._outputs.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            self._rows.pop(index, None)
            self._outputs.pop(index, None)
            tracked = self._admit(params, prompt_ids)
            if tracked is not None:
                self._rows[index] = tracked
                self._outputs[index] = output_ids
        for src, dst, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                _swap(self._rows, src, dst)
                _swap(self._outputs, src, dst)
            else:
                _move(self._rows, src, dst)
                _move(self._outputs, src, dst)

    def _admit(self, params, prompt_ids) -> TrackedRequest | None:
        if params is None or specs.EXTRA_ARGS_KEY not in (params.extra_args or {}):
            return None
        engine = self._get_engine()
        try:
            return engine.track(params, prompt_ids)
        except ValueError:
            # validate_params admitted it, so only an engine-side limit (e.g. the automaton
            # state cap for this vocabulary) lands here: end the request instead of the engine.
            logger.exception("paved constraint failed to compile; the request will end at once")
            return TrackedRequest(engine.forced_eos_state())

    def apply(self, logits: torch.Tensor, ctx=None) -> torch.Tensor:
        if not self._rows:
            return logits
        if ctx is not None:
            return self._apply_v2(logits, ctx)
        states: list = [None] * logits.shape[0]
        for index, tracked in self._rows.items():
            if index < len(states):
                tracked.sync(self._outputs[index])
                states[index] = self._row_state(tracked)
        self._get_engine().mask(logits, states)
        return logits

    def _row_state(self, tracked: TrackedRequest):
        return self._get_engine().forced_eos_state() if tracked.broken else tracked.state

    # ---- Model Runner V2 -------------------------------------------------------------
    def add_request(self, req_idx: int, sampling_params) -> bool:
        self._rows.pop(req_idx, None)
        rs = self._req_states
        prompt_len = int(rs.prompt_len.np[req_idx])
        # V2 keeps generated tokens after the prompt in all_token_ids even after preemption,
        # so nothing is folded into the prompt and no replay prefix is needed.
        tracked = self._admit(sampling_params, [0] * prompt_len)
        if tracked is None:
            return False
        self._rows[req_idx] = tracked
        return True

    def _apply_v2(self, logits: torch.Tensor, ctx) -> torch.Tensor:
        rs = self._req_states
        # One small host copy per step; the committed history itself stays on the device and
        # is read only when a row's tracked history diverges (resume, speculative rows).
        slots = ctx.expanded_idx_mapping.cpu().numpy()
        positions = ctx.pos.cpu().numpy()
        input_ids = ctx.input_ids.cpu().numpy()
        prompt_lens = rs.prompt_len.np
        states: list = [None] * logits.shape[0]
        for row, slot in enumerate(slots):
            tracked = self._rows.get(int(slot))
            if tracked is None:
                continue
            prompt_len = int(prompt_lens[slot])
            # Outputs visible to this row: tokens at positions prompt_len..pos, the last of
            # which is this row's input token (sampled last step). Prefill rows see none.
            visible = int(positions[row]) + 1 - prompt_len
            if not tracked.sync_tail(visible, int(input_ids[row])):
                end = prompt_len + max(visible, 0)
                tracked.sync(rs.all_token_ids.gpu[slot, prompt_len:end].tolist())
            states[row] = self._row_state(tracked)
        self._get_engine().mask(logits, states)
        return logits


def _names_paved_processor(vllm_config) -> bool:
    """Whether the engine's `logits_processors` (vLLM keeps them on the model config) load a
    paved processor other than the entry point's own class."""
    listed = getattr(getattr(vllm_config, "model_config", None), "logits_processors", None) or ()
    for entry in listed:
        if isinstance(entry, str):
            if entry == LOGITS_PROCESSOR_FQCN:
                return True
        elif (
            isinstance(entry, type)
            and issubclass(entry, PavedLogitsProcessor)
            and not issubclass(entry, PavedPluginLogitsProcessor)
        ):
            return True
    return False


class PavedPluginLogitsProcessor(PavedLogitsProcessor):
    """The class paved's `vllm.logits_processors` entry point registers.

    vLLM instantiates entry-point classes and `logits_processors` classes side by side. When
    the engine lists paved's processor in `logits_processors` (paved's VllmEngine always does,
    see the module docstring), this instance stands by: it admits no row and leaves logits
    alone. Otherwise (a vLLM client that only has the entry point) it is paved's processor.
    """

    def __init__(self, vllm_config, *args):
        super().__init__(vllm_config, *args)
        self._standby = _names_paved_processor(vllm_config)
        scheduler = getattr(vllm_config, "scheduler_config", None)
        if not self._standby and len(args) != 1 and getattr(scheduler, "async_scheduling", False):
            # V1 runner (V2 passes one argument, req_states) under async scheduling, loaded only
            # through the entry point: vLLM leaves -1 placeholders in the output lists, so each
            # step is masked from the state one token behind (see tracking.TrackedRequest.sync).
            logger.warning(
                "paved constraint: loaded only through the vllm.logits_processors entry point "
                "with async scheduling on the V1 model runner; constrained outputs may end "
                "early. Pass logits_processors=[%r] to the engine.",
                LOGITS_PROCESSOR_FQCN,
            )

    @property
    def standby(self) -> bool:
        return self._standby

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not self._standby:
            super().update_state(batch_update)

    def apply(self, logits: torch.Tensor, ctx=None) -> torch.Tensor:
        return logits if self._standby else super().apply(logits, ctx)

    def add_request(self, req_idx: int, sampling_params) -> bool:
        return False if self._standby else super().add_request(req_idx, sampling_params)

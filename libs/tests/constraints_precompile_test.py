"""Compiles before the batch: the worker extension's answers, and VllmEngine waiting on them.

The processor side runs over an explicit byte vocabulary (no model); the engine side drives
`VllmEngine._precompile` with a scripted stand-in for AsyncLLM's `collective_rpc`, so each
answer ("pending", "ready", "error: ...", "unknown", "unavailable") and the compile-time budget
are shown without booting vLLM.
"""

from __future__ import annotations

import asyncio

import pytest
from vllm import SamplingParams

from paved.constraints import spec as specs
from paved.constraints import vllm_processor
from paved.constraints.vllm_processor import PavedLogitsProcessor, PavedWorkerExtension
from paved.engine.protocol import Constraint, EngineUnavailableError, InvalidRequestError
from paved.engine.vllm_config import VllmModelConfig
from paved.engine.vllm_engine import VllmEngine

TOKENS = [bytes([b]) for b in range(256)] + [b""]
EOS = 256


@pytest.fixture
def extension(monkeypatch):
    monkeypatch.setattr(vllm_processor, "_ENGINES", [])
    proc = PavedLogitsProcessor.for_vocab(TOKENS, [EOS], max_model_len=64)
    vllm_processor._register(proc._engine)
    yield PavedWorkerExtension(), proc
    proc._engine.compile_gate.set()


def test_answers_follow_the_compile(extension):
    ext, proc = extension
    spec, key = specs.admit({"type": "regex", "pattern": "pre(compiled)+"})
    assert ext.paved_precompile(key) == "unknown"  # never sent
    assert ext.paved_hold_compiles(True)
    assert ext.paved_precompile(key, spec) == "pending"
    assert ext.paved_precompile(key) == "pending"
    ext.paved_hold_compiles(False)
    proc._engine.cache.inflight(key).result(10)
    assert ext.paved_precompile(key) == "ready"
    # The request that follows finds its automaton: no compile on the step.
    params = SamplingParams(max_tokens=20, extra_args={specs.EXTRA_ARGS_KEY: spec, specs.KEY_ARGS_KEY: key})
    PavedLogitsProcessor.validate_params(params)
    compiled = proc._engine.cache.peek(key)
    assert proc._engine.track(params, [1, 2]).state is not None
    assert proc._engine.cache.peek(key) is compiled and len(proc._engine.cache) == 1


def test_a_failed_compile_is_a_final_error_answer(extension):
    ext, proc = extension
    # A spec of the right shape that does not compile (the engine core trusts admission for
    # the rest; here the RPC is called directly to show the answer).
    bad = {"type": "regex", "pattern": "("}
    assert ext.paved_hold_compiles(True)
    assert ext.paved_precompile("bad", bad) == "pending"
    future = proc._engine.cache.inflight("bad")
    ext.paved_hold_compiles(False)
    future.exception(30)
    # Final: the poll (no spec) and a resend both get the error, no compile runs again.
    assert ext.paved_precompile("bad").startswith("error: ")
    assert ext.paved_precompile("bad", bad).startswith("error: ")
    assert proc._engine.cache.inflight("bad").exception() is not None
    assert proc._engine.cache.peek("bad") is None
    with pytest.raises(ValueError, match="normalized"):
        ext.paved_precompile("k", {"type": "regex"})


def test_no_engine_yet_is_unavailable(monkeypatch):
    monkeypatch.setattr(vllm_processor, "_ENGINES", [])
    assert PavedWorkerExtension().paved_precompile("k", None) == "unavailable"


class ScriptedLLM:
    """collective_rpc answering from a script (the last answer repeats)."""

    def __init__(self, *answers: str):
        self.answers = list(answers)
        self.calls: list[tuple] = []

    async def collective_rpc(self, method, args=()):
        self.calls.append((method, *args))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return [answer]


def _engine(budget_s: float = 30.0) -> VllmEngine:
    return VllmEngine(VllmModelConfig(name="m", path="/nonexistent", constraint_compile_budget_s=budget_s))


CONSTRAINT = Constraint("paved", "paved", {"type": "regex", "pattern": "x"}, "k" * 64)


def test_precompile_asks_by_key_sends_the_spec_once_then_polls():
    llm = ScriptedLLM("unknown", "pending", "pending", "ready")
    asyncio.run(_engine()._precompile(llm, CONSTRAINT))
    key = "k" * 64
    assert llm.calls[0] == ("paved_precompile", key, None)
    assert llm.calls[1] == ("paved_precompile", key, CONSTRAINT.value)
    assert llm.calls[2:] == [("paved_precompile", key, None)] * 2


def test_a_spec_the_worker_has_is_never_sent_again():
    llm = ScriptedLLM("ready")
    asyncio.run(_engine()._precompile(llm, CONSTRAINT))
    assert llm.calls == [("paved_precompile", "k" * 64, None)]


def test_precompile_resends_an_evicted_spec_and_accepts_unavailable():
    llm = ScriptedLLM("unknown", "pending", "unknown", "ready")
    asyncio.run(_engine()._precompile(llm, CONSTRAINT))
    assert [c[2] is not None for c in llm.calls] == [False, True, False, True]
    llm = ScriptedLLM("unavailable")
    asyncio.run(_engine()._precompile(llm, CONSTRAINT))  # compiles at its first step instead
    assert len(llm.calls) == 1


def test_precompile_errors_and_budget_are_400s():
    with pytest.raises(InvalidRequestError, match="cannot be enforced for this model: too big"):
        asyncio.run(_engine()._precompile(ScriptedLLM("error: too big"), CONSTRAINT))
    with pytest.raises(InvalidRequestError, match="compile time budget") as info:
        asyncio.run(_engine(budget_s=0.2)._precompile(ScriptedLLM("pending"), CONSTRAINT))
    assert info.value.code == "constraint_compile_budget"


def test_precompile_on_a_dead_engine_is_unavailable():
    from vllm.v1.engine.exceptions import EngineDeadError

    class Dead:
        async def collective_rpc(self, method, args=()):
            raise EngineDeadError()

    with pytest.raises(EngineUnavailableError):
        asyncio.run(_engine()._precompile(Dead(), CONSTRAINT))


def test_precompile_without_the_worker_extension_leaves_the_compile_to_the_step():
    class NoExtension:
        async def collective_rpc(self, method, args=()):
            raise RuntimeError("Call to collective_rpc method failed: no attribute 'paved_precompile'")

    asyncio.run(_engine()._precompile(NoExtension(), CONSTRAINT))  # returns; no 500

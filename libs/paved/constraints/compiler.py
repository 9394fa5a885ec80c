"""Normalized paved specs compiled against one vocabulary, for decoders outside vLLM.

vLLM's logits processor keeps its own per-engine pieces; a decoder that samples in Python
(paved's simulated engine, tools) needs the same two steps: a cached compile of each spec and a
budget-aware State, with the processor's fallback when the budget is too small.
"""

from __future__ import annotations

import json
import logging

from paved.constraints import Constraint, State, Vocab
from paved.constraints import spec as specs
from paved.constraints.tracking import CompileCache

logger = logging.getLogger(__name__)


def compile_spec(vocab: Vocab, spec: dict) -> Constraint:
    """The automaton of a spec already normalized by `spec.validate_spec`."""
    if spec["type"] == "json_schema":
        return Constraint.json_schema(vocab, json.dumps(spec["schema"]), spec["whitespace"])
    if spec["type"] == "regex":
        return Constraint.regex(vocab, spec["pattern"])
    return Constraint.choice(vocab, spec["items"], spec["k"], spec["separator"], spec["distinct"])


class SpecCompiler:
    """Compiled constraints of one vocabulary, shared by every request with the same spec."""

    def __init__(self, vocab: Vocab, capacity: int = 64):
        self.vocab = vocab
        self._cache = CompileCache(lambda spec: compile_spec(vocab, spec), capacity)

    def constraint(self, spec: dict) -> Constraint:
        """The compiled spec (cached); raises ValueError when this vocabulary cannot hold it."""
        return self._cache.get(specs.spec_key(spec), spec)

    def new_state(self, spec: dict, budget: int | None) -> State:
        """A State for one output of at most `budget` tokens (None: unbounded).

        Raises ValueError when the spec cannot be compiled for this vocabulary. A budget too
        small for the shortest valid output gives an unbounded State, as in vLLM: the output is
        then cut at max_tokens and ends with finish_reason "length".
        """
        constraint = self.constraint(spec)
        try:
            return constraint.new_state(budget)
        except ValueError as e:
            logger.warning("paved constraint: %s; enforcing it without a budget", e)
            return constraint.new_state(None)

"""Constrained decoding: paved's C++ constraint engine (`_paved_constraints`) and its vLLM adapter.

The engine's API, re-exported here: `Vocab` (token id -> bytes, EOS ids), `Constraint`
(an immutable compiled regex / JSON Schema / catalogue automaton, shared across requests),
`State` (one request's position, budget-aware), `BatchMasker` (a batch's masks on a thread pool,
GIL released), and the admission checks `check_regex` / `check_json_schema`.
"""

from _paved_constraints import (
    BatchMasker,
    Constraint,
    State,
    Vocab,
    apply_bitmask,
    bitmask_words,
    check_json_schema,
    check_regex,
)

__all__ = [
    "BatchMasker",
    "Constraint",
    "State",
    "Vocab",
    "apply_bitmask",
    "bitmask_words",
    "check_json_schema",
    "check_regex",
]

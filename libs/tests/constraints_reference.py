"""The brute-force reference the constraint-adapter tests check paved's masks against: a small
vocabulary (every byte, some multi-byte tokens, EOS), three constraints and every complete
output of each, so "is token t allowed after history h with this budget" is decided by
enumeration, including the budget rule: after t there must remain room for the shortest
completion (in bytes, each byte a token) plus EOS.
"""

import itertools

import numpy as np
import torch
from vllm import SamplingParams

from paved.constraints.spec import EXTRA_ARGS_KEY
from paved.constraints.vllm_processor import PavedLogitsProcessor

TITLES = ["Dune", "Hyperion", "Foundation", "Solaris"]
MULTI = [b"Du", b"ne", b"Hyper", b"ion", b"Found", b"ation", b"Sol", b"aris", b", ", b"Dune, ", b"xyz"]
TOKENS = [bytes([b]) for b in range(256)] + MULTI
EOS = len(TOKENS)
TOKENS.append(b"")  # EOS has no bytes
VOCAB = len(TOKENS)
MAX_MODEL_LEN = 4096

SPECS = {
    "pair": {"type": "choice", "items": TITLES, "k": 2, "separator": ", ", "distinct": True},
    "one": {"type": "choice", "items": TITLES, "k": 1},
    "regex": {"type": "regex", "pattern": "(ab|cd)x?y"},
}
COMPLETIONS = {
    "pair": [f"{a}, {b}".encode() for a, b in itertools.permutations(TITLES, 2)],
    "one": [t.encode() for t in TITLES],
    "regex": [a + x + b"y" for a in (b"ab", b"cd") for x in (b"", b"x")],
}


def _shortest_rest(kind: str) -> dict[bytes, int]:
    """Every prefix of a complete output -> bytes still needed to complete it (at least)."""
    rest: dict[bytes, int] = {}
    for s in COMPLETIONS[kind]:
        for i in range(len(s) + 1):
            rest[s[:i]] = min(rest.get(s[:i], len(s)), len(s) - i)
    return rest


SHORTEST_REST = {kind: _shortest_rest(kind) for kind in COMPLETIONS}


def reference_allowed(kind: str, history: list[int], max_tokens: int | None) -> set[int]:
    if history and history[-1] == EOS:
        return {EOS}
    text = b"".join(TOKENS[t] for t in history)
    rest, n = SHORTEST_REST[kind], len(history)
    allowed = {EOS} if rest.get(text) == 0 else set()
    for t in range(EOS):
        left = rest.get(text + TOKENS[t])
        if left is not None and (max_tokens is None or left + 1 <= max_tokens - (n + 1)):
            allowed.add(t)
    return allowed


def params(kind: str, max_tokens: int) -> SamplingParams:
    p = SamplingParams(max_tokens=max_tokens, extra_args={EXTRA_ARGS_KEY: SPECS[kind]})
    # vLLM's input processor runs this on every request before the engine core sees it; it
    # normalizes the spec in place, and the engine core trusts that.
    PavedLogitsProcessor.validate_params(p)
    return p


class Request:
    def __init__(self, kind: str, max_tokens: int, prompt: list[int]):
        self.kind, self.max_tokens = kind, max_tokens
        self.params = params(kind, max_tokens)
        self.prompt = prompt
        self.outputs: list[int] = []  # what vLLM's live list holds
        self.history: list[int] = []  # every token generated, across preemptions

    def done(self) -> bool:
        return (bool(self.history) and self.history[-1] == EOS) or len(self.history) >= self.max_tokens


def allowed_rows(logits: torch.Tensor) -> list[set[int]]:
    return [set(np.flatnonzero(np.isfinite(row)).tolist()) for row in logits.numpy()]


class HostTensor:
    """Stands in for Model Runner V2's UvaBackedTensor: the host view, `.np`."""

    def __init__(self, array: np.ndarray):
        self.np = array


class DeviceTensor:
    """Stands in for Model Runner V2's StagedWriteTensor: the device view, `.gpu`."""

    def __init__(self, tensor: torch.Tensor):
        self.gpu = tensor

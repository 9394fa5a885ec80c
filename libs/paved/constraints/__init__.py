"""Constrained decoding: paved's C++ constraint engine and its vLLM adapters."""

from _paved_constraints import apply_bitmask, bitmask_words

__all__ = ["apply_bitmask", "bitmask_words"]

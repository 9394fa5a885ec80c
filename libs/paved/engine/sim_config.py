"""The simulated engine's settings, `sim://MODEL?...`, apart from the engine itself.

Callers that only check or carry such a URI (the control plane validates a deployment's engine
when it is created) need its rules without the engine, its native constraint engine and its
tokenizers. `paved.engine.sim` documents the options and re-exports these names.
"""

from __future__ import annotations

import math
import os
import urllib.parse
from dataclasses import dataclass
from typing import Any

SCHEME = "sim"


@dataclass
class SimConfig:
    """What `sim://MODEL?...` sets; see the module docstring."""

    model: str
    tokens_per_s: float = 50.0
    max_num_seqs: int = 8
    kv_tokens: int | None = None  # None: max_model_len x max_num_seqs
    max_waiting: int = 128
    max_model_len: int = 2048
    tokenizer: str | None = None  # a Hugging Face tokenizer directory; None: built-in bytes
    max_logprobs: int = 20
    constraint_backends: tuple[str, ...] = ("paved",)
    fail_after: int | None = None  # fault injection: refuse (503) every request after N
    start_delay_s: float = 0.0  # how long `start` takes (a model's load time, for cold starts)

    def __post_init__(self):
        if self.kv_tokens is None:
            self.kv_tokens = self.max_model_len * self.max_num_seqs
        self.validate()

    @property
    def kv_capacity(self) -> int:
        """kv_tokens with its default applied."""
        return self.max_model_len * self.max_num_seqs if self.kv_tokens is None else self.kv_tokens

    def validate(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("the sim engine needs a model name (sim://MODEL)")
        if not isinstance(self.tokens_per_s, int | float) or not 0 <= self.tokens_per_s < math.inf:
            raise ValueError(f"tokens_per_s must be a finite number >= 0, got {self.tokens_per_s!r}")
        for key in ("max_num_seqs", "kv_tokens", "max_waiting", "max_model_len", "max_logprobs"):
            value = getattr(self, key)
            low = 0 if key in ("max_waiting", "max_logprobs") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
        if (
            not isinstance(self.start_delay_s, int | float)
            or isinstance(self.start_delay_s, bool)
            or not 0 <= self.start_delay_s <= 3600
        ):
            raise ValueError(f"start_delay_s must be a number in [0, 3600], got {self.start_delay_s!r}")
        if self.fail_after is not None and (
            isinstance(self.fail_after, bool) or not isinstance(self.fail_after, int) or self.fail_after < 0
        ):
            raise ValueError(f"fail_after must be an integer >= 0, got {self.fail_after!r}")
        if self.kv_capacity < self.max_model_len:
            raise ValueError(
                f"kv_tokens ({self.kv_capacity}) must hold at least one full context "
                f"(max_model_len {self.max_model_len})"
            )
        if set(self.constraint_backends) - {"paved"}:
            raise ValueError(
                f"the sim engine enforces only the 'paved' backend, got {self.constraint_backends}"
            )
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise ValueError(f"tokenizer {self.tokenizer!r} is not a directory")

    _URI_INTS = ("max_num_seqs", "kv_tokens", "max_waiting", "max_model_len", "max_logprobs", "fail_after")

    @classmethod
    def from_uri(cls, uri: str, model: str | None = None, check_files: bool = True) -> SimConfig:
        """`sim://MODEL?options`; `model`, when given, must agree with MODEL (or MODEL is empty).
        check_files=False: every rule but the tokenizer directory's existence (a control plane
        checks a URI for replicas that may run on other machines)."""
        parts = urllib.parse.urlsplit(uri)
        if parts.scheme != SCHEME or parts.path not in ("", "/") or parts.fragment:
            raise ValueError(f"expected {SCHEME}://MODEL[?options], got {uri!r}")
        name = urllib.parse.unquote(parts.netloc)
        if model and name and model != name:
            raise ValueError(f"{uri!r} names model {name!r}, but the model is configured as {model!r}")
        name = name or model or ""
        try:
            query = urllib.parse.parse_qs(
                parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)
            )
        except ValueError as e:
            raise ValueError(f"malformed query in {uri!r}: {e}") from None
        known = {"tokens_per_s", "start_delay_s", "tokenizer", *cls._URI_INTS}
        unknown = sorted(set(query) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} in {uri!r}; known: {sorted(known)}")
        options: dict[str, Any] = {}
        for key, values in query.items():
            value = values[-1]
            if key in cls._URI_INTS:
                try:
                    options[key] = int(value)
                except ValueError:
                    raise ValueError(f"{key} must be an integer, got {value!r} in {uri!r}") from None
            elif key in ("tokens_per_s", "start_delay_s"):
                try:
                    options[key] = float(value)
                except ValueError:
                    raise ValueError(f"{key} must be a number, got {value!r} in {uri!r}") from None
            else:
                options[key] = value
        tokenizer = options.pop("tokenizer", None) if not check_files else None
        config = cls(model=name, **options)
        if tokenizer is not None:
            if not tokenizer:
                raise ValueError(f"tokenizer must name a directory, got an empty value in {uri!r}")
            config.tokenizer = tokenizer
        return config

"""JSON request bodies with a nesting bound.

`json.loads` recurses in C and raises RecursionError (not a ValueError) past about a thousand
levels, and a body that parses just under that limit can still overflow whatever walks it
next (canonical cache keys, template variables, pydantic models). So every paved server that
parses a body itself refuses nesting past MAX_DEPTH, as a client error: no OpenAI or KServe
request needs it (paved's constraint engine takes schemas nested 10 subschemas deep, about 30
JSON levels with the request around them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

MAX_DEPTH = 128
# A \uD800-\uDFFF escape: only a body holding one can hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class JSONBodyError(ValueError):
    """A body that is not acceptable JSON; the message completes "the request body is ..."."""


class JSONTooDeepError(JSONBodyError):
    """Valid JSON (as far as read) nested past the bound: refused even where a caller would take
    text that is not JSON as plain text (a tool call's arguments)."""


class JSONSurrogateError(JSONBodyError):
    """Valid JSON whose strings hold a lone UTF-16 surrogate ("\\ud800"): no UTF-8 text (a
    database's, an engine's, a response body's) can hold it."""


def parse_json(raw: bytes | str, max_depth: int = MAX_DEPTH, *, unicode_text: bool = False) -> Any:
    """The parsed body, or JSONBodyError (not valid UTF-8, not valid JSON, or JSONTooDeepError:
    nested too deep). Never RecursionError, however deep the text nests. `unicode_text`: also
    JSONSurrogateError when a string (a key included) holds a lone surrogate, for a body whose
    text is stored or sent on as UTF-8: bytes must then be strict UTF-8 (json.loads would take
    a surrogate's own UTF-8 bytes, and UTF-16 or UTF-32 text, without a word)."""
    try:
        if unicode_text and isinstance(raw, bytes):
            value = json.loads(raw.decode("utf-8"))
        else:
            value = json.loads(raw)
    except UnicodeDecodeError:
        raise JSONBodyError("not valid UTF-8") from None
    except RecursionError:
        raise JSONTooDeepError(f"nested more than {max_depth} levels deep") from None
    except ValueError as e:
        raise JSONBodyError(f"not valid JSON: {e}") from None
    if _brackets(raw) > max_depth and _deeper_than(value, max_depth):
        raise JSONTooDeepError(f"nested more than {max_depth} levels deep")
    # Text (not bytes) may hold a surrogate itself, not only its escape: always checked.
    if unicode_text and (isinstance(raw, str) or _SURROGATE_ESCAPE.search(raw)):
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise JSONSurrogateError(
                "not valid Unicode: it contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape)"
            ) from None
    return value


def _brackets(raw: bytes | str) -> int:
    # A C-speed upper bound on the depth: most bodies have fewer brackets than the bound and
    # skip the walk.
    if isinstance(raw, str):
        return raw.count("[") + raw.count("{")
    return raw.count(b"[") + raw.count(b"{")


def _deeper_than(value: Any, limit: int) -> bool:
    # Iterative, so that the check itself cannot overflow the stack.
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False

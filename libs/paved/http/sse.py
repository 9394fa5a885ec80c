"""Server-sent events' JSON on one line, whatever its strings hold.

JSON escapes control characters but leaves U+0085, U+2028 and U+2029 raw, and line-based SSE
clients (httpx's `aiter_lines`, anything built on str.splitlines) end a line at each: a
generated string holding one would cut its `data:` event in two. The frontend's streams and the
gateway's cache replays write their events through here.
"""

from __future__ import annotations

import json
from typing import Any


def line_safe(json_text: str) -> str:
    """`json_text` with U+0085, U+2028 and U+2029 escaped (the same JSON value); other text
    stays UTF-8 (no 6-byte escapes for it)."""
    # An ASCII-only text cannot hold them: str.replace returns at once.
    return json_text.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def event_json(value: Any) -> str:
    """Compact JSON of `value` that every SSE client reads as one line."""
    return line_safe(json.dumps(value, separators=(",", ":"), ensure_ascii=False))

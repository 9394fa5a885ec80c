"""Reading an HTTP body of bounded size from aiohttp.

aiohttp's `StreamReader.read(n)` answers what has arrived so far (often one 64 KiB chunk), not
n bytes: one call cut bigger bodies short (a /metrics page with the gauges near its end, a
routes table of thousands of backends) and the rest read as missing or invalid.
"""

from __future__ import annotations

from typing import Protocol


class _Readable(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


async def read_at_most(content: _Readable, limit: int) -> bytes:
    """The body, up to `limit` bytes (read `bound + 1` to tell a body over `bound` apart)."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await content.read(limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)

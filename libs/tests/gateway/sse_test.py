"""Server-sent events through the gateway main stay one `data:` line each, whatever the
generated text holds: structured answers with U+0085, U+2028 and U+2029 inside their strings
(which line-based clients such as httpx's aiter_lines split on) and plain text with every other
line break, relayed from a paved frontend and replayed from the exact cache (issue 22, item 9)."""

from __future__ import annotations

import asyncio
import json
import secrets

import httpx
from fake_engine import TEXT_SCHEMA, FakeEngine, line_break_json, line_break_reply, line_break_text
from gateway_proc import GatewayProcess, write_routes
from servers import serve_engines, sse_data

STREAMS = 20


async def _one(client: httpx.AsyncClient, i: int) -> list[str]:
    """Stream the i-th structured and plain answers; their x-paved-cache headers."""
    structured = {
        "model": "fake",
        "messages": [{"role": "user", "content": f"json {i}"}],
        "max_tokens": 120,
        "temperature": 0,
        "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TEXT_SCHEMA}},
    }
    headers, events = await sse_data(client, "/v1/chat/completions", structured)
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert json.loads(text) == json.loads(line_break_json(i))
    cache = [headers.get("x-paved-cache", "")]
    plain = {"model": "fake", "prompt": f"text {i}", "max_tokens": 60, "temperature": 0, "stream": True}
    headers, events = await sse_data(client, "/v1/completions", plain)
    assert "".join(c["text"] for e in events for c in e["choices"]) == line_break_text(i)
    return [*cache, headers.get("x-paved-cache", "")]


def test_every_event_parses_relayed_and_replayed_from_the_cache(tmp_path):
    with serve_engines(FakeEngine(reply=line_break_reply)) as url:
        routes = write_routes(
            tmp_path / "routes.json",
            [{"alias": "fake", "cache": {"exact": True}, "backends": [{"url": url, "version": "v1"}]}],
        )
        gateway = GatewayProcess(routes, admin_key="adm-" + secrets.token_hex(16), state_dir=tmp_path)
        try:
            gateway.tenant("acme", models=["fake"])
            key = gateway.key("acme", name="sse")

            async def burst() -> list[str]:
                auth = {"Authorization": f"Bearer {key}"}
                async with httpx.AsyncClient(base_url=gateway.url, headers=auth, timeout=60) as client:
                    caches = await asyncio.gather(*(_one(client, i) for i in range(STREAMS)))
                return [c for pair in caches for c in pair]

            relayed = asyncio.run(burst())
            assert set(relayed) == {"miss"}, relayed
            replayed = asyncio.run(burst())  # the same requests: answered from the exact cache
            assert set(replayed) == {"exact"}, replayed
        finally:
            gateway.stop()

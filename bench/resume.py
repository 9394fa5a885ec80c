"""Resumable streams across gateway replicas (issue 26).

Two gateway mains share one SQLite state file and one Redis (`--log db`: the database only, no
Redis), with resumable streams, in front of one paved frontend on the simulated engine.
`--streams` (200) chat streams run at once on replica A; half are cut at a random event and
resumed on replica B with Last-Event-ID. Each resumed stream's ids must continue exactly where
the cut left them:

- resume_gap_events: ids missing between the cut and the resume (goal 0);
- duplicate_events: ids received twice (goal 0);
- resume_latency_p99_ms: from sending the resume request to its first event;
- streaming_overhead_ratio: tokens/s of `--streams` uncut streams through a gateway with
  resumable streams on, over the same through a gateway with them off (--no-resumable-streams)
  (goal >= 0.9): `--rounds` rounds, on and off alternating in each (so a machine's load drifting
  meets both alike), totals over totals; `round_ratios` lists each round's and
  `median_round_ratio` is their median (robust to one round another process's burst hit).
- gateway_cpu_ms_per_1k_tokens_resumable / _plain: the serving gateway process's CPU time
  (user + system) per 1,000 tokens over those rounds: the per-event cost itself, which a busy
  shared machine disturbs far less than it does tokens/s.

`--json`: the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from gateway_proc import GatewayProcess, write_routes
from servers import ServerProcess

from paved.testing.redis import redis_server


async def _read_events(response: httpx.Response, cut_at: int | None) -> list[bytes]:
    events: list[bytes] = []
    buffer = b""
    async for chunk in response.aiter_bytes():
        buffer += chunk
        *whole, buffer = buffer.split(b"\n\n")
        events.extend(e for e in whole if e)
        if cut_at is not None and len(events) >= cut_at:
            return events[:cut_at]
    return events


def _id(event: bytes) -> int:
    return int(event.split(b"\n", 1)[0].removeprefix(b"id: "))


async def _one(a: str, b: str, key: str, body: dict, cut: bool, rng: random.Random) -> dict:
    auth = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=120) as client:
        cut_at = rng.randint(2, body["max_tokens"] - 2) if cut else None
        async with client.stream("POST", f"{a}/v1/chat/completions", json=body, headers=auth) as r:
            if r.status_code != 200:
                raise RuntimeError(f"stream refused: {r.status_code} {(await r.aread())[:300]!r}")
            stream_id = r.headers["x-paved-stream-id"]
            first = await _read_events(r, cut_at)
        if not cut:
            return {"ids": [_id(e) for e in first], "latency": None}
        headers = {**auth, "last-event-id": str(_id(first[-1]))}
        sent = time.perf_counter()
        latency = None
        rest: list[bytes] = []
        async with client.stream("GET", f"{b}/v1/chat/completions/streams/{stream_id}", headers=headers) as r:
            buffer = b""
            async for chunk in r.aiter_bytes():
                if latency is None:
                    latency = time.perf_counter() - sent
                buffer += chunk
                *whole, buffer = buffer.split(b"\n\n")
                rest.extend(e for e in whole if e)
        return {"ids": [_id(e) for e in first + rest], "latency": latency}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _throughput(url: str, key: str, body: dict, n: int) -> tuple[float, int]:
    """(tokens/s, tokens) of `n` concurrent streams."""
    auth = {"authorization": f"Bearer {key}"}

    async def one(client: httpx.AsyncClient) -> int:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=auth) as r:
            events = await _read_events(r, None)
        return sum(1 for e in events if b'"content":"' in e)

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n + 10)) as client:
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(client) for _ in range(n)))
        return sum(tokens) / (time.perf_counter() - started), sum(tokens)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tokens-per-s", type=int, default=100, help="the simulated engine's rate per stream")
    p.add_argument("--seed", type=int, default=26)
    p.add_argument("--rounds", type=int, default=5, help="on/off throughput rounds (default 5)")
    p.add_argument(
        "--log", choices=("redis", "db"), default="redis", help="where the event log is (default redis)"
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not 2 <= args.streams <= 2000 or not 8 <= args.max_tokens <= 4096 or not 1 <= args.rounds <= 20:
        p.error("--streams in [2, 2000], --max-tokens in [8, 4096], --rounds in [1, 20]")
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="resume-bench-"))
    engine = f"sim://tiny?tokens_per_s={args.tokens_per_s}&max_num_seqs={args.streams * 2}"
    frontend = ServerProcess("--engine", engine, ready_timeout_s=120)
    gateways: list[GatewayProcess] = []
    try:
        with redis_server() as redis:
            backends = [{"url": frontend.url, "version": "v1"}]
            routes = write_routes(tmp / "routes.json", [{"alias": "tiny", "backends": backends}])
            admin = "adm-" + secrets.token_hex(16)
            common = ["--state", f"sqlite:///{tmp / 'gw.sqlite'}", "--queue-size", "0"]
            if args.log == "redis":
                common += ["--redis", redis]
            for resumable in (True, True, False):
                extra = ["--resumable-streams"] if resumable else ["--no-resumable-streams"]
                gateways.append(GatewayProcess(routes, *common, *extra, admin_key=admin, state_dir=tmp))
            a, b, off = gateways
            a.tenant("bench", models=["tiny"])
            key = a.key("bench")
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "count"}],
                "max_tokens": args.max_tokens,
                "stream": True,
            }

            async def run() -> dict:
                cuts = [i % 2 == 0 for i in range(args.streams)]
                results = await asyncio.gather(*(_one(a.url, b.url, key, body, c, rng) for c in cuts))
                gaps = dups = 0
                latencies = []
                for result, cut in zip(results, cuts, strict=True):
                    ids = result["ids"]
                    dups += len(ids) - len(set(ids))
                    gaps += (max(ids) + 1 - len(set(ids))) if ids else 0
                    if cut and result["latency"] is not None:
                        latencies.append(result["latency"] * 1000)
                latencies.sort()
                p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else None
                on: list[float] = []
                plain: list[float] = []
                cpu = {"on": [0.0, 0], "off": [0.0, 0]}  # CPU seconds, tokens
                for i in range(args.rounds):
                    # Which goes first alternates too: a round's second run finds a warmer machine.
                    for which in ("on", "off") if i % 2 == 0 else ("off", "on"):
                        gw, into = (a, on) if which == "on" else (off, plain)
                        cpu_before = _cpu_s(gw.proc.pid)
                        rate, tokens = await _throughput(gw.url, key, body, args.streams)
                        cpu[which][0] += _cpu_s(gw.proc.pid) - cpu_before
                        cpu[which][1] += tokens
                        into.append(rate)
                return {
                    "streams": args.streams,
                    "cut_and_resumed": sum(cuts),
                    "resume_gap_events": gaps,
                    "duplicate_events": dups,
                    "resume_latency_p99_ms": round(p99, 2) if p99 is not None else None,
                    "log": args.log,
                    "tokens_per_s_resumable": round(sum(on) / len(on), 1),
                    "tokens_per_s_plain": round(sum(plain) / len(plain), 1),
                    "streaming_overhead_ratio": round(sum(on) / sum(plain), 3),
                    "round_ratios": [round(x / y, 3) for x, y in zip(on, plain, strict=True)],
                    "median_round_ratio": round(
                        statistics.median(x / y for x, y in zip(on, plain, strict=True)), 3
                    ),
                    "gateway_cpu_ms_per_1k_tokens_resumable": round(cpu["on"][0] * 1e6 / cpu["on"][1], 1),
                    "gateway_cpu_ms_per_1k_tokens_plain": round(cpu["off"][0] * 1e6 / cpu["off"][1], 1),
                }

            try:
                result = asyncio.run(run())
            except Exception:
                print(a.tail(40), file=sys.stderr)
                raise
    finally:
        for gw in gateways:
            gw.stop()
        frontend.terminate()
    for k, v in result.items():
        print(f"{k}: {v}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0 if result["resume_gap_events"] == 0 and result["duplicate_events"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

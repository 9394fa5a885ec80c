"""Fairness of the gateway's flow control: a light tenant's latency while another floods.

    tools/bazel run //bench:fairness -- [--phase-s S] [--flood-factor F] [--json]

The fleet: two paved frontends (`python -m paved.frontend.server`) on the simulated engine,
each decoding `--max-num-seqs` (4) sequences at `--tokens-per-s` (40) tokens/s per sequence with
no engine waiting queue (`max_waiting=0`: a request that cannot start at once is a 503
"overloaded"), behind one paved gateway (`python -m paved.gateway.server`, SQLite state, routes
`least_outstanding` over both, its flow-control queue at `--queue-size` (512) per model and
`--queue-max-wait` (30 s), equal tenant weights). Every request is a non-streaming completion of
`--max-tokens` (20) tokens (ignore_eos): ~0.5 s of decoding, so the fleet serves about
2 x 4 / 0.5 = 16 requests/s.

Phases, `--phase-s` (30) seconds each, in this order:
  1. capacity: 2 x max_num_seqs closed-loop clients of tenant `flood` (exactly the fleet's
     slots): completions per second is the fleet's measured capacity C;
  2. alone: tenant `light` sends 1 request/s (open loop), nothing else;
  3. flood: tenant `flood` sends `--flood-factor` (10) x C requests/s (open loop, no retries)
     while `light` sends 1 request/s as in phase 2.
The first `--warmup-s` (3) seconds of phases 2 and 3 are not measured (requests sent then still
run, their results are dropped); a request still unanswered at the phase's end is cancelled (the
client leaves) and counts as not completed.

Reported: the light tenant's p50/p99 latency alone and under the flood (client's full request
time), `light_p99_ratio` = p99(flood) / p99(alone) (goal <= 1.5) and `light_refused` (any
non-200 answer of the light tenant under the flood; goal 0); the flood's completions per second
over the measured part of phase 3 and `flood_goodput_ratio` = that / C (goal >= 0.9; the light
tenant's own 1 request/s is C's remainder: `fleet_goodput_ratio` counts both), the rate the
flood was actually sent at (`flood_sent_rps`: the client shares the machine) and its refusals by
code (`queue_full`, `queue_timeout`). With --json the last stdout line is
one JSON object with every key.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import uvloop

from bench.gateway import BenchError, started

MODEL = "tiny"
REQUEST_TIMEOUT_S = 120.0


def _p(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


class Client:
    """One tenant's requests to the gateway; every result is (sent, done, status, code)."""

    def __init__(self, session: aiohttp.ClientSession, url: str, key: str, max_tokens: int):
        self.session = session
        self.url = url + "/v1/completions"
        self.headers = {"Authorization": f"Bearer {key}"}
        self.body = json.dumps(
            {"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True}
        ).encode()
        self.results: list[tuple[float, float, int, str]] = []

    async def one(self) -> None:
        sent = time.monotonic()
        headers = {**self.headers, "content-type": "application/json"}
        async with self.session.post(self.url, data=self.body, headers=headers) as r:
            data = await r.read()
        code = ""
        if r.status != 200:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                code = json.loads(data)["error"]["code"] or ""
        self.results.append((sent, time.monotonic(), r.status, code))

    async def open_loop(self, rate: float, until: float) -> None:
        """Send at `rate` per second until `until`, each request on its own; at `until`, cancel
        the ones still unanswered."""
        tasks: set[asyncio.Task[None]] = set()
        start = time.monotonic()
        n = 0
        while True:
            due = start + n / rate
            if due >= until:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            task = asyncio.create_task(self.one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            n += 1
        await asyncio.sleep(max(0.0, until - time.monotonic()))
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def closed_loop(self, clients: int, until: float) -> None:
        async def worker() -> None:
            while time.monotonic() < until:
                await self.one()

        await asyncio.gather(*(worker() for _ in range(clients)))


async def _admin(session: aiohttp.ClientSession, url: str, admin_key: str, path: str, body: dict) -> dict:
    async with session.post(url + path, json=body, headers={"Authorization": f"Bearer {admin_key}"}) as r:
        if r.status not in (200, 201):
            raise BenchError(f"POST {path}: {r.status} {await r.text()}")
        return await r.json()


async def _run(args: argparse.Namespace, url: str, admin_key: str) -> dict:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        keys = {}
        for tenant in ("flood", "light"):
            await _admin(session, url, admin_key, "/admin/v1/tenants", {"name": tenant})
            keys[tenant] = (await _admin(session, url, admin_key, "/admin/v1/keys", {"tenant": tenant}))[
                "key"
            ]
        slots = 2 * args.max_num_seqs

        # 1. capacity
        cap = Client(session, url, keys["flood"], args.max_tokens)
        t0 = time.monotonic()
        await cap.closed_loop(slots, t0 + args.phase_s)
        measured = [r for r in cap.results if r[0] >= t0 + args.warmup_s and r[2] == 200]
        capacity = len(measured) / (args.phase_s - args.warmup_s)
        if not capacity:
            raise BenchError("the capacity phase completed no request")
        print(f"  capacity: {capacity:.2f} requests/s", file=sys.stderr, flush=True)

        # 2. light alone
        alone = Client(session, url, keys["light"], args.max_tokens)
        t0 = time.monotonic()
        await alone.open_loop(args.light_rate, t0 + args.phase_s)
        alone_ok = [r for r in alone.results if r[0] >= t0 + args.warmup_s]

        # 3. light under the flood
        flood = Client(session, url, keys["flood"], args.max_tokens)
        light = Client(session, url, keys["light"], args.max_tokens)
        t0 = time.monotonic()
        end = t0 + args.phase_s
        await asyncio.gather(
            flood.open_loop(args.flood_factor * capacity, end), light.open_loop(args.light_rate, end)
        )
        measured_from = t0 + args.warmup_s
        light_ok = [r for r in light.results if r[0] >= measured_from]
        flood_done = [r for r in flood.results if r[2] == 200 and measured_from <= r[1] <= end]
        light_done = [r for r in light.results if r[2] == 200 and measured_from <= r[1] <= end]
        flood_codes = Counter(r[3] or str(r[2]) for r in flood.results if r[2] != 200)

    alone_lat = [r[1] - r[0] for r in alone_ok if r[2] == 200]
    light_lat = [r[1] - r[0] for r in light_ok if r[2] == 200]
    a99, l99 = _p(alone_lat, 99), _p(light_lat, 99)
    measured_s = args.phase_s - args.warmup_s
    goodput = len(flood_done) / measured_s
    return {
        "capacity_rps": round(capacity, 3),
        "light_alone_p50_s": _round(_p(alone_lat, 50)),
        "light_alone_p99_s": _round(a99),
        "light_flood_p50_s": _round(_p(light_lat, 50)),
        "light_flood_p99_s": _round(l99),
        "light_p99_ratio": _round(l99 / a99 if a99 and l99 else None),
        "light_requests_alone": len(alone_ok),
        "light_requests_flood": len(light_ok),
        "light_refused_alone": sum(r[2] != 200 for r in alone_ok),
        "light_refused": sum(r[2] != 200 for r in light_ok),
        "flood_offered_rps": round(args.flood_factor * capacity, 3),
        # What the load generator managed to send (on a busy machine it may fall short of the
        # offered rate; it is the load the gateway saw).
        "flood_sent_rps": round(len(flood.results) / args.phase_s, 3),
        "flood_goodput_rps": round(goodput, 3),
        "flood_goodput_ratio": _round(goodput / capacity),
        "fleet_goodput_ratio": _round((len(flood_done) + len(light_done)) / measured_s / capacity),
        "flood_refused_by_code": dict(sorted(flood_codes.items())),
        "phase_s": args.phase_s,
        "warmup_s": args.warmup_s,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-s", type=float, default=30.0, help="seconds per phase (default 30)")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="unmeasured start of each phase")
    parser.add_argument("--flood-factor", type=float, default=10.0, help="flood rate / capacity (10)")
    parser.add_argument("--light-rate", type=float, default=1.0, help="light tenant's requests/s (1)")
    parser.add_argument("--tokens-per-s", type=float, default=40.0, help="sim decode speed per sequence")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="sequences per sim replica (4)")
    parser.add_argument("--max-tokens", type=int, default=20, help="tokens per request (20)")
    parser.add_argument("--queue-size", type=int, default=512, help="the gateway's --queue-size")
    parser.add_argument("--queue-max-wait", type=float, default=30.0, help="the gateway's --queue-max-wait")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line last")
    args = parser.parse_args()
    if not 0 < args.warmup_s < args.phase_s:
        parser.error("need 0 < --warmup-s < --phase-s")
    engine = (
        f"sim://{MODEL}?tokens_per_s={args.tokens_per_s:g}&max_num_seqs={args.max_num_seqs}&max_waiting=0"
    )
    admin_key = "adm-" + secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        replicas = []
        for i in range(2):
            argv = [sys.executable, "-m", "paved.frontend.server", "--engine", engine, "--port", "0"]
            proc = stack.enter_context(
                started(f"sim-{i}", argv, ready=rb"serving .* on (http://127\.0\.0\.1:\d+)")
            )
            replicas.append(proc.wait_url())
        routes = work / "routes.json"
        routes.write_text(
            json.dumps(
                {
                    "models": [
                        {
                            "alias": MODEL,
                            "strategy": "least_outstanding",
                            "backends": [{"url": u, "version": "v1"} for u in replicas],
                        }
                    ]
                }
            )
        )
        argv = [
            sys.executable, "-m", "paved.gateway.server", "--routes", str(routes), "--port", "0",
            "--state", f"sqlite:///{work / 'gateway.sqlite'}", "--log-level", "warning",
            "--queue-size", str(args.queue_size), "--queue-max-wait", str(args.queue_max_wait),
        ]  # fmt: skip
        gateway = stack.enter_context(
            started(
                "gateway",
                argv,
                ready=rb"^serving gateway on (http://127\.0\.0\.1:\d+)",
                env={**os.environ, "PAVED_ADMIN_KEY": admin_key},
            )
        )
        url = gateway.wait_url()
        results = uvloop.run(_run(args, url, admin_key))
    for k, v in results.items():
        print(f"{k:>24}: {v}")
    if args.json:
        print(json.dumps(results, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"fairness: {e}", file=sys.stderr)
        sys.exit(1)

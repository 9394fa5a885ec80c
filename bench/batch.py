"""The gateway's batch path (OpenAI Files + Batches) against its interactive path, on one fleet.

    tools/bazel run //bench:batch -- [--batch-lines N] [--phase-s S] [--json]

The fleet: two paved frontends on the simulated engine (`--max-num-seqs` (32) sequences each at
`--tokens-per-s` (40) tokens/s per sequence) behind two paved gateway replicas sharing one SQLite
state file and one files directory, each running batch lines `--batch-concurrency` (26) at a time
with a `--batch-lease` (3 s) lease. Every request is a chat completion of `--max-tokens` (16)
tokens (ignore_eos) at temperature 0.

Phases, in order:
  1. client alone: one client sends `--throughput-lines` (2000) lines itself through gateway B
     as fast as the fleet takes them (as many in flight as the fleet has sequence slots):
     client lines/s;
  2. batch alone: the same number of (other) lines as one batch: lines/s from create to
     completed; `batch_throughput_ratio` = 2 / 1 (goal >= 0.8);
  3. interactive alone: `--rate` (5) requests/s, open loop, for `--phase-s` (30) s on gateway B:
     p50 / p99 latency;
  4. interactive with a batch: a `--batch-lines` (5000) batch starts, then the same open loop for
     `--phase-s` s; `interactive_p99_ratio` = p99(4) / p99(3) (goal <= 1.2);
  5. kill: gateway A is SIGKILLed while that batch is still running; B finishes it;
     `lost_or_duplicated_lines` = custom_ids missing from or repeated in the output and error
     files (goal 0).
With --json the last stdout line is one JSON object with every key.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from bench.gateway import BenchError, started

MODEL = "tiny"


def _p(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _body(tag: str, i: int, max_tokens: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"item {tag} {i}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


class Gateway:
    def __init__(self, session: aiohttp.ClientSession, url: str, key: str):
        self.session, self.url = session, url
        self.headers = {"Authorization": f"Bearer {key}"}

    async def chat(self, body: dict) -> tuple[int, float]:
        sent = time.monotonic()
        async with self.session.post(self.url + "/v1/chat/completions", json=body, headers=self.headers) as r:
            await r.read()
        return r.status, time.monotonic() - sent

    async def submit(self, tag: str, n: int, max_tokens: int) -> str:
        data = b"".join(
            json.dumps(
                {
                    "custom_id": f"{tag}-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": _body(tag, i, max_tokens),
                }
            ).encode()
            + b"\n"
            for i in range(n)
        )
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", data, filename=f"{tag}.jsonl", content_type="application/jsonl")
        async with self.session.post(self.url + "/v1/files", data=form, headers=self.headers) as r:
            if r.status != 200:
                raise BenchError(f"upload: {r.status} {await r.text()}")
            file_id = (await r.json())["id"]
        req = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        async with self.session.post(self.url + "/v1/batches", json=req, headers=self.headers) as r:
            if r.status != 200:
                raise BenchError(f"batch create: {r.status} {await r.text()}")
            return (await r.json())["id"]

    async def batch(self, batch_id: str) -> dict:
        async with self.session.get(self.url + f"/v1/batches/{batch_id}", headers=self.headers) as r:
            if r.status != 200:
                raise BenchError(f"batch get: {r.status} {await r.text()}")
            return await r.json()

    async def until_completed(self, batch_id: str, lines: int) -> None:
        deadline = time.monotonic() + 300
        while (await self.batch(batch_id))["request_counts"]["completed"] < lines:
            if time.monotonic() > deadline:
                raise BenchError(f"batch {batch_id}: fewer than {lines} lines done after 300 s")
            await asyncio.sleep(0.1)

    async def wait(self, batch_id: str, timeout_s: float, poll_s: float = 0.25) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            b = await self.batch(batch_id)
            if b["status"] in ("completed", "failed", "expired", "cancelled"):
                return b
            await asyncio.sleep(poll_s)
        raise BenchError(f"batch {batch_id} not finished after {timeout_s:.0f} s")

    async def lines(self, file_id: str | None) -> list[dict]:
        if file_id is None:
            return []
        async with self.session.get(self.url + f"/v1/files/{file_id}/content", headers=self.headers) as r:
            return [json.loads(x) for x in (await r.read()).splitlines() if x.strip()]


async def open_loop(
    gw: Gateway, rate: float, duration_s: float, max_tokens: int, tag: str
) -> list[tuple[int, float]]:
    tasks = []
    start = time.monotonic()
    n = 0
    while start + n / rate < start + duration_s:
        await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
        tasks.append(asyncio.create_task(gw.chat(_body(tag, n, max_tokens))))
        n += 1
    return list(await asyncio.gather(*tasks))


async def closed_loop(
    gw: Gateway, n: int, concurrency: int, max_tokens: int, tag: str
) -> tuple[float, Counter]:
    todo = iter(range(n))
    statuses: Counter = Counter()

    async def worker() -> None:
        for i in todo:
            status, _ = await gw.chat(_body(tag, i, max_tokens))
            statuses[status] += 1

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.monotonic() - t0), statuses


async def _run(args: argparse.Namespace, urls: list[str], key: str, kill_a) -> dict:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        b = Gateway(session, urls[1], key)
        slots = 2 * args.max_num_seqs
        # Warm both paths (connections, tokenizer-less counting, first SQL).
        await closed_loop(b, 20, 4, args.max_tokens, "warm")

        client_rate, client_status = await closed_loop(
            b, args.throughput_lines, slots, args.max_tokens, "client"
        )
        print(f"  client alone: {client_rate:.1f} lines/s {dict(client_status)}", file=sys.stderr, flush=True)

        t0 = time.monotonic()
        alone_id = await b.submit("alone", args.throughput_lines, args.max_tokens)
        # Polled finely: the poll's granularity is part of the measured time.
        alone = await b.wait(alone_id, 900, poll_s=0.05)
        batch_rate = alone["request_counts"]["completed"] / (time.monotonic() - t0)
        print(f"  batch alone: {batch_rate:.1f} lines/s ({alone['status']})", file=sys.stderr, flush=True)

        base = await open_loop(b, args.rate, args.phase_s, args.max_tokens, "base")
        big_id = await b.submit("big", args.batch_lines, args.max_tokens)
        # Let the runners reach their steady state before measuring.
        await b.until_completed(big_id, 2 * slots)
        loaded = await open_loop(b, args.rate, args.phase_s, args.max_tokens, "loaded")
        progress = (await b.batch(big_id))["request_counts"]
        if progress["completed"] + progress["failed"] >= args.batch_lines:
            raise BenchError("the batch finished before the kill: raise --batch-lines")
        kill_a()
        print(
            f"  killed gateway A at {progress['completed']}/{args.batch_lines}", file=sys.stderr, flush=True
        )
        big = await b.wait(big_id, 1800)
        out = await b.lines(big["output_file_id"]) + await b.lines(big["error_file_id"])
        seen = Counter(x["custom_id"] for x in out)
        expected = {f"big-{i}" for i in range(args.batch_lines)}
        lost = len(expected - set(seen))
        duplicated = sum(n - 1 for n in seen.values() if n > 1) + len(set(seen) - expected)

    base_lat = [t for s, t in base if s == 200]
    loaded_lat = [t for s, t in loaded if s == 200]
    b99, l99 = _p(base_lat, 99), _p(loaded_lat, 99)
    return {
        "interactive_rate_rps": args.rate,
        "interactive_alone_p50_s": _r(_p(base_lat, 50)),
        "interactive_alone_p99_s": _r(b99),
        "interactive_batch_p50_s": _r(_p(loaded_lat, 50)),
        "interactive_batch_p99_s": _r(l99),
        "interactive_p99_ratio": _r(l99 / b99 if b99 and l99 else None),
        "interactive_refused": sum(s != 200 for s, _ in base + loaded),
        "client_lines_per_s": _r(client_rate),
        "batch_lines_per_s": _r(batch_rate),
        "batch_throughput_ratio": _r(batch_rate / client_rate),
        "batch_status": big["status"],
        "batch_failed": big["request_counts"]["failed"],
        "lost_or_duplicated_lines": lost + duplicated,
        "lost_lines": lost,
        "duplicated_lines": duplicated,
        "batch_lines": args.batch_lines,
        "throughput_lines": args.throughput_lines,
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-lines", type=int, default=5000, help="lines of the batch under load (5000)")
    parser.add_argument("--throughput-lines", type=int, default=2000, help="lines of phases 1 and 2 (2000)")
    parser.add_argument("--phase-s", type=float, default=30.0, help="seconds of each interactive phase (30)")
    parser.add_argument("--rate", type=float, default=5.0, help="interactive requests/s (5)")
    parser.add_argument("--tokens-per-s", type=float, default=40.0, help="sim decode speed per sequence (40)")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="sequences per sim replica (32)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per request (16)")
    parser.add_argument(
        "--batch-concurrency", type=int, default=26, help="each gateway's --batch-concurrency"
    )
    parser.add_argument("--batch-lease", type=float, default=3.0, help="each gateway's --batch-lease")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line last")
    args = parser.parse_args()
    if min(args.batch_lines, args.throughput_lines, args.max_num_seqs, args.batch_concurrency) < 1:
        parser.error("counts must be at least 1")
    engine = f"sim://{MODEL}?tokens_per_s={args.tokens_per_s:g}&max_num_seqs={args.max_num_seqs}"
    admin_key = "adm-" + secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp, contextlib.ExitStack() as stack:
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
                {"models": [{"alias": MODEL, "backends": [{"url": u, "version": "v1"} for u in replicas]}]}
            )
        )
        key_path = work / "key"
        gateways = []
        for tag in ("a", "b"):
            argv = [
                sys.executable, "-m", "paved.gateway.server", "--routes", str(routes), "--port", "0",
                "--state", f"sqlite:///{work / 'gateway.sqlite'}", "--files-dir", str(work / "files"),
                "--batch-concurrency", str(args.batch_concurrency), "--batch-lease", str(args.batch_lease),
                "--log-level", "warning",
            ]  # fmt: skip
            if tag == "a":
                argv += ["--bootstrap-tenant", "bench", "--bootstrap-key-file", str(key_path)]
            env = {**os.environ, "PAVED_ADMIN_KEY": admin_key}
            proc = stack.enter_context(
                started(
                    f"gateway-{tag}", argv, ready=rb"^serving gateway on (http://127\.0\.0\.1:\d+)", env=env
                )
            )
            gateways.append(proc)
        urls = [g.wait_url() for g in gateways]
        key = key_path.read_text().strip()

        def kill_a() -> None:
            gateways[0].proc.send_signal(signal.SIGKILL)
            gateways[0].proc.wait()

        results = asyncio.run(_run(args, urls, key, kill_a))
    for k, v in results.items():
        print(f"{k}: {v}", file=sys.stderr)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A burst of structured-output requests: paved vs vLLM's own OpenAI server, then through the gateway.

    tools/bazel run //bench:burst -- [--part all|instance|gateway] [--requests N] [--json]

Workload: `--requests` (300) streaming chat requests sent at once, every one carrying the same
small `response_format` json_schema (a batch of items scored against one schema: the most
common structured-output workload), `max_tokens` 48, temperature 0.7. Each request counts as:

  * completed: HTTP 200 and the stream ended with `data: [DONE]` (whatever its text);
  * valid:     completed, and its text parses as JSON and has the schema's required keys;
  * refused:   an HTTP 429 / 503 (or an error event in the stream);
  * failed:    anything else (another status, a reset or timeout).

Part `instance`: one server at a time on //models/tiny with the engine flags of
//bench:frontend, each with its own defaults for queues (paved: `--max-queued-sequences` left
at its default). The burst is sent twice per server: `cold` (the schema never seen) and `warm`
(again at once). `completion_ratio_vs_vllm` = paved's completed / vLLM's completed over both
bursts (goal >= 1.0); `refused` = paved's refusals over both bursts (goal 0).

Part `gateway`: two paved frontends (the same flags) behind one paved gateway (SQLite state,
`least_outstanding` routes, its defaults for the flow-control queue), the same two bursts;
`refused_via_gateway` counts refusals (goal 0 while the gateway's queue has room).

With --json the last stdout line is one JSON object with every key. Every process runs in its own
session on 127.0.0.1 and is stopped however the bench ends; every wait is bounded.
"""

from paved.engine import vllm_env

vllm_env.apply_defaults()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import aiohttp  # noqa: E402

from bench.frontend import ENGINE_FLAGS, Server, _free_port  # noqa: E402
from bench.gateway import start_gateway, started  # noqa: E402
from paved.runfiles import tiny_model_dir  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["good", "bad", "neutral"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["label", "score"],
    "additionalProperties": False,
}
MAX_TOKENS = 48
REQUEST_TIMEOUT_S = 900


def _body(i: int) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"Rate item {i} of the catalogue."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.7,
        "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "rating", "schema": SCHEMA}},
    }


async def one(session: aiohttp.ClientSession, url: str, i: int, headers: dict[str, str]) -> str:
    try:
        async with session.post(url + "/v1/chat/completions", json=_body(i), headers=headers) as response:
            if response.status in (429, 503):
                return "refused"
            if response.status != 200:
                return "failed"
            text, done = [], False
            async for raw in response.content:
                line = raw.strip()
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "refused"
                    for choice in event.get("choices") or []:
                        text.append((choice.get("delta") or {}).get("content") or "")
            if not done:
                return "failed"
            try:
                value = json.loads("".join(text))
            except ValueError:
                return "invalid"
            ok = isinstance(value, dict) and set(SCHEMA["required"]) <= set(value)
            return "valid" if ok else "invalid"
    except (TimeoutError, aiohttp.ClientError):
        return "failed"


async def burst(url: str, n: int, headers: dict[str, str] | None = None) -> dict[str, int]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        outcomes = await asyncio.gather(*(one(session, url, i, headers or {}) for i in range(n)))
    counts = {k: outcomes.count(k) for k in ("valid", "invalid", "refused", "failed")}
    counts["completed"] = counts["valid"] + counts["invalid"]
    return counts


def _paved_argv(model: str) -> list[str]:
    common = ["--model", model, "--served-model-name", "tiny", *ENGINE_FLAGS]
    return [sys.executable, "-m", "paved.frontend.server", *common, "--port", "0", "--log-level", "warning"]


async def _ready(server: Server) -> None:
    async with aiohttp.ClientSession() as session:
        await server.wait_ready(session, "/health/ready" if server.name == "paved" else "/health")


def _two_bursts(url: str, n: int, headers: dict[str, str] | None = None) -> dict[str, dict[str, int]]:
    return {phase: asyncio.run(burst(url, n, headers)) for phase in ("cold", "warm")}


def run_instance(args: argparse.Namespace) -> dict:
    model = str(tiny_model_dir())
    results: dict[str, dict[str, dict[str, int]]] = {}
    for name in ("paved", "vllm"):
        if name == "paved":
            server = Server("paved", _paved_argv(model))
        else:
            port = _free_port()
            argv = [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model,
                "--served-model-name",
                "tiny",
                *ENGINE_FLAGS,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--disable-uvicorn-access-log",
            ]
            server = Server("vllm", argv, url=f"http://127.0.0.1:{port}")
        try:
            asyncio.run(_ready(server))
            t0 = time.perf_counter()
            results[name] = _two_bursts(server.url, args.requests)
            print(
                f"  {name}: {results[name]} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True
            )
        finally:
            server.stop()
    completed = {k: sum(r["completed"] for r in v.values()) for k, v in results.items()}
    valid = {k: sum(r["valid"] for r in v.values()) for k, v in results.items()}
    return {
        "refused": sum(r["refused"] for r in results["paved"].values()),
        "failed": sum(r["failed"] for r in results["paved"].values()),
        "completion_ratio_vs_vllm": round(completed["paved"] / completed["vllm"], 4)
        if completed["vllm"]
        else float("inf"),
        "valid_json_paved": valid["paved"],
        "valid_json_vllm": valid["vllm"],
        "completed_paved": completed["paved"],
        "completed_vllm": completed["vllm"],
        "instance_detail": results,
    }


def run_gateway(args: argparse.Namespace, workdir: Path) -> dict:
    model = str(tiny_model_dir())
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(
                started(
                    f"frontend-{i}",
                    _paved_argv(model),
                    ready=rb"paved frontend: serving .* on (http://127\.0\.0\.1:\d+)",
                )
            )
            for i in range(2)
        ]
        urls = []
        for proc in procs:
            url = proc.wait_url(600)
            asyncio.run(proc.wait_http(url + "/health/ready", 600))
            urls.append(url)
        backends = [{"url": u, "version": "v1"} for u in urls]
        routes = {"models": [{"alias": "tiny", "strategy": "least_outstanding", "backends": backends}]}
        _, gateway, key = start_gateway(stack, workdir, routes, cpu=None, tag="burst")
        t0 = time.perf_counter()
        results = _two_bursts(gateway, args.requests, {"Authorization": f"Bearer {key}"})
        print(f"  gateway: {results} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return {
        "refused_via_gateway": sum(r["refused"] for r in results.values()),
        "failed_via_gateway": sum(r["failed"] for r in results.values()),
        "completed_via_gateway": sum(r["completed"] for r in results.values()),
        "valid_json_via_gateway": sum(r["valid"] for r in results.values()),
        "gateway_detail": results,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "instance", "gateway"), default="all")
    parser.add_argument("--requests", type=int, default=300, help="concurrent requests per burst")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    if not 1 <= args.requests <= 5000:
        parser.error("--requests must be in [1, 5000]")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    summary: dict = {"cpu_count": os.cpu_count() or 0, "part": args.part, "requests": args.requests}
    started_at = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-burst-") as tmp:
        if args.part in ("all", "instance"):
            summary.update(run_instance(args))
        if args.part in ("all", "gateway"):
            summary.update(run_gateway(args, Path(tmp)))
    summary["wall_s"] = round(time.monotonic() - started_at, 1)
    for key in ("refused", "completion_ratio_vs_vllm", "refused_via_gateway"):
        if key in summary:
            print(f"{key}: {summary[key]}")
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

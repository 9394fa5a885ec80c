"""paved's gateway vs the LiteLLM proxy in front of the same upstream, and prefix affinity vs
round robin over two vLLM frontends.

    tools/bazel run //bench:gateway -- [--part all|overhead|prefix] [--rounds N] [--json]

Part `overhead` (the default, `--part all`, runs both parts: ~5.5 min on 2 cores). Three
targets, one upstream:

  * direct:  client -> upstream;
  * paved:   client -> `python -m paved.gateway.server` (one process, SQLite state, a bootstrap
             tenant and key, routes `least_outstanding` over the one upstream) -> upstream;
  * litellm: client -> the LiteLLM proxy (PyPI `litellm[proxy]==1.108.7`, one uvicorn worker,
             `master_key` set and sent, access log and info logs off) -> upstream.

The upstream is `bench/gateway_upstream.py`: a raw asyncio protocol on uvloop + httptools that
answers /v1/chat/completions with a fixed small JSON, or an SSE stream of 6 events + [DONE]
(usage chunk included), so what is measured is the proxy. LiteLLM lives in a bench-only venv
the bench creates on first run (`--litellm-venv`, default ~/.cache/paved/bench-litellm-venv:
`python -m venv` + `pip install`, ~75 s and ~760 MB once; reused while its marker file
names the same version); it runs offline (`LITELLM_LOCAL_MODEL_COST_MAP=True`).

CPU placement (the machine has 2 cores): each proxy process is pinned to CPU 1
(`sched_setaffinity` before exec, inherited by its children); this process (the aiohttp load
generator, uvloop) and the upstream share CPU 0. All three targets stay up for the whole part;
only one is loaded at a time.

Load: non-streaming and streaming chat completions, closed loop, at concurrency 1 and 32, a
fixed number of requests per scenario and round; each round runs every scenario on every target
in a rotating order, so background load drifts over all alike; samples are pooled over rounds.
Latency is the client's full request time (to the last byte / `data: [DONE]`), TTFT the first
SSE event. Added latency = target p50 (p99) - direct p50 (p99) in the same run;
`added_p50_ratio_vs_litellm` = paved's added p50 / LiteLLM's at concurrency 1, non-streaming
(target <= 0.25); per-scenario ratios beside it. Throughput: 64 closed-loop clients for
`--rps-duration-s`, completions counted, best round per target; `rps_ratio_vs_litellm` =
paved / LiteLLM, non-streaming (target >= 4). `direct_rps` is what the client and upstream
manage together on CPU 0: a proxy's rps near it means the client, not the proxy, was the limit
(`client_bound_*` says so).

Part `prefix`: two paved frontends (`python -m paved.frontend.server --config`) serve
//models/tiny with a KV cache cut down through the model's `engine_args`
(`num_gpu_blocks_override`, `block_size` 32: the frontend passes them to vLLM verbatim); one
paved gateway in front of both, started twice with the same backends and `prefix_affinity`, then
`weighted` (equal weights: a random, even spread, i.e. round robin in expectation). Workload:
users sending chat requests whose system message is one of `--prefix-prompts` (16) long prompts
(~490 tokens each), chosen at random, with a short distinct user message, streaming 4 tokens,
`--prefix-concurrency` (32) closed-loop clients. One instance's cache holds
`--prefix-cache-fraction` (0.6) of all prompts' blocks plus a block per request it runs: the
prompts are ~1.7x one instance's cache and ~0.85x both. After an unmeasured pass over both
engines, `--prefix-rounds` (2) rounds each run both strategies, which goes first alternating,
pooled per strategy, so that no strategy always meets the engines in the same state. Each run
gets its own fresh prompt set (the caches persist between runs; stale blocks are just evicted),
a warm-up pass, then the measured requests, the same sequence of prompt indices and user
messages for all. The clients are closed-loop: a strategy that serves faster also sends faster,
so its admission latency (the first SSE event, below) is measured at a higher request rate;
`--prefix-rate R` sends the measured requests open loop at R per second instead (the same
offered load for both strategies);
reported: vLLM's prefix-cache hit rate over the measured requests
(`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries` deltas, summed over both instances'
/metrics), TTFT p50/p99 and the split between the instances. `prefix_hit_ratio_vs_round_robin`
= affinity hit rate / weighted hit rate (target >= 1.5); `prefix_ttft_p50_ratio_vs_round_robin`
and `prefix_ttft_p99_ratio_vs_round_robin` = affinity TTFT / weighted TTFT at that percentile
(targets <= 1.0: the hits must pay off in latency). TTFT there is the client's time to the
first SSE event, which the frontend sends (role only) at admission; `prefix_first_token_*` is
the time to the event after it (the first token's, after the prefill; p50/p99 and ratios).
The gateway routes without a tokenizer:
its affinity key is the first 1024 bytes of the messages' text (the system prompt).

With --json the last stdout line is one JSON object with every key. Every process the bench
starts runs in its own session on 127.0.0.1 and is stopped (SIGTERM to the group, then SIGKILL)
however the bench ends; every wait is bounded and names the log to read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import uvloop

LITELLM_VERSION = "1.108.7"
DEFAULT_VENV = Path.home() / ".cache" / "paved" / "bench-litellm-venv"
PROXY_CPU = 1
CLIENT_CPU = 0
CONCURRENCY = (1, 32)
RPS_CONCURRENCY = 64
MODEL = "tiny"
READY_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 60.0

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello to the team."}], "max_tokens": 8}
BODIES = {
    False: json.dumps(CHAT).encode(),
    True: json.dumps({**CHAT, "stream": True, "stream_options": {"include_usage": True}}).encode(),
}

# The prefix part: sizes of the cut-down KV cache and the workload (see the docstring).
PREFIX_BLOCK = 32  # the CPU attention backend takes multiples of 32 only
PREFIX_MAX_MODEL_LEN = 1024
PREFIX_WORDS = 300  # ~490 tokens of the tiny tokenizer (~3.6 characters per token)
PREFIX_OUTPUT_TOKENS = 4


class BenchError(RuntimeError):
    """The bench cannot produce a valid number (a process failed, a request failed)."""


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------
class Proc:
    """A child in its own session, stdout+stderr drained to a log file by a thread (a full pipe
    would block it). `ready` (a regex on output lines) captures group 1 as `url`."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        ready: bytes | None = None,
        cpu: int | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ):
        self.name = name
        # Closed by the drain thread once the child's output ends.
        self._log = tempfile.NamedTemporaryFile(prefix=f"bench-gateway-{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.log_path = self._log.name
        self._ready = re.compile(ready) if ready else None
        self.url: str | None = None
        self._seen = threading.Event()
        preexec: Callable[[], None] | None = None
        if cpu is not None:
            # Before exec: every process and thread the child starts inherits the mask.
            def preexec() -> None:
                os.sched_setaffinity(0, {cpu})

        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec,
            env=env,
            cwd=cwd,
        )
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        with self._log:
            for line in self.proc.stdout:
                self._log.write(line)
                self._log.flush()
                if self.url is None and self._ready is not None:
                    match = self._ready.search(line)
                    if match:
                        self.url = match.group(1).decode()
                        self._seen.set()
        self._seen.set()

    def tail(self, n: int = 15) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            return b"".join(f.readlines()[-n:]).decode(errors="replace")
        return ""

    def wait_url(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        if not self._seen.wait(timeout_s):
            raise BenchError(f"{self.name}: no ready line after {timeout_s:.0f} s; log {self.log_path}")
        if self.url is None:
            raise BenchError(
                f"{self.name} exited ({self.proc.poll()}) before it was ready; log {self.log_path}:\n"
                + self.tail()
            )
        return self.url

    async def wait_http(self, url: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until GET `url` answers 200 (bounded; fails at once if the process died)."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise BenchError(
                        f"{self.name} exited ({self.proc.returncode}); log {self.log_path}:\n" + self.tail()
                    )
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(url) as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.5)
        raise BenchError(f"{self.name}: {url} not 200 after {timeout_s:.0f} s; log {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # Stragglers the leader left behind in its group (vLLM's engine core, uvicorn workers).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def started(name: str, argv: list[str], **kwargs) -> Iterator[Proc]:
    proc = Proc(name, argv, **kwargs)
    try:
        yield proc
    finally:
        proc.stop()


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env


def start_upstream(stack: contextlib.ExitStack) -> str:
    argv = [sys.executable, "-m", "bench.gateway_upstream", "--port", "0", "--cpu", str(CLIENT_CPU)]
    proc = stack.enter_context(
        started("upstream", argv, ready=rb"^serving upstream on (http://127\.0\.0\.1:\d+)")
    )
    return proc.wait_url(30)


def start_gateway(
    stack: contextlib.ExitStack, workdir: Path, routes: dict, *, cpu: int | None, tag: str
) -> tuple[Proc, str, str]:
    """A paved gateway on `routes`; returns (process, base URL, bootstrap key)."""
    routes_path = workdir / f"routes-{tag}.json"
    routes_path.write_text(json.dumps(routes))
    key_path = workdir / f"key-{tag}"
    argv = [
        sys.executable,
        "-m",
        "paved.gateway.server",
        "--routes",
        str(routes_path),
        "--port",
        "0",
        "--state",
        f"sqlite:///{workdir / f'gateway-{tag}.sqlite'}",
        "--bootstrap-tenant",
        "bench",
        "--bootstrap-key-file",
        str(key_path),
        "--log-level",
        "warning",
    ]
    proc = stack.enter_context(
        started(
            f"paved-gateway-{tag}", argv, ready=rb"^serving gateway on (http://127\.0\.0\.1:\d+)", cpu=cpu
        )
    )
    url = proc.wait_url()
    # The key file is written before the ready line is printed (mode 0600; never logged here).
    key = key_path.read_text().strip()
    if not key:
        raise BenchError(f"paved gateway wrote an empty key file {key_path}")
    return proc, url, key


# ---------------------------------------------------------------------------------------------
# LiteLLM
# ---------------------------------------------------------------------------------------------
def litellm_venv(venv: Path) -> Path:
    """The bench-only LiteLLM venv (created once; a marker file records a finished install)."""
    marker = venv / f".paved-bench-litellm-{LITELLM_VERSION}"
    binary = venv / "bin" / "litellm"
    if marker.exists() and binary.exists():
        return binary
    if venv.exists():
        # An interrupted install or another version: start over rather than guess its state.
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{venv.name}-install.log"
    print(f"  creating the LiteLLM venv {venv} (once, ~75 s; log {log})", file=sys.stderr, flush=True)
    env = _child_env()
    env.pop("PYTHONPATH", None)  # Bazel's paths must not leak into the new venv's pip
    started_at = time.monotonic()
    with open(log, "wb") as out:
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [
                str(venv / "bin" / "pip"),
                "install",
                "--disable-pip-version-check",
                f"litellm[proxy]=={LITELLM_VERSION}",
            ],
        ]
        for step in steps:
            try:
                rc = subprocess.run(
                    step, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=1200
                ).returncode
            except subprocess.TimeoutExpired:
                rc = -1
            if rc != 0:
                raise BenchError(f"LiteLLM venv setup failed ({' '.join(step[:3])} ...: {rc}); log {log}")
    if not binary.exists():
        raise BenchError(f"{binary} missing after pip install; log {log}")
    marker.write_text(f"litellm[proxy]=={LITELLM_VERSION}\n")
    print(f"  LiteLLM venv ready in {time.monotonic() - started_at:.0f} s", file=sys.stderr, flush=True)
    return binary


def start_litellm(stack: contextlib.ExitStack, binary: Path, workdir: Path, upstream: str) -> tuple[str, str]:
    """LiteLLM's proxy, one worker pinned to PROXY_CPU; returns (base URL, master key)."""
    master_key = "sk-bench-" + os.urandom(12).hex()
    config = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {"model": f"openai/{MODEL}", "api_base": upstream + "/v1", "api_key": "x"},
            }
        ],
        "general_settings": {"master_key": master_key},
    }
    # YAML is a superset of JSON: no yaml writer needed here.
    config_path = workdir / "litellm.yaml"
    config_path.write_text(json.dumps(config))
    # Access log and per-request info logs off, as paved's gateway runs (--log-level warning).
    log_config = {
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {"err": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr"}},
        "root": {"level": "WARNING", "handlers": ["err"]},
        "loggers": {
            "uvicorn.access": {"level": "WARNING", "handlers": [], "propagate": False},
            "uvicorn.error": {"level": "WARNING"},
        },
    }
    log_config_path = workdir / "litellm-logging.json"
    log_config_path.write_text(json.dumps(log_config))
    port = _free_port()
    argv = [
        str(binary),
        "--config",
        str(config_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        "1",
        "--log_config",
        str(log_config_path),
    ]
    env = _child_env(LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR")
    env.pop("PYTHONPATH", None)
    proc = stack.enter_context(started("litellm", argv, cpu=PROXY_CPU, env=env, cwd=str(workdir)))
    url = f"http://127.0.0.1:{port}"
    asyncio.run(proc.wait_http(url + "/health/liveliness"))
    return url, master_key


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------
def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=False),
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
    )


async def one_request(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes, stream: bool
) -> tuple[float, float]:
    """(latency s, time to the first SSE event s) of one chat completion; raises on any
    answer that is not a complete, well-formed 200."""
    started_at = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as response:
        if response.status != 200:
            raise BenchError(f"{url}: HTTP {response.status}: {(await response.text())[:300]}")
        if not stream:
            data = await response.read()
            if b'"choices"' not in data:
                raise BenchError(f"{url}: no choices in {data[:300]!r}")
            elapsed = time.perf_counter() - started_at
            return elapsed, elapsed
        first = None
        done = False
        async for line in response.content:
            if line.startswith(b"data: "):
                if first is None:
                    first = time.perf_counter()
                if line.startswith(b"data: [DONE]"):
                    done = True
        if not done or first is None:
            raise BenchError(f"{url}: the stream ended without data: [DONE]")
    return time.perf_counter() - started_at, first - started_at


class Target:
    def __init__(self, name: str, url: str, key: str | None):
        self.name = name
        self.url = url
        self.headers = {"content-type": "application/json"}
        if key:
            self.headers["authorization"] = f"Bearer {key}"


async def fixed_load(
    target: Target, stream: bool, concurrency: int, requests: int
) -> list[tuple[float, float]]:
    """`requests` requests, `concurrency` at a time (closed loop); a session per run so no
    keep-alive connection idles across another target's run."""
    remaining = [requests]
    samples: list[tuple[float, float]] = []
    body = BODIES[stream]
    async with _session() as session:

        async def worker() -> None:
            while remaining[0] > 0:
                remaining[0] -= 1
                samples.append(await one_request(session, target.url, target.headers, body, stream))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


async def timed_load(target: Target, stream: bool, concurrency: int, duration_s: float) -> float:
    """Completions per second of `concurrency` closed-loop clients over `duration_s` (after a
    short ramp that is not counted); requests still in flight at the end are awaited, not counted."""
    body = BODIES[stream]
    counted = [0]
    window: list[float] = []
    async with _session() as session:

        async def worker(until: float) -> None:
            while time.perf_counter() < until:
                await one_request(session, target.url, target.headers, body, stream)
                now = time.perf_counter()
                if window and window[0] <= now <= window[1]:
                    counted[0] += 1

        ramp = 0.5
        start = time.perf_counter()
        window[:] = [start + ramp, start + ramp + duration_s]
        await asyncio.gather(*(worker(window[1]) for _ in range(concurrency)))
    return counted[0] / duration_s


def _percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def measure_overhead(targets: list[Target], args: argparse.Namespace) -> dict:
    scenarios = [(stream, c) for stream in (False, True) for c in CONCURRENCY]
    latency: dict[tuple[str, bool, int], list[tuple[float, float]]] = {}
    rps: dict[tuple[str, bool], list[float]] = {}
    for target in targets:  # warm-up: connections, caches, JIT-free but lazy imports
        for stream in (False, True):
            await fixed_load(target, stream, 8, 200)
    for r in range(args.rounds):
        order = targets[r % len(targets) :] + targets[: r % len(targets)]
        for stream, c in scenarios:
            requests = args.requests_c1 if c == 1 else args.requests_per_worker * c
            for target in order:
                t0 = time.perf_counter()
                samples = await fixed_load(target, stream, c, requests)
                latency.setdefault((target.name, stream, c), []).extend(samples)
                p50 = _percentile([s[0] for s in samples], 50)
                print(
                    f"  round {r + 1}/{args.rounds} {target.name:7s} {'stream' if stream else 'json':6s} "
                    f"c={c:<3} p50 {p50 * 1e3:7.2f} ms  ({time.perf_counter() - t0:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
        for stream in (False, True):
            for target in order:
                value = await timed_load(target, stream, RPS_CONCURRENCY, args.rps_duration_s)
                rps.setdefault((target.name, stream), []).append(value)
                print(
                    f"  round {r + 1}/{args.rounds} {target.name:7s} {'stream' if stream else 'json':6s} "
                    f"c={RPS_CONCURRENCY} {value:8.0f} req/s",
                    file=sys.stderr,
                    flush=True,
                )
    return {"latency": latency, "rps": rps}


def summarize_overhead(raw: dict) -> tuple[dict, list[str]]:
    out: dict[str, float | int | str | bool] = {}
    lines = []
    stat: dict[tuple[str, bool, int], dict[str, float]] = {}
    for key, samples in raw["latency"].items():
        lat = [s[0] for s in samples]
        ttft = [s[1] for s in samples]
        stat[key] = {
            "p50": _percentile(lat, 50),
            "p99": _percentile(lat, 99),
            "ttft_p50": _percentile(ttft, 50),
            "n": len(lat),
        }
    lines.append(
        f"{'scenario':14} {'target':8} {'n':>6} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8}"
    )
    for stream in (False, True):
        for c in CONCURRENCY:
            sfx = f"c{c}" + ("_stream" if stream else "")
            d = stat[("direct", stream, c)]
            added: dict[str, tuple[float, float]] = {}
            for name in ("direct", "paved", "litellm"):
                s = stat[(name, stream, c)]
                a50, a99 = s["p50"] - d["p50"], s["p99"] - d["p99"]
                added[name] = (a50, a99)
                lines.append(
                    f"{sfx:14} {name:8} {s['n']:6d} {s['p50'] * 1e3:8.2f} {s['p99'] * 1e3:8.2f} "
                    f"{a50 * 1e3:8.2f} {a99 * 1e3:8.2f}"
                )
                out[f"{name}_p50_ms_{sfx}"] = round(s["p50"] * 1e3, 3)
                out[f"{name}_p99_ms_{sfx}"] = round(s["p99"] * 1e3, 3)
                if stream:
                    out[f"{name}_ttft_p50_ms_{sfx}"] = round(s["ttft_p50"] * 1e3, 3)
                if name != "direct":
                    out[f"{name}_added_p50_ms_{sfx}"] = round(a50 * 1e3, 3)
                    out[f"{name}_added_p99_ms_{sfx}"] = round(a99 * 1e3, 3)
            for q, i in (("p50", 0), ("p99", 1)):
                lite = added["litellm"][i]
                # LiteLLM's added latency is many ms; a non-positive one would mean no measurement.
                ratio = added["paved"][i] / lite if lite > 0 else float("nan")
                out[f"added_{q}_ratio_vs_litellm_{sfx}"] = round(ratio, 4)
            lines.append(
                f"{'':14} paved/litellm added p50 {out[f'added_p50_ratio_vs_litellm_{sfx}']:.3f}, "
                f"added p99 {out[f'added_p99_ratio_vs_litellm_{sfx}']:.3f}"
            )
    out["added_p50_ratio_vs_litellm"] = out["added_p50_ratio_vs_litellm_c1"]
    lines.append("")
    lines.append(f"max req/s, {RPS_CONCURRENCY} closed-loop clients, best round")
    for stream in (False, True):
        sfx = "_stream" if stream else ""
        best = {name: max(raw["rps"][(name, stream)]) for name in ("direct", "paved", "litellm")}
        for name, value in best.items():
            out[f"{name}_rps{sfx}"] = round(value, 1)
        out[f"rps_ratio_vs_litellm{sfx}"] = round(best["paved"] / best["litellm"], 4)
        # Client and upstream share CPU 0: a proxy close to `direct` was held back by them.
        out[f"client_bound{sfx}"] = best["paved"] > 0.8 * best["direct"]
        lines.append(
            f"  {'stream' if stream else 'json':6s} direct {best['direct']:8.0f}  "
            f"paved {best['paved']:8.0f}  litellm {best['litellm']:8.0f}  "
            f"paved/litellm {out[f'rps_ratio_vs_litellm{sfx}']:.2f}"
        )
    return out, lines


def run_overhead(args: argparse.Namespace, workdir: Path) -> tuple[dict, list[str]]:
    binary = litellm_venv(Path(args.litellm_venv).expanduser())
    with contextlib.ExitStack() as stack:
        upstream = start_upstream(stack)
        routes = {
            "models": [
                {
                    "alias": MODEL,
                    "strategy": "least_outstanding",
                    "backends": [{"url": upstream, "version": "v1"}],
                }
            ]
        }
        _, paved_url, paved_key = start_gateway(stack, workdir, routes, cpu=PROXY_CPU, tag="overhead")
        litellm_url, litellm_key = start_litellm(stack, binary, workdir, upstream)
        targets = [
            Target("direct", upstream, None),
            Target("paved", paved_url, paved_key),
            Target("litellm", litellm_url, litellm_key),
        ]
        raw = uvloop.run(measure_overhead(targets, args))
    out, lines = summarize_overhead(raw)
    out.update(
        {
            "upstream": "bench/gateway_upstream.py (raw asyncio protocol, uvloop + httptools)",
            "litellm_version": LITELLM_VERSION,
            "rounds": args.rounds,
            "requests_c1": args.requests_c1,
            "requests_per_worker": args.requests_per_worker,
            "rps_duration_s": args.rps_duration_s,
        }
    )
    return out, lines


# ---------------------------------------------------------------------------------------------
# Prefix affinity vs round robin
# ---------------------------------------------------------------------------------------------
def _corpus_words() -> list[str]:
    from paved.runfiles import runfile

    words = Path(runfile("models/tiny/corpus.txt")).read_text().split()
    if len(words) < 100:
        raise BenchError("models/tiny/corpus.txt is too small for the prefix workload")
    return words


def _system_prompts(words: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    # A distinct leading tag: no two prompts share even their first block of tokens.
    return [
        f"System {seed}-{i}. " + " ".join(rng.choice(words) for _ in range(PREFIX_WORDS)) for i in range(n)
    ]


def _prefix_blocks_override(args: argparse.Namespace) -> int:
    """Blocks per instance: `--prefix-cache-fraction` of all prompts' blocks, plus one block per
    request the instance runs at once (half the clients: its user message and output), but never
    under one full-length sequence (vLLM refuses to start if max_model_len does not fit)."""
    prompt_blocks = args.prefix_prompts * (PREFIX_WORDS * 17 // 10 // PREFIX_BLOCK + 1)
    working = args.prefix_concurrency // 2
    return max(
        int(prompt_blocks * args.prefix_cache_fraction) + working, PREFIX_MAX_MODEL_LEN // PREFIX_BLOCK + 1
    )


def _frontend_config(workdir: Path, blocks: int) -> Path:
    from paved.runfiles import tiny_model_dir

    config = {
        "models": [
            {
                "name": MODEL,
                "path": tiny_model_dir(),
                "dtype": "float32",
                "max_model_len": PREFIX_MAX_MODEL_LEN,
                "max_num_seqs": 32,
                "enforce_eager": True,
                "engine_args": {
                    "num_gpu_blocks_override": blocks,
                    "block_size": PREFIX_BLOCK,
                    "enable_prefix_caching": True,
                },
            }
        ]
    }
    path = workdir / "frontend.json"
    path.write_text(json.dumps(config))
    return path


_METRIC = re.compile(r"^(vllm:prefix_cache_(?:hits|queries))(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)


async def prefix_counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as response:
        if response.status != 200:
            raise BenchError(f"{url}/metrics: HTTP {response.status}")
        text = await response.text()
    out = {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}
    found = False
    for name, value in _METRIC.findall(text):
        out[name] += float(value)
        found = True
    if not found:
        raise BenchError(f"{url}/metrics has no vllm:prefix_cache_hits / vllm:prefix_cache_queries")
    return out


async def prefix_request(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], system: str, user: str
) -> tuple[float, float]:
    """(seconds to the first SSE event, seconds to the event after it: the first token). The
    frontend sends its role-only first event at admission, before the engine has run the
    prompt, so the first is the gateway's and the frontend's admission latency and only the
    second includes the prefill that a prefix-cache hit shortens."""
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": PREFIX_OUTPUT_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    started_at = time.perf_counter()
    first = token = None
    done = False
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
        if response.status != 200:
            raise BenchError(f"{url}: HTTP {response.status}: {(await response.text())[:300]}")
        async for line in response.content:
            if line.startswith(b"data: {"):
                # The frontend sends an event per engine output that has text (or ends the
                # choice), so the one after the role event is the first token's.
                if first is None:
                    first = time.perf_counter()
                elif token is None:
                    token = time.perf_counter()
            if line.startswith(b"data: [DONE]"):
                done = True
    if not done or first is None or token is None:
        raise BenchError(f"{url}: the stream ended without two events or without data: [DONE]")
    return first - started_at, token - started_at


async def prefix_workload(
    gateway: Target, prompts: list[str], requests: int, seed: int, concurrency: int, rate: float = 0.0
) -> list[tuple[float, float]]:
    """`concurrency` closed-loop clients, or, with `rate` > 0, one request every 1/rate s
    whatever the answers (open loop: both strategies meet the same offered load; at most
    `concurrency` x 8 in flight, a bound, not a pace)."""
    rng = random.Random(seed)
    plan = [
        (rng.choice(prompts), f"User {seed}-{i}: what should I do next about item {i}?")
        for i in range(requests)
    ]
    ttfts: list[tuple[float, float]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        if rate > 0:
            bound = asyncio.Semaphore(concurrency * 8)

            async def one(system: str, user: str) -> None:
                async with bound:
                    ttfts.append(await prefix_request(session, gateway.url, gateway.headers, system, user))

            start = time.perf_counter()
            tasks = []
            for i, (system, user) in enumerate(plan):
                await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
                tasks.append(asyncio.create_task(one(system, user)))
            await asyncio.gather(*tasks)
            return ttfts

        async def worker() -> None:
            while plan:
                system, user = plan.pop()
                ttfts.append(await prefix_request(session, gateway.url, gateway.headers, system, user))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttfts


async def _split(session: aiohttp.ClientSession, frontends: list[str]) -> list[float]:
    out = []
    for url in frontends:
        async with session.get(url + "/metrics") as response:
            text = await response.text()
        total = 0.0
        for m in re.finditer(r"^vllm:request_success(?:_total)?\{[^}]*\}\s+([0-9.eE+-]+)$", text, re.M):
            total += float(m.group(1))
        out.append(total)
    return out


async def measure_strategy(
    gateway: Target, frontends: list[str], prompts: list[str], args, seed: int
) -> dict:
    # Warm-up: every prompt reaches its instance(s) at least about once; not measured.
    await prefix_workload(gateway, prompts, args.prefix_warmup, seed + 1000, args.prefix_concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        before = [await prefix_counters(session, u) for u in frontends]
        done_before = await _split(session, frontends)
        ttfts = await prefix_workload(
            gateway, prompts, args.prefix_requests, seed, args.prefix_concurrency, args.prefix_rate
        )
        after = [await prefix_counters(session, u) for u in frontends]
        done_after = await _split(session, frontends)
    hits = sum(
        a["vllm:prefix_cache_hits"] - b["vllm:prefix_cache_hits"] for a, b in zip(after, before, strict=True)
    )
    queries = sum(
        a["vllm:prefix_cache_queries"] - b["vllm:prefix_cache_queries"]
        for a, b in zip(after, before, strict=True)
    )
    if queries <= 0:
        raise BenchError("no prefix-cache queries counted during the measured requests")
    per_instance = []
    for a, b in zip(after, before, strict=True):
        q = a["vllm:prefix_cache_queries"] - b["vllm:prefix_cache_queries"]
        h = a["vllm:prefix_cache_hits"] - b["vllm:prefix_cache_hits"]
        per_instance.append(round(h / q, 4) if q > 0 else None)
    return {
        "per_instance": per_instance,
        "hits": hits,
        "queries": queries,
        "samples": ttfts,
        "hit_rate": hits / queries,
        "queried_tokens": queries,
        "ttft_p50": _percentile([t[0] for t in ttfts], 50),
        "ttft_p99": _percentile([t[0] for t in ttfts], 99),
        "token_p50": _percentile([t[1] for t in ttfts], 50),
        "token_p99": _percentile([t[1] for t in ttfts], 99),
        "split": [round(a - b) for a, b in zip(done_after, done_before, strict=True)],
    }


def run_prefix(args: argparse.Namespace, workdir: Path) -> tuple[dict, list[str]]:
    blocks = _prefix_blocks_override(args)
    config = _frontend_config(workdir, blocks)
    words = _corpus_words()
    results: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        frontends = []
        procs = []
        for i in range(2):
            argv = [
                sys.executable,
                "-m",
                "paved.frontend.server",
                "--config",
                str(config),
                "--port",
                "0",
                "--log-level",
                "warning",
            ]
            procs.append(
                stack.enter_context(
                    started(
                        f"frontend-{i}",
                        argv,
                        ready=rb"paved frontend: serving .* on (http://127\.0\.0\.1:\d+)",
                    )
                )
            )
        for proc in procs:
            url = proc.wait_url(600)
            asyncio.run(proc.wait_http(url + "/health/ready", 600))
            frontends.append(url)
        # Rounds alternate which strategy goes first (A B, then B A, ...), after a warm-up of the
        # engines: with affinity always first its first SSE event's p50 ratio was 1.18-1.90, and
        # 0.35 in one run with it second; single runs of one strategy vary 2x. Samples and
        # counters are pooled per strategy.
        runs: dict[str, list[dict]] = {"prefix_affinity": [], "weighted": []}
        order = ("prefix_affinity", "weighted")
        # An unmeasured pass over both engines first: no measured run meets them fresh.
        backends = [{"url": u, "version": "v1", "weight": 1} for u in frontends]
        routes = {"models": [{"alias": MODEL, "strategy": "weighted", "backends": backends}]}
        with contextlib.ExitStack() as gw_stack:
            _, url, key = start_gateway(gw_stack, workdir, routes, cpu=None, tag="engine-warmup")
            warm = _system_prompts(words, args.prefix_prompts, seed=99)
            uvloop.run(
                prefix_workload(
                    Target("warmup", url, key), warm, 3 * args.prefix_warmup, 999, args.prefix_concurrency
                )
            )
        for r in range(args.prefix_rounds):
            for strategy in order if r % 2 == 0 else order[::-1]:
                n = len(runs["prefix_affinity"]) + len(runs["weighted"])
                backends = [{"url": u, "version": "v1", "weight": 1} for u in frontends]
                routes = {"models": [{"alias": MODEL, "strategy": strategy, "backends": backends}]}
                with contextlib.ExitStack() as gw_stack:
                    _, url, key = start_gateway(gw_stack, workdir, routes, cpu=None, tag=f"{strategy}-{r}")
                    # A fresh prompt set per run and the same request sequence (prompt index,
                    # user message) for all: no run reuses another's blocks.
                    prompts = _system_prompts(words, args.prefix_prompts, seed=100 + n)
                    t0 = time.perf_counter()
                    run = uvloop.run(
                        measure_strategy(Target(strategy, url, key), frontends, prompts, args, 0)
                    )
                    runs[strategy].append(run)
                    print(
                        f"  round {r + 1} {strategy:16s} hit rate {run['hit_rate']:.3f}  ttft p50 "
                        f"{run['ttft_p50'] * 1e3:.1f} ms  split {run['split']}  "
                        f"({time.perf_counter() - t0:.0f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
        for strategy, done in runs.items():
            samples = [t for run in done for t in run["samples"]]
            queries = sum(run["queries"] for run in done)
            results[strategy] = {
                "hit_rate": sum(run["hits"] for run in done) / queries,
                "ttft_p50": _percentile([t[0] for t in samples], 50),
                "ttft_p99": _percentile([t[0] for t in samples], 99),
                "token_p50": _percentile([t[1] for t in samples], 50),
                "token_p99": _percentile([t[1] for t in samples], 99),
                "split": [sum(x) for x in zip(*(run["split"] for run in done), strict=True)],
                "per_instance": [run["per_instance"] for run in done],
            }
    a, w = results["prefix_affinity"], results["weighted"]
    out: dict[str, float | int | str | list] = {
        "prefix_hit_ratio_vs_round_robin": round(a["hit_rate"] / w["hit_rate"], 4)
        if w["hit_rate"] > 0
        else float("inf"),
        "prefix_hit_rate_affinity": round(a["hit_rate"], 4),
        "prefix_hit_rate_round_robin": round(w["hit_rate"], 4),
        "prefix_ttft_p50_ms_affinity": round(a["ttft_p50"] * 1e3, 2),
        "prefix_ttft_p50_ms_round_robin": round(w["ttft_p50"] * 1e3, 2),
        "prefix_ttft_p99_ms_affinity": round(a["ttft_p99"] * 1e3, 2),
        "prefix_ttft_p99_ms_round_robin": round(w["ttft_p99"] * 1e3, 2),
        "prefix_ttft_p50_ratio_vs_round_robin": round(a["ttft_p50"] / w["ttft_p50"], 4),
        "prefix_ttft_p99_ratio_vs_round_robin": round(a["ttft_p99"] / w["ttft_p99"], 4),
        "prefix_first_token_p50_ms_affinity": round(a["token_p50"] * 1e3, 2),
        "prefix_first_token_p50_ms_round_robin": round(w["token_p50"] * 1e3, 2),
        "prefix_first_token_p99_ms_affinity": round(a["token_p99"] * 1e3, 2),
        "prefix_first_token_p99_ms_round_robin": round(w["token_p99"] * 1e3, 2),
        "prefix_first_token_p50_ratio_vs_round_robin": round(a["token_p50"] / w["token_p50"], 4),
        "prefix_first_token_p99_ratio_vs_round_robin": round(a["token_p99"] / w["token_p99"], 4),
        "prefix_split_affinity": a["split"],
        "prefix_split_round_robin": w["split"],
        "prefix_hit_rate_per_instance_affinity": a["per_instance"],
        "prefix_hit_rate_per_instance_round_robin": w["per_instance"],
        "prefix_concurrency": args.prefix_concurrency,
        "prefix_kv_blocks_per_instance": blocks,
        "prefix_block_size": PREFIX_BLOCK,
        "prefix_prompts": args.prefix_prompts,
        "prefix_requests": args.prefix_requests,
        "prefix_rounds": args.prefix_rounds,
        "prefix_rate": args.prefix_rate,
    }
    lines = [
        f"prefix affinity vs weighted (round robin), 2 tiny-model frontends x {blocks} KV blocks of "
        f"{PREFIX_BLOCK} tokens, {args.prefix_prompts} system prompts of {PREFIX_WORDS} words, "
        f"{args.prefix_requests} measured requests at concurrency {args.prefix_concurrency}",
        f"  {'strategy':16} {'hit rate':>8} {'ttft p50':>9} {'ttft p99':>9} {'token p50':>9} "
        f"{'token p99':>9} split",
    ]
    for name, r in (("prefix_affinity", a), ("weighted", w)):
        lines.append(
            f"  {name:16} {r['hit_rate']:8.3f} {r['ttft_p50'] * 1e3:8.1f}ms {r['ttft_p99'] * 1e3:8.1f}ms "
            f"{r['token_p50'] * 1e3:8.1f}ms {r['token_p99'] * 1e3:8.1f}ms "
            f"{r['split']} per instance {r['per_instance']}"
        )
    lines.append(
        f"  prefix_hit_ratio_vs_round_robin {out['prefix_hit_ratio_vs_round_robin']} (target >= 1.5), "
        f"ttft ratio p50 {out['prefix_ttft_p50_ratio_vs_round_robin']} "
        f"p99 {out['prefix_ttft_p99_ratio_vs_round_robin']} (targets <= 1.0), first token ratio "
        f"p50 {out['prefix_first_token_p50_ratio_vs_round_robin']} "
        f"p99 {out['prefix_first_token_p99_ratio_vs_round_robin']}"
    )
    return out, lines


# ---------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "overhead", "prefix"), default="all")
    parser.add_argument("--rounds", type=int, default=3, help="overhead rounds (targets rotate)")
    parser.add_argument("--requests-c1", type=int, default=300, help="requests per c=1 scenario per round")
    parser.add_argument(
        "--requests-per-worker", type=int, default=20, help="requests per client per c=32 scenario per round"
    )
    parser.add_argument(
        "--rps-duration-s", type=float, default=4.0, help="seconds counted per throughput run"
    )
    parser.add_argument("--litellm-venv", default=str(DEFAULT_VENV), help="bench-only venv for LiteLLM")
    parser.add_argument("--prefix-prompts", type=int, default=16, help="distinct system prompts")
    parser.add_argument(
        "--prefix-cache-fraction",
        type=float,
        default=0.6,
        help="one instance's KV cache as a fraction of all prompts' blocks",
    )
    parser.add_argument("--prefix-concurrency", type=int, default=32, help="closed-loop clients")
    parser.add_argument(
        "--prefix-rate",
        type=float,
        default=0.0,
        help="measured requests per second, open loop (default 0: closed loop, --prefix-concurrency clients)",
    )
    parser.add_argument("--prefix-warmup", type=int, default=96, help="unmeasured requests per strategy")
    parser.add_argument("--prefix-requests", type=int, default=320, help="measured requests per strategy")
    parser.add_argument(
        "--prefix-rounds",
        type=int,
        default=2,
        help="prefix rounds; each runs both strategies, the order alternating (pooled)",
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    for name in (
        "rounds",
        "requests_c1",
        "requests_per_worker",
        "prefix_prompts",
        "prefix_requests",
        "prefix_rounds",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.prefix_rate <= 1000:
        parser.error("--prefix-rate must be in [0, 1000]")
    if not 0 < args.rps_duration_s <= 120:
        parser.error("--rps-duration-s must be in (0, 120]")
    if not 0.05 <= args.prefix_cache_fraction <= 2:
        parser.error("--prefix-cache-fraction must be in [0.05, 2]")
    if args.prefix_warmup < 0:
        parser.error("--prefix-warmup must be >= 0")
    allowed = sorted(os.sched_getaffinity(0))
    if not {CLIENT_CPU, PROXY_CPU} <= set(allowed):
        parser.error(f"needs CPUs {CLIENT_CPU} and {PROXY_CPU} (this process may use {allowed})")

    # SIGTERM (e.g. from `bazel run`'s parent) must unwind through the finally blocks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    summary: dict = {"cpu_count": os.cpu_count() or 0, "part": args.part}
    lines: list[str] = []
    started_at = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        workdir = Path(tmp)
        if args.part in ("all", "overhead"):
            # The load generator's CPU; children re-pin themselves (upstream) or are pinned
            # before exec (the proxies), the prefix part's frontends take any CPU.
            allowed = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {CLIENT_CPU})
            try:
                out, part_lines = run_overhead(args, workdir)
            finally:
                os.sched_setaffinity(0, allowed)
            summary.update(out)
            lines += part_lines
        if args.part in ("all", "prefix"):
            out, part_lines = run_prefix(args, workdir)
            summary.update(out)
            lines += ["", *part_lines]
    summary["wall_s"] = round(time.monotonic() - started_at, 1)
    print()
    print("\n".join(lines))
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

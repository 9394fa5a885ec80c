"""The KPA autoscaler vs a naive policy over simulated replicas: decision delay on a load step,
replica-count oscillation over a sinusoid.

    tools/bazel run //bench:autoscale -- [--period-s S] [--periods N] [--json]

Two pools of replicas run side by side in one run, each with its own policy, load generator and
replicas, on the same load profile clock (so a drifting background load hits both alike). A
replica is a real `python -m paved.frontend.server --engine sim://tiny?tokens_per_s=20&
max_num_seqs=8 --port 0` started and stopped by the bench (each request decodes 20 tokens,
~1 s; eight decode at once per replica). The load is C(t) closed-loop clients, each sending one
non-streaming `/v1/completions` at a time to the ready replica with the fewest requests in
flight (the bench is its own least-outstanding balancer). Every `interval_s` a pool's
controller scrapes each ready replica's `/metrics` (paved.metrics.gauges.scrape),
decides, and sets the pool's desired count (replicas start in the background, in ~2-5 s; extra
ones leave the rotation and get SIGTERM).

  * kpa: paved.control_plane.autoscaler.Autoscaler with stable_window 30 s, panic_window 6 s,
    panic_threshold 2, scale_down_delay 15 s, interval 2 s, the default per-replica targets
    (waiting 2, in flight 8, KV 0.8), replicas in [1, 5].
  * naive: ceil(instant total waiting / target_waiting), clamped to [1, 5], every interval, no
    windows, no delay, no hold.

Phases: warm-up (C = 4, 20 s), step (C = 32 for 20 s: `decision_delay_s` is the time from the
step to the first decision above the pre-step target; target <= panic window + one interval =
8 s), settle (C = 4 until both pools are back at 1, at most 60 s), sinusoid (C(t) = 20 + 14
sin(2 pi t / period) for `--periods` periods: `changes_<policy>` counts changes of the decided
replica count; `oscillation_ratio_vs_naive` = changes_kpa / changes_naive, target <= 0.5).
Also per policy: replica-seconds and the mean total waiting over the sinusoid (the cost and the
queueing each policy bought), client errors (must be 0; anything else: exit status 1). With
--json the last stdout line is one JSON object with every key.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from paved.control_plane.autoscaler import Autoscaler
from paved.control_plane.types import AutoscalePolicy
from paved.metrics.gauges import ReplicaMetrics, ScrapeError, scrape

ENGINE = "sim://tiny?tokens_per_s=20&max_num_seqs=8"
MAX_TOKENS = 20
MIN_REPLICAS, MAX_REPLICAS = 1, 5
POLICY = AutoscalePolicy(
    enabled=True,
    stable_window_s=30.0,
    panic_window_s=6.0,
    panic_threshold=2.0,
    scale_down_delay_s=15.0,
    interval_s=2.0,
)
LOW, HIGH = 4, 32
SIN_MID, SIN_AMP = 20, 14
MAX_CLIENTS = max(HIGH, SIN_MID + SIN_AMP)
REPLICA_ARGS = ("-m", "paved.frontend.server", "--engine", ENGINE, "--port", "0")
URL = re.compile(rb"serving .* on (http://\S+)")
BODY = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": MAX_TOKENS, "ignore_eos": True}).encode()


class Replica:
    """One sim frontend process (its own process group: stopped with everything it started)."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str, drain: asyncio.Task):
        self.proc, self.url, self._drain = proc, url, drain
        self.in_flight = 0

    @classmethod
    async def start(cls, log_dir: str, python: str = sys.executable) -> Replica:
        # A local file opened once per replica start: not worth a thread.
        log = open(os.path.join(log_dir, f"replica-{time.monotonic_ns()}.log"), "wb")  # noqa: SIM115, ASYNC230
        proc = await asyncio.create_subprocess_exec(
            python, *REPLICA_ARGS, stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True,
        )  # fmt: skip
        log.close()  # the child holds its own descriptor
        assert proc.stdout is not None
        try:
            url = None
            async with asyncio.timeout(120):
                while url is None:
                    line = await proc.stdout.readline()
                    if not line:
                        raise RuntimeError(f"replica exited with {await proc.wait()} (log in {log_dir})")
                    match = URL.search(line)
                    url = match.group(1).decode() if match else None

                async def drain() -> None:
                    assert proc.stdout is not None
                    while await proc.stdout.readline():
                        pass

                replica = cls(proc, url, asyncio.create_task(drain()))
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
                    while True:
                        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                            async with session.get(url + "/health/ready") as response:
                                if response.status == 200:
                                    return replica
                        await asyncio.sleep(0.2)
        except BaseException:
            _kill(proc)
            await proc.wait()
            raise

    async def stop(self) -> None:
        # Out of the rotation already: let its queued requests finish (a replica that was
        # overloaded may hold several request times of queue).
        for _ in range(300):
            if self.in_flight == 0:
                break
            await asyncio.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), 20)
        except TimeoutError:
            _kill(self.proc)
            await self.proc.wait()
        self._drain.cancel()


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@dataclass
class Pool:
    """Replicas converging on `desired` in the background; `ready` is the rotation."""

    name: str
    log_dir: str
    desired: int = MIN_REPLICAS
    ready: list[Replica] = field(default_factory=list)
    starting: int = 0
    errors: int = 0
    ok: int = 0
    tasks: set[asyncio.Task] = field(default_factory=set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def set_desired(self, n: int) -> None:
        self.desired = n
        self.changed.set()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _start_one(self) -> None:
        try:
            self.ready.append(await Replica.start(self.log_dir))
        finally:
            self.starting -= 1
            self.changed.set()

    async def reconcile(self) -> None:
        while True:
            await self.changed.wait()
            self.changed.clear()
            while len(self.ready) + self.starting < self.desired:
                self.starting += 1
                self._spawn(self._start_one())
            while len(self.ready) > self.desired:
                self._spawn(self.ready.pop().stop())

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(r.stop() for r in self.ready), return_exceptions=True)
        self.ready.clear()


async def client(pool: Pool, session: aiohttp.ClientSession, index: int, load: Callable[[], int]) -> None:
    while True:
        if index >= load() or not pool.ready:
            await asyncio.sleep(0.05)
            continue
        replica = min(pool.ready, key=lambda r: r.in_flight)
        replica.in_flight += 1
        try:
            async with session.post(
                replica.url + "/v1/completions", data=BODY, headers={"content-type": "application/json"}
            ) as response:
                await response.read()
                if response.status == 200:
                    pool.ok += 1
                else:
                    pool.errors += 1
                    print(f"  {pool.name}: HTTP {response.status} from {replica.url}", file=sys.stderr)
        except (TimeoutError, aiohttp.ClientError) as e:
            pool.errors += 1
            print(f"  {pool.name}: {type(e).__name__} {e} from {replica.url}", file=sys.stderr)
        finally:
            replica.in_flight -= 1


@dataclass
class Tick:
    t: float
    target: int
    ready: int
    waiting: float
    mode: str
    reason: str


async def controller(pool: Pool, policy: str, ticks: list[Tick], clock: Callable[[], float]) -> None:
    scaler = Autoscaler(POLICY)
    while True:
        started = time.monotonic()
        replicas = list(pool.ready)
        results = await asyncio.gather(
            *(scrape(r.url + "/metrics", model_id="tiny", timeout_s=1.0) for r in replicas),
            return_exceptions=True,
        )
        samples = [m for m in results if isinstance(m, ReplicaMetrics)]
        for e in results:
            if isinstance(e, BaseException) and not isinstance(e, ScrapeError):
                raise e
        waiting = sum(s.waiting for s in samples)
        if policy == "kpa":
            scaler.observe(samples)
            d = scaler.decide(
                current_target=pool.desired,
                ready=len(replicas),
                min_replicas=MIN_REPLICAS,
                max_replicas=MAX_REPLICAS,
                step_in_flight=len(replicas) != pool.desired or pool.starting > 0,
            )
            target, mode, reason = d.target, d.mode, d.reason
        else:
            raw = math.ceil(waiting / POLICY.target_waiting)
            target, mode, reason = min(max(raw, MIN_REPLICAS), MAX_REPLICAS), "naive", f"waiting {waiting:g}"
        ticks.append(Tick(clock(), target, len(replicas), waiting, mode, reason))
        if target != pool.desired:
            print(
                f"  {clock():7.1f}s {pool.name}: {pool.desired} -> {target} ({mode}: {reason})",
                file=sys.stderr,
            )
        pool.set_desired(target)
        await asyncio.sleep(max(0.0, POLICY.interval_s - (time.monotonic() - started)))


async def measure(args: argparse.Namespace) -> dict:
    t0 = time.monotonic()

    def clock() -> float:
        return time.monotonic() - t0

    load = {"c": LOW}
    log_dir = tempfile.mkdtemp(prefix="paved-bench-autoscale-")
    pools = {name: Pool(name, log_dir) for name in ("kpa", "naive")}
    ticks: dict[str, list[Tick]] = {name: [] for name in pools}
    background: list[asyncio.Task] = []
    connector_limit = MAX_CLIENTS + 8
    sessions = [
        aiohttp.ClientSession(
            # Idle connections are dropped before uvicorn's 5 s keep-alive closes them: reusing
            # one as the server closes it is a client race (ServerDisconnected), not a replica's.
            connector=aiohttp.TCPConnector(limit=connector_limit, keepalive_timeout=2),
            timeout=aiohttp.ClientTimeout(total=60),
        )
        for _ in pools
    ]
    try:
        for pool in pools.values():
            background.append(asyncio.create_task(pool.reconcile()))
            pool.set_desired(MIN_REPLICAS)
        while any(len(p.ready) < MIN_REPLICAS for p in pools.values()):  # noqa: ASYNC110  (bounded by start's timeout)
            await asyncio.sleep(0.2)
        print(f"  {clock():7.1f}s replicas up; warm-up at {LOW} clients", file=sys.stderr)
        for (name, pool), session in zip(pools.items(), sessions, strict=True):
            background.extend(
                asyncio.create_task(client(pool, session, i, lambda: load["c"])) for i in range(MAX_CLIENTS)
            )
            background.append(asyncio.create_task(controller(pool, name, ticks[name], clock)))
        await asyncio.sleep(20)
        step_at = clock()
        before = {name: pools[name].desired for name in pools}
        load["c"] = HIGH
        print(f"  {step_at:7.1f}s step to {HIGH} clients", file=sys.stderr)
        await asyncio.sleep(20)
        load["c"] = LOW
        settle_until = clock() + 60
        while clock() < settle_until and any(p.desired > MIN_REPLICAS for p in pools.values()):  # noqa: ASYNC110
            await asyncio.sleep(0.5)
        sin_start = clock()
        print(f"  {sin_start:7.1f}s sinusoid: {args.periods} x {args.period_s:g} s", file=sys.stderr)
        while (elapsed := clock() - sin_start) < args.periods * args.period_s:
            load["c"] = round(SIN_MID + SIN_AMP * math.sin(2 * math.pi * elapsed / args.period_s))
            await asyncio.sleep(0.25)
        sin_end = clock()
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        for session in sessions:
            await session.close()
        await asyncio.gather(*(p.close() for p in pools.values()))
    out: dict = {"log_dir": log_dir}
    for name, pool in pools.items():
        mine = ticks[name]
        first = next((k for k in mine if k.t > step_at and k.target > before[name]), None)
        out[f"decision_delay_s_{name}"] = round(first.t - step_at, 2) if first else -1
        out[f"step_peak_{name}"] = max((k.target for k in mine if step_at < k.t < step_at + 20), default=0)
        sin = [k for k in mine if sin_start <= k.t <= sin_end]
        out[f"changes_{name}"] = sum(1 for a, b in itertools.pairwise(sin) if a.target != b.target)
        out[f"replica_s_{name}"] = round(sum(k.ready for k in sin) * POLICY.interval_s, 1)
        out[f"waiting_mean_{name}"] = round(sum(k.waiting for k in sin) / max(1, len(sin)), 2)
        out[f"requests_ok_{name}"] = pool.ok
        out[f"client_errors_{name}"] = pool.errors
        out[f"panic_ticks_{name}"] = sum(1 for k in mine if k.mode == "panic")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--period-s", type=float, default=90.0, help="sinusoid period in seconds")
    parser.add_argument("--periods", type=int, default=2, help="sinusoid periods measured")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    if not args.period_s >= 10 or not 1 <= args.periods <= 20:
        parser.error("--period-s must be >= 10 and --periods within [1, 20]")
    # SIGTERM/SIGHUP unwind like Ctrl-C, so every replica's process group is stopped.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    load_start = os.getloadavg()
    run = asyncio.run(measure(args))
    load_end = os.getloadavg()
    kpa, naive = run["changes_kpa"], run["changes_naive"]
    summary = {
        "cpu_count": os.cpu_count() or 0,
        "loadavg_1m_start": round(load_start[0], 2),
        "loadavg_1m_end": round(load_end[0], 2),
        "period_s": args.period_s,
        "periods": args.periods,
        "decision_delay_s": run["decision_delay_s_kpa"],
        "decision_delay_target_s": POLICY.panic_window_s + POLICY.interval_s,
        "oscillation_ratio_vs_naive": round(kpa / naive, 3) if naive else -1,
        **{k: v for k, v in run.items() if k != "log_dir"},
    }
    print(
        f"\n{'policy':8} {'delay s':>8} {'peak':>5} {'changes':>8} {'replica-s':>10} {'waiting':>8} "
        f"{'ok':>7} {'errors':>7}"
    )
    for name in ("kpa", "naive"):
        print(
            f"{name:8} {run[f'decision_delay_s_{name}']:8.2f} {run[f'step_peak_{name}']:5d} "
            f"{run[f'changes_{name}']:8d} {run[f'replica_s_{name}']:10.1f} "
            f"{run[f'waiting_mean_{name}']:8.2f} "
            f"{run[f'requests_ok_{name}']:7d} {run[f'client_errors_{name}']:7d}"
        )
    print(
        f"decision_delay_s {summary['decision_delay_s']} (target <= {summary['decision_delay_target_s']:g}); "
        f"oscillation_ratio_vs_naive {summary['oscillation_ratio_vs_naive']} (target <= 0.5)"
    )
    print(f"replica logs: {run['log_dir']}")
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 1 if run["client_errors_kpa"] or run["client_errors_naive"] else 0


if __name__ == "__main__":
    sys.exit(main())

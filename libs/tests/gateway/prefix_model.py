"""An offline model of `//bench:gateway --part prefix`: the real `Router` routing the bench's
prompt mix to two simulated vLLM engines, on simulated time (no processes, no sleeping).

    PYTHONPATH=libs:libs/tests/gateway .venv/bin/python libs/tests/gateway/prefix_model.py [--seeds N]

Each engine is vLLM V1's prefix cache and scheduler cut down to what decides hits and queueing:
`BLOCKS` KV blocks of `BLOCK` tokens; a block is shared while requests use it and, once free,
stays cached until the least recently freed block is taken for new content (vLLM's free-block
queue; a finished request's blocks are freed tail first, so its last blocks go first); a
request's hit is the longest chain of its prompt's full blocks still cached. The scheduler
admits waiting requests first come first served while their new blocks fit, up to
`MAX_SEQS` running and `TOKEN_BUDGET` prefill tokens a step; a step costs
`STEP_S + PREFILL_S * prefill tokens + DECODE_S * running`. The workload is the bench's: 16
system prompts of 15 full blocks plus a request's own 2 blocks (its prompt's tail, the user
message and 4 output tokens), chosen at random, 32 closed-loop clients, a warm-up and 320
measured requests per strategy, each strategy on a fresh prompt set and fresh caches. Gauges
(waiting, KV usage) reach the router every `GAUGE_S`, as the gateway's health rounds scrape them.

The step costs are fitted to the bench's measured numbers (first token ~1 s at round robin on
the 2-core machine), and the model reproduces the measured hit rates (round robin ~0.55, plain
affinity ~0.87); its latencies are the prefill-and-queueing time a prefix hit shortens (the
bench's `prefix_first_token_*`), not the frontend's admission event (`prefix_ttft_*`, which
moves with the machine's CPU load more than with routing). `joined` is the number of our
requests already in flight at the backend a request is sent to: how much the router piles up.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paved.gateway.routing.router import Router
from paved.gateway.routing.routes import parse_routes

BLOCK = 32
BLOCKS = 169
PROMPT_BLOCKS = 15  # the system prompt's full blocks (~490 tokens)
OWN_BLOCKS = 2  # the prompt's tail with the user message, and the output
PROMPT_TOKENS = PROMPT_BLOCKS * BLOCK + 35
OUTPUT_TOKENS = 4
MAX_SEQS = 32
TOKEN_BUDGET = 4096
STEP_S = 0.004
PREFILL_S = 0.00035
DECODE_S = 0.0004
GAUGE_S = 2.0
NETWORK_S = 0.004
BACKENDS = ("http://127.0.0.1:8001", "http://127.0.0.1:8002")


@dataclass
class _Request:
    client: int
    prompt: int
    arrived: float
    backend: str
    hit_blocks: int = 0
    blocks: list[int] = field(default_factory=list)
    decoded: int = 0
    first_token: float | None = None
    joined: int = 0  # requests already at its backend (ours, in flight) when it was sent
    cost: float = 1.0


class Engine:
    """One vLLM instance: a block pool with a prefix cache and an FCFS scheduler."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.refs = [0] * BLOCKS
        self.content: list[tuple[int, int] | None] = [None] * BLOCKS  # (prompt, index) cached
        self.by_content: dict[tuple[int, int], int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(BLOCKS))
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.busy = False
        self.queries = 0
        self.hits = 0

    def used(self) -> float:
        return sum(1 for r in self.refs if r > 0) / BLOCKS

    def _cached_chain(self, prompt: int) -> list[int]:
        chain = []
        for i in range(PROMPT_BLOCKS):
            b = self.by_content.get((prompt, i))
            if b is None:
                break
            chain.append(b)
        return chain

    def _try_admit(self, r: _Request) -> bool:
        chain = self._cached_chain(r.prompt)
        need = PROMPT_BLOCKS - len(chain) + OWN_BLOCKS
        reusable_free = sum(1 for b in chain if self.refs[b] == 0)
        if len(self.free) - reusable_free < need:
            return False
        for b in chain:
            if self.refs[b] == 0:
                del self.free[b]
            self.refs[b] += 1
        blocks = list(chain)
        for i in range(len(chain), PROMPT_BLOCKS + OWN_BLOCKS):
            b, _ = self.free.popitem(last=False)
            old = self.content[b]
            if old is not None:
                del self.by_content[old]
            self.content[b] = None
            if i < PROMPT_BLOCKS:
                self.content[b] = (r.prompt, i)
                self.by_content[(r.prompt, i)] = b
            self.refs[b] = 1
            blocks.append(b)
        r.blocks = blocks
        r.hit_blocks = len(chain)
        self.queries += PROMPT_TOKENS
        self.hits += len(chain) * BLOCK
        return True

    def finish(self, r: _Request) -> None:
        for b in reversed(r.blocks):  # tail first: the request's last blocks are evicted first
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None

    def step(self) -> tuple[float, list[_Request], list[_Request]]:
        """Schedules one step: (its duration, requests whose first token it makes, finished)."""
        prefill = 0
        admitted: list[_Request] = []
        while self.waiting and len(self.running) + len(admitted) < MAX_SEQS:
            r = self.waiting[0]
            chain = self._cached_chain(r.prompt)
            tokens = PROMPT_TOKENS - len(chain) * BLOCK
            if admitted and prefill + tokens > TOKEN_BUDGET:
                break
            if not self._try_admit(r):
                break
            self.waiting.popleft()
            prefill += PROMPT_TOKENS - r.hit_blocks * BLOCK
            admitted.append(r)
        decoding = list(self.running)
        duration = STEP_S + PREFILL_S * prefill + DECODE_S * (len(decoding) + len(admitted))
        finished = []
        for r in decoding:
            r.decoded += 1
            if r.decoded >= OUTPUT_TOKENS:
                finished.append(r)
        for r in admitted:
            r.decoded = 1
        self.running = [r for r in decoding if r not in finished] + admitted
        return duration, admitted, finished


@dataclass
class Result:
    hit_rate: float
    first_token_p50: float
    first_token_p99: float
    split: tuple[int, int]
    per_instance: tuple[float, float]
    joined_p50: float
    joined_p99: float


def simulate(
    make_router: Callable[[Callable[[], float]], Router],
    *,
    seed: int,
    prompts: int = 16,
    clients: int = 32,
    warmup: int = 96,
    measured: int = 320,
    hot: float = 0.0,
) -> Result:
    """One strategy's run: fresh caches and prompts, `warmup` then `measured` requests. `hot`:
    the share of requests that use prompt 0 (the rest uniform; 0: the bench's uniform mix)."""
    rng = random.Random(seed)
    now = [0.0]
    router = make_router(lambda: now[0])
    engines = {b: Engine(b) for b in BACKENDS}
    tag = rng.getrandbits(48)
    keys = [f"System {tag}-{i}. ".encode() + rng.randbytes(64) for i in range(prompts)]
    plan = [0 if rng.random() < hot else rng.randrange(prompts) for _ in range(warmup + measured)]
    issued = 0
    in_flight = dict.fromkeys(BACKENDS, 0)
    events: list[tuple[float, int, str, Any]] = []
    order = [0]

    def push(t: float, kind: str, what: Any) -> None:
        order[0] += 1
        heapq.heappush(events, (t, order[0], kind, what))

    def send(client: int) -> None:
        nonlocal issued
        if issued >= len(plan):
            return
        prompt = plan[issued]
        issued += 1
        pick = router.pick("tiny", sticky_key=str(client), affinity=keys[prompt])
        joined = in_flight[pick.backend.id]
        in_flight[pick.backend.id] += 1
        router.begin(pick.backend.id, pick.cost)
        r = _Request(client, prompt, now[0], pick.backend.id, joined=joined, cost=pick.cost)
        r.index = issued - 1  # type: ignore[attr-defined]
        push(now[0] + NETWORK_S, "arrive", r)

    done: list[_Request] = []
    measured_from = {b: (0, 0) for b in BACKENDS}
    for c in range(clients):
        send(c)
    push(0.0, "gauges", None)
    marked = False
    while events:
        t, _, kind, what = heapq.heappop(events)
        now[0] = t
        if kind == "gauges":
            for b, e in engines.items():
                router.observe_load(b, waiting=float(len(e.waiting)), kv_usage=e.used())
            if any(e.running or e.waiting for e in engines.values()) or issued < len(plan):
                push(t + GAUGE_S, "gauges", None)
        elif kind == "arrive":
            e = engines[what.backend]
            e.waiting.append(what)
            if not e.busy:
                e.busy = True
                push(t, "step", e)
        elif kind == "step":
            e = what
            duration, first, finished = e.step()
            if not first and not finished and not e.running:
                e.busy = False
                continue
            push(t + duration, "stepped", (e, first, finished))
        elif kind == "stepped":
            e, first, finished = what
            for r in first:
                r.first_token = t
            for r in finished:
                e.finish(r)
                router.end(r.backend, ok=True, cost=r.cost)
                in_flight[r.backend] -= 1
                done.append(r)
                if not marked and len(done) >= warmup:
                    marked = True
                    measured_from = {b: (x.queries, x.hits) for b, x in engines.items()}
                send(r.client)
            if e.running or e.waiting:
                push(t, "step", e)
            else:
                e.busy = False
    rows = [r for r in done if r.index >= warmup]  # type: ignore[attr-defined]
    ttft = sorted((r.first_token or 0.0) - r.arrived + NETWORK_S for r in rows)
    per = []
    q_total = h_total = 0
    for b in BACKENDS:
        q = engines[b].queries - measured_from[b][0]
        h = engines[b].hits - measured_from[b][1]
        q_total += q
        h_total += h
        per.append(h / q if q else 0.0)
    split = tuple(sum(1 for r in rows if r.backend == b) for b in BACKENDS)
    joined = sorted(r.joined for r in rows)
    return Result(
        h_total / q_total,
        statistics.median(ttft),
        ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        split,  # type: ignore[arg-type]
        tuple(per),  # type: ignore[arg-type]
        statistics.median(joined),
        joined[min(len(joined) - 1, int(0.99 * len(joined)))],
    )


def routes(strategy: str) -> Any:
    return parse_routes(
        {
            "models": [
                {
                    "alias": "tiny",
                    "strategy": strategy,
                    "backends": [{"url": b, "version": "v1"} for b in BACKENDS],
                }
            ]
        }
    )


def round_robin(seed: int) -> Callable[[Callable[[], float]], Router]:
    return lambda clock: Router(routes("weighted"), clock=clock, rng=random.Random(seed))


def affinity(**kwargs: Any) -> Callable[[Callable[[], float]], Router]:
    """Prefix affinity with the Router's defaults, or `kwargs` (e.g. hit_cost=1.0: load counted
    in requests, the scoring before issue 22's 2b)."""
    return lambda clock: Router(routes("prefix_affinity"), clock=clock, rng=random.Random(0), **kwargs)


def compare(
    make: Callable[[Callable[[], float]], Router], seeds: range, hot: float = 0.0
) -> dict[str, float]:
    """Averaged over seeds: the strategy vs round robin, each on its own prompts and plan (as the
    bench gives each strategy a fresh prompt set)."""
    a = [simulate(make, seed=s, hot=hot) for s in seeds]
    w = [simulate(round_robin(s), seed=s + 10_000, hot=hot) for s in seeds]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    return {
        "hit_affinity": mean([x.hit_rate for x in a]),
        "hit_round_robin": mean([x.hit_rate for x in w]),
        "hit_ratio": mean([x.hit_rate for x in a]) / mean([x.hit_rate for x in w]),
        "first_token_p50_ratio": mean([x.first_token_p50 for x in a]) / mean([x.first_token_p50 for x in w]),
        "first_token_p99_ratio": mean([x.first_token_p99 for x in a]) / mean([x.first_token_p99 for x in w]),
        "joined_p50_ratio": mean([x.joined_p50 for x in a]) / mean([x.joined_p50 for x in w]),
        "joined_p99_ratio": mean([x.joined_p99 for x in a]) / mean([x.joined_p99 for x in w]),
        "joined_p99": mean([x.joined_p99 for x in a]),
        "joined_p99_round_robin": mean([x.joined_p99 for x in w]),
        "first_token_p50_s": mean([x.first_token_p50 for x in a]),
        "first_token_p50_s_round_robin": mean([x.first_token_p50 for x in w]),
        "first_token_p99_s": mean([x.first_token_p99 for x in a]),
        "first_token_p99_s_round_robin": mean([x.first_token_p99 for x in w]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=24)
    args = parser.parse_args()
    seeds = range(args.seeds)
    variants: dict[str, dict[str, Any]] = {
        "defaults (load counted in work)": {},
        "load counted in requests (hit_cost 1)": {"hit_cost": 1.0},
        "plain affinity (no load score, no cap)": {"load_weight": 0.0, "bounded_load": 100.0},
    }
    for hot in (0.0, 0.5):
        for name, kwargs in variants.items():
            out = compare(affinity(**kwargs), seeds, hot=hot)
            print(f"{name}, hot prompt share {hot}:", {k: round(v, 3) for k, v in out.items()})


if __name__ == "__main__":
    main()

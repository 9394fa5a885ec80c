"""Head-of-line blocking by heavy constraint specs: small chat requests with and without a heavy client.

    tools/bazel run //bench:admission -- [--rounds N] [--phase-s S] [--json]

One paved server (`python -m paved.frontend.server`, //models/tiny, the engine flags of
//bench:frontend) serves two kinds of traffic. The *small load* is 8 closed-loop clients
sending non-streaming `/v1/chat/completions` with a short prompt and 8 output tokens
(ignore_eos). The *heavy client* sends, one at a time, chat requests whose constraint is
heavy but valid, cycling through three kinds, each spec distinct (the frontend memoizes specs
by digest and the engine caches compiles by key, so a repeated spec would measure nothing):

  * enum50k     `response_format` json_schema `{"enum": [50,000 fresh random strings]}`
                (lowered to paved's catalogue engine);
  * maxlength10 an object schema of ten `{"type": "string", "maxLength": 100}` properties
                whose names change per request;
  * regex       `vllm_xargs.paved_constraint` `{"type": "regex", "pattern": "x<n>(a|b)*a(a|b){14}"}`
                with a fresh literal prefix per request.

Each heavy response must be 200 with `x-paved-constraint-backend: paved` (anything else is a
failure of the bench: printed, counted, exit status 1).

Each round runs phase A (small load alone) and phase B (small load + heavy client) for
`--phase-s` seconds each, in alternating order (A,B then B,A ...) so a drifting background load
on a shared machine hits both alike. A heavy request in flight when phase B ends is awaited
before the next phase starts (its latency counts; no small request of the next phase overlaps
it). Heavy bodies are generated before their phase, outside the timed region.

Reported: p50/p99 latency of small requests per phase, pooled over all rounds; `hol_p99_ratio` =
pooled p99(B) / pooled p99(A) (the median of the per-round ratios is reported beside it as
`hol_p99_ratio_median_round`); mean small latency per phase beside the mean engine time of
vLLM's e2e and queue histograms over the same phase (from /metrics: whatever the client sees
beyond it is the frontend process and the loopback); per heavy kind the p50 admission latency of
its requests during phase B (`heavy_admit_ms_p50_<kind>`: heavy requests stream, so the response
headers arrive once the request is admitted: body upload and parse, the frontend's spec check,
the engine core's compile, the add to the batch; its 32 output tokens come after) and the
counts. After the rounds, with no small load: each kind's admission latency with a fresh spec
and with that same spec sent again (`heavy_idle_ms_p50_*`, `heavy_repeat_ms_p50_*`: the
difference is what the per-spec work costs), then, with the server stopped, the CPU cost of each
stage in this process on the same machine: JSON decoding + request validation of the body
(`stage_parse_ms_*`, done by the server on its event loop), the frontend's admission check
(`stage_resolve_ms_*`, on its admission pool) and the native compile against the tiny model's
vocabulary (`stage_compile_ms_*`, in the engine core). With --json the last stdout line is one
JSON object with every key.
"""

from paved.engine import vllm_env

# The server inherits these (offline, 1 GiB KV cache, no CPU pinning).
vllm_env.apply_defaults()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import aiohttp  # noqa: E402

from bench.frontend import _percentile, _session, _start  # noqa: E402  (same server, same flags)
from paved.runfiles import tiny_model_dir  # noqa: E402

SMALL_CONCURRENCY = 8
SMALL_TOKENS = 8
HEAVY_TOKENS = 32  # enough for the shortest output of every kind (budget-aware, no fallback)
KINDS = ("enum50k", "maxlength10", "regex")
ENUM_VALUES = 50_000
BACKEND_HEADER = "x-paved-constraint-backend"
SMALL_BODY = json.dumps(
    {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say hello to the new team."}],
        "max_tokens": SMALL_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }
).encode()


def heavy_body(kind: str, n: int, rng: random.Random) -> bytes:
    """A chat request whose constraint of `kind` no earlier request carried (`n` is unique)."""
    body: dict = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Pick one."}],
        "max_tokens": HEAVY_TOKENS,
        "temperature": 0,
        # Streamed: the response headers come once the request is admitted (spec checked,
        # compiled in the engine core, added to the batch), before its first token.
        "stream": True,
    }
    if kind == "enum50k":
        hexes = rng.randbytes(5 * ENUM_VALUES).hex()  # 10 random hex digits per value
        values = [f"{n}-{hexes[i : i + 10]}" for i in range(0, len(hexes), 10)]
        schema: dict = {"enum": values}
    elif kind == "maxlength10":
        props = {f"field{n}_{j}": {"type": "string", "maxLength": 100} for j in range(10)}
        schema = {"type": "object", "properties": props, "additionalProperties": False}
    else:
        pattern = f"x{n}(a|b)*a(a|b){{14}}"
        body["vllm_xargs"] = {"paved_constraint": {"type": "regex", "pattern": pattern}}
        return json.dumps(body).encode()
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": f"h{n}", "schema": schema}}
    return json.dumps(body).encode()


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.rng = random.Random(20240611)

    def bodies(self, count: int) -> list[tuple[str, bytes]]:
        """`count` fresh heavy bodies, the kinds in turn."""
        out = []
        for i in range(count):
            self.n += 1
            kind = KINDS[i % len(KINDS)]
            out.append((kind, heavy_body(kind, self.n, self.rng)))
        return out


async def small_request(session: aiohttp.ClientSession, url: str) -> float:
    started = time.perf_counter()
    async with session.post(
        url + "/v1/chat/completions", data=SMALL_BODY, headers={"content-type": "application/json"}
    ) as response:
        text = await response.text()
        if response.status != 200:
            raise RuntimeError(f"small request: HTTP {response.status}: {text[:500]}")
    elapsed = time.perf_counter() - started
    tokens = json.loads(text)["usage"]["completion_tokens"]
    if tokens != SMALL_TOKENS:
        raise RuntimeError(f"small request: {tokens} tokens instead of {SMALL_TOKENS}")
    return elapsed


async def heavy_request(session: aiohttp.ClientSession, url: str, kind: str, body: bytes) -> dict:
    """{"kind", "s" (until the response headers: admission), "total_s", "ok", ...}; a non-200,
    a backend other than paved or an error event in the stream is printed, not raised."""
    started = time.perf_counter()
    async with session.post(
        url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
    ) as response:
        admitted = time.perf_counter()
        text = await response.text()
        backend = response.headers.get(BACKEND_HEADER)
        status = response.status
    elapsed = time.perf_counter() - started
    lines = [line for line in text.splitlines() if line.startswith("data: ")]
    done = bool(lines) and lines[-1] == "data: [DONE]"
    errors = [line for line in lines[:-1] if line == "data: [DONE]" or "error" in json.loads(line[6:])]
    ok = status == 200 and backend == "paved" and done and not errors
    if not ok:
        print(
            f"  HEAVY FAILURE {kind}: HTTP {status}, {BACKEND_HEADER}={backend!r}, "
            f"[DONE] {done}: {(errors[0] if errors else text)[:400]}",
            file=sys.stderr,
            flush=True,
        )
    return {"kind": kind, "s": admitted - started, "total_s": elapsed, "ok": ok, "status": status}


async def phase(url: str, seconds: float, heavy: list[tuple[str, bytes]] | None, warn: bool = True) -> dict:
    """Small load for `seconds` (and the heavy client over `heavy`'s bodies, one at a time)."""
    small: list[float] = []
    heavies: list[dict] = []
    async with _session() as session:
        before = await engine_totals(session, url)
        deadline = time.perf_counter() + seconds

        async def small_worker() -> None:
            while time.perf_counter() < deadline:
                small.append(await small_request(session, url))

        async def heavy_client() -> None:
            for kind, body in heavy or ():
                if time.perf_counter() >= deadline:
                    return
                heavies.append(await heavy_request(session, url, kind, body))
            if heavy and warn:
                print("  note: the heavy client ran out of bodies before the phase ended", file=sys.stderr)

        # The heavy client's last request is awaited here too: it never overlaps the next phase.
        await asyncio.gather(heavy_client(), *(small_worker() for _ in range(SMALL_CONCURRENCY)))
        after = await engine_totals(session, url)
    return {"small": small, "heavy": heavies, "engine": {k: after[k] - before[k] for k in after}}


# Engine-side histograms (vLLM's, as paved's /metrics exports them): (sum, count) deltas per
# phase say how much of a small request's latency the engine core accounts for.
ENGINE_HISTOGRAMS = ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds")


async def engine_totals(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    totals = dict.fromkeys((f"{h}_{s}" for h in ENGINE_HISTOGRAMS for s in ("sum", "count")), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def _ms(values: list[float], q: int) -> float:
    return round(1000 * _percentile(values, q), 2) if values else float("nan")


async def measure(args: argparse.Namespace, model: str) -> dict:
    server, ready_path = _start("paved", model)
    try:
        async with _session() as session:
            await server.wait_ready(session, ready_path)
        counter = Counter()
        # Warm-up, not measured: first forward passes, the first compile of each kind.
        await phase(server.url, 10, counter.bodies(len(KINDS)), warn=False)
        rounds = []
        for r in range(args.rounds):
            result: dict[str, dict] = {}
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                bodies = counter.bodies(args.heavy_max) if name == "B" else None
                result[name] = await phase(server.url, args.phase_s, bodies)
                small, heavy = result[name]["small"], result[name]["heavy"]
                print(
                    f"  round {r + 1}/{args.rounds} {name}: {len(small)} small, "
                    f"p50 {_ms(small, 50):.1f} ms, p99 {_ms(small, 99):.1f} ms"
                    + (f"; {len(heavy)} heavy ({sum(h['ok'] for h in heavy)} ok)" if name == "B" else ""),
                    file=sys.stderr,
                    flush=True,
                )
            rounds.append(result)
        # No small load: each kind fresh, then the very same body again (memoized admission).
        idle: dict[str, dict[str, list]] = {kind: {"fresh": [], "repeat": []} for kind in KINDS}
        async with _session() as session:
            for kind, body in counter.bodies(3 * len(KINDS)):
                idle[kind]["fresh"].append(await heavy_request(session, server.url, kind, body))
                idle[kind]["repeat"].append(await heavy_request(session, server.url, kind, body))
        return {"rounds": rounds, "idle": idle, "log": server.log.name}
    finally:
        server.stop()


def stage_costs(model: str, repeats: int) -> dict[str, dict[str, float]]:
    """Median ms per stage and kind, in this process (server stopped): what each stage costs
    in CPU on this machine, without the server's queueing."""
    from transformers import AutoTokenizer

    from paved.constraints import Vocab
    from paved.constraints.compiler import compile_spec
    from paved.constraints.vocab import token_bytes
    from paved.engine.protocol import ModelCard
    from paved.frontend import structured
    from paved.frontend.schemas import ChatCompletionRequest

    tok = AutoTokenizer.from_pretrained(model)
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(model, "generation_config.json")) as f:
        eos = json.load(f).get("eos_token_id", tok.eos_token_id)
    eos_ids = sorted({int(e) for e in (eos if isinstance(eos, list) else [eos])})
    vocab = Vocab(token_bytes(tok), eos_ids, config["vocab_size"])
    card = ModelCard("tiny", "generate", 2048, 0, constraint_backends=("paved", "xgrammar"))
    counter = Counter()
    counter.n = 10**6  # names unlike the server run's (this process's caches are fresh anyway)
    times: dict[str, dict[str, list[float]]] = {k: {"parse": [], "resolve": [], "compile": []} for k in KINDS}
    for kind, body in counter.bodies(repeats * len(KINDS)):
        t0 = time.perf_counter()
        request = ChatCompletionRequest.model_validate(json.loads(body))
        t1 = time.perf_counter()
        resolved = structured.resolve(request, card)
        t2 = time.perf_counter()
        assert resolved.constraint is not None and resolved.constraint.backend == "paved", kind
        compile_spec(vocab, resolved.constraint.value)
        t3 = time.perf_counter()
        for stage, dt in (("parse", t1 - t0), ("resolve", t2 - t1), ("compile", t3 - t2)):
            times[kind][stage].append(dt)
    return {k: {s: round(1000 * statistics.median(v), 2) for s, v in st.items()} for k, st in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs phase A and phase B")
    parser.add_argument("--phase-s", type=float, default=20.0, help="seconds per phase")
    parser.add_argument(
        "--heavy-max", type=int, default=60, help="heavy bodies generated per phase B (upper bound)"
    )
    parser.add_argument("--stage-repeats", type=int, default=3, help="in-process stage timings per kind")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    # SIGTERM/SIGHUP unwind like Ctrl-C, so the server's process group is always stopped.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)

    model = tiny_model_dir()
    load_start = os.getloadavg()
    run = asyncio.run(measure(args, model))
    load_end = os.getloadavg()
    stages = stage_costs(model, args.stage_repeats)

    rounds = run["rounds"]
    small = {p: [s for r in rounds for s in r[p]["small"]] for p in ("A", "B")}
    heavy = [h for r in rounds for h in r["B"]["heavy"]]
    failures = [h for h in heavy if not h["ok"]]
    failures += [h for kind in KINDS for v in run["idle"][kind].values() for h in v if not h["ok"]]
    per_round = [_percentile(r["B"]["small"], 99) / _percentile(r["A"]["small"], 99) for r in rounds]
    summary: dict[str, float | int | str | bool | list] = {
        "rounds": args.rounds,
        "phase_s": args.phase_s,
        "cpu_count": os.cpu_count() or 0,
        "loadavg_1m_start": round(load_start[0], 2),
        "loadavg_1m_end": round(load_end[0], 2),
        "hol_p99_ratio": round(_percentile(small["B"], 99) / _percentile(small["A"], 99), 3),
        "hol_p99_ratio_median_round": round(statistics.median(per_round), 3),
        "hol_p99_ratio_per_round": [round(x, 3) for x in per_round],
        "hol_p50_ratio": round(_percentile(small["B"], 50) / _percentile(small["A"], 50), 3),
        "heavy_failures": len(failures),
    }
    for p in ("A", "B"):
        # Mean engine time (vLLM's e2e and queue histograms; phase B's include the few heavy
        # requests) vs the client's mean: the rest is the frontend process and the loopback.
        engine = {k: sum(r[p]["engine"][k] for r in rounds) for k in rounds[0][p]["engine"]}
        for h, key in zip(ENGINE_HISTOGRAMS, ("engine_e2e", "engine_queue"), strict=True):
            total, count = engine[f"{h}_sum"], engine[f"{h}_count"]
            summary[f"{key}_ms_mean_{p.lower()}"] = round(1000 * total / count, 2) if count else -1
        summary[f"small_ms_mean_{p.lower()}"] = round(1000 * statistics.fmean(small[p]), 2)
        summary[f"small_requests_{p.lower()}"] = len(small[p])
        summary[f"small_ms_p50_{p.lower()}"] = _ms(small[p], 50)
        summary[f"small_ms_p99_{p.lower()}"] = _ms(small[p], 99)
    print(
        f"\nsmall: /v1/chat/completions, {SMALL_TOKENS} tokens, concurrency {SMALL_CONCURRENCY}; "
        f"{args.rounds} rounds x {args.phase_s:g} s per phase; load {load_start[0]:.2f} -> {load_end[0]:.2f}"
    )
    print(
        f"{'phase':28} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} "
        f"{'engine e2e':>10} {'queue':>8}  (engine: mean ms, vLLM histograms)"
    )
    for p, label in (("A", "A: small only"), ("B", "B: small + heavy client")):
        q = p.lower()
        print(
            f"{label:28} {len(small[p]):8d} {_ms(small[p], 50):8.1f} {_ms(small[p], 99):8.1f} "
            f"{summary[f'small_ms_mean_{q}']:8.1f} {summary[f'engine_e2e_ms_mean_{q}']:10.1f} "
            f"{summary[f'engine_queue_ms_mean_{q}']:8.1f}"
        )
    print(
        f"hol_p99_ratio {summary['hol_p99_ratio']} (pooled; per round {summary['hol_p99_ratio_per_round']}, "
        f"target <= 1.5)"
    )
    print(
        f"\n{'heavy kind':12} {'n ok/sent':>9} {'p50 ms B':>9} {'idle ms':>8} {'repeat ms':>9} "
        f"{'parse ms':>8} {'resolve':>8} {'compile':>8}"
    )
    for kind in KINDS:
        mine = [h for h in heavy if h["kind"] == kind]
        ok = [h["s"] for h in mine if h["ok"]]
        fresh = [h["s"] for h in run["idle"][kind]["fresh"]]
        repeat = [h["s"] for h in run["idle"][kind]["repeat"]]
        summary[f"heavy_admit_ms_p50_{kind}"] = _ms(ok, 50)
        summary[f"heavy_ok_{kind}"] = len(ok)
        summary[f"heavy_sent_{kind}"] = len(mine)
        summary[f"heavy_idle_ms_p50_{kind}"] = _ms(fresh, 50)
        summary[f"heavy_repeat_ms_p50_{kind}"] = _ms(repeat, 50)
        for stage, value in stages[kind].items():
            summary[f"stage_{stage}_ms_{kind}"] = value
        print(
            f"{kind:12} {len(ok):>4}/{len(mine):<4} {_ms(ok, 50):9.1f} {_ms(fresh, 50):8.1f} "
            f"{_ms(repeat, 50):9.1f} {stages[kind]['parse']:8.1f} {stages[kind]['resolve']:8.1f} "
            f"{stages[kind]['compile']:8.1f}"
        )
    print(f"server log: {run['log']}")
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

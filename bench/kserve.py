"""XGBoost scoring through paved's KServe v2 gRPC server: transport overhead and dynamic batching.

    tools/bazel run //bench:kserve -- [--quick] [--json] [--concurrency 32] [--model-dir DIR ...]

Models: //models/xgb:bench (1500 trees of depth 8, the headline numbers) and the test fixture
//models/xgb (300 trees of depth 6). For each, a server runs in its own process (as in
production, so client and server do not share a GIL) with two copies of the booster:
`batched` (the fixture's config: max_batch_size 64, preferred 32/64, 500 us queue delay) and
`unbatched` (the same without dynamic_batching: Triton's default scheduler, one predict call
per request). Both have one instance and one predict thread, so the comparison isolates
batching.

One 32-feature row per request, from a lean KServe v2 client (raw gRPC stub):
  overhead   concurrency 1: median gRPC request latency vs median in-process
             `Booster.inplace_predict` of the same row (ratio = gRPC / in-process);
  batching   concurrency C (default 32): requests/s batched vs unbatched
             (batching_gain_c32 = batched / unbatched); the server reports its batch sizes;
  ceiling    the same through `DynamicBatcher` in this process, without any transport.
Every response is checked against in-process predictions (exact float32 equality). Runs are
interleaved and the median of --repeats is reported; the machine's load average is printed,
since on a shared machine it moves the absolute numbers. With --json the last stdout line
is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from bench.kserve_drive import drive

FEATURES = 32
INPUT = "input__0"  # //models/xgb's input tensor


def _runfile_dir(path: str) -> str:
    from paved.runfiles import runfile

    return os.path.dirname(runfile(path))


def _model_root(source: str) -> str:
    """Two model directories over the same booster: batched (as configured) and unbatched."""
    root = tempfile.mkdtemp(prefix="paved-bench-kserve-")
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    for name in ("batched", "unbatched"):
        d = os.path.join(root, name)
        os.makedirs(d)
        shutil.copy(os.path.join(source, "model.ubj"), d)
        c = dict(config, name=name)
        if name == "unbatched":
            c.pop("dynamic_batching", None)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f)
    return root


# ---- server process -------------------------------------------------------------------------
def _serve(root: str, conn) -> None:
    """Child process: serve both models on a free port, report it, run until told to stop,
    then send back the batch sizes each model dispatched."""

    async def main() -> None:
        from paved.kserve.server import serve_kserve

        server = await serve_kserve(
            [],
            grpc_port=0,
            http_port=None,
            host="127.0.0.1",
            model_dirs=[os.path.join(root, "batched"), os.path.join(root, "unbatched")],
        )
        await server.wait_ready(120)
        conn.send(server.grpc_port)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, conn.recv)  # the parent's "stop"
        stats = {name: dict(server.repository.get(name).batcher.batches) for name in ("batched", "unbatched")}
        await server.stop(grace_s=1)
        conn.send(stats)

    asyncio.run(main())


def _in_process_latency(booster, x: np.ndarray, repeats: int) -> float:
    times = []
    for r in range(repeats):
        row = x[r % len(x) : r % len(x) + 1]
        start = time.perf_counter()
        booster.inplace_predict(row)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _in_process_batching(
    booster, x: np.ndarray, config: dict, concurrency: int, total: int
) -> dict[str, float]:
    """Predictions/s through `DynamicBatcher` alone (no transport), coalescing on vs off: the
    ceiling the gRPC numbers are measured against."""
    from paved.kserve.batcher import DynamicBatcher

    batching = config["dynamic_batching"]

    async def run(coalesce: bool) -> float:
        batcher = DynamicBatcher(
            booster.inplace_predict,
            name="bench",
            max_batch_size=config["max_batch_size"],
            max_queue_delay_s=batching["max_queue_delay_microseconds"] / 1e6,
            preferred_batch_sizes=batching["preferred_batch_size"],
            coalesce=coalesce,
        )
        next_index = 0

        async def worker() -> None:
            nonlocal next_index
            while next_index < total:
                i = next_index % len(x)
                next_index += 1
                await batcher.submit(x[i : i + 1])

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
        await batcher.close()
        return total / seconds

    return {"batched": asyncio.run(run(True)), "unbatched": asyncio.run(run(False))}


def measure(source: str, args: argparse.Namespace) -> dict:
    """Overhead and batching numbers for one model directory (its own server process)."""
    import xgboost

    root = _model_root(source)
    booster = xgboost.Booster(model_file=os.path.join(source, "model.ubj"))
    booster.set_param({"nthread": 1})
    x = np.random.default_rng(7).standard_normal((512, FEATURES)).astype(np.float32)
    expected = np.stack([booster.inplace_predict(x[i : i + 1])[0] for i in range(len(x))])
    c = args.concurrency

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(root, child), daemon=True)
    server.start()
    try:
        if not parent.poll(180):
            raise RuntimeError("the KServe server did not start")
        url = f"127.0.0.1:{parent.recv()}"

        async def run() -> dict:
            out: dict = {}
            for model in ("batched", "unbatched"):  # warm up both paths
                await drive(url, model, x, expected, c, 400, input_name=INPUT)
            _, latencies = await drive(
                url, "batched", x, expected, 1, max(args.requests // 8, 200), input_name=INPUT
            )
            out["grpc_p50_us"] = statistics.median(latencies) * 1e6
            out["grpc_p99_us"] = float(np.percentile(latencies, 99) * 1e6)
            # Interleaved, so drifting background load on a shared machine hits both alike.
            rates: dict[str, list[float]] = {"batched": [], "unbatched": []}
            p99s: dict[str, list[float]] = {"batched": [], "unbatched": []}
            for _ in range(args.repeats):
                for model in rates:
                    seconds, latencies = await drive(
                        url, model, x, expected, c, args.requests, input_name=INPUT
                    )
                    rates[model].append(args.requests / seconds)
                    p99s[model].append(float(np.percentile(latencies, 99) * 1e3))
            for model in rates:
                out[f"{model}_rps"] = statistics.median(rates[model])
                out[f"{model}_p99_ms"] = statistics.median(p99s[model])
            return out

        results = asyncio.run(run())
        parent.send("stop")
        batches = parent.recv() if parent.poll(30) else {}
    finally:
        server.join(30)
        if server.is_alive():
            server.kill()
        shutil.rmtree(root, ignore_errors=True)

    in_process_us = _in_process_latency(booster, x, 1000) * 1e6
    sizes = batches.get("batched", {})
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    local = _in_process_batching(booster, x, config, c, max(args.requests // 2, 400))
    return {
        "model": config["name"],
        "trees": booster.num_boosted_rounds() * len(expected[0]),
        "in_process_predict_p50_us": round(in_process_us, 1),
        "grpc_p50_us": round(results["grpc_p50_us"], 1),
        "grpc_p99_us": round(results["grpc_p99_us"], 1),
        "grpc_overhead_ratio": round(results["grpc_p50_us"] / in_process_us, 2),
        f"batched_rps_c{c}": round(results["batched_rps"], 1),
        f"unbatched_rps_c{c}": round(results["unbatched_rps"], 1),
        f"batched_p99_ms_c{c}": round(results["batched_p99_ms"], 2),
        f"unbatched_p99_ms_c{c}": round(results["unbatched_p99_ms"], 2),
        f"batching_gain_c{c}": round(results["batched_rps"] / results["unbatched_rps"], 2),
        "mean_batch_rows": round(sum(k * v for k, v in sizes.items()) / max(sum(sizes.values()), 1), 1),
        f"in_process_batched_per_s_c{c}": round(local["batched"], 1),
        f"in_process_unbatched_per_s_c{c}": round(local["unbatched"], 1),
        f"in_process_batching_gain_c{c}": round(local["batched"] / local["unbatched"], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-dir",
        action="append",
        help="XGBoost model directory, repeatable (default: //models/xgb:bench, then //models/xgb); "
        "the headline numbers are the first one's",
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=4000, help="requests per throughput run")
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs per configuration (median)")
    parser.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeats = 800, 1
    sources = args.model_dir or [
        _runfile_dir("models/xgb/bench/config.json"),
        _runfile_dir("models/xgb/config.json"),
    ]

    c = args.concurrency
    load_before = os.getloadavg()[0]
    per_model = []
    for source in sources:
        r = measure(source, args)
        per_model.append(r)
        print(f"{r['model']} ({r['trees']} trees, one row per request)")
        print(
            "  concurrency 1: gRPC p50 {grpc_p50_us:.0f} us (p99 {grpc_p99_us:.0f} us) vs in-process predict "
            "{in_process_predict_p50_us:.0f} us -> overhead x{grpc_overhead_ratio}".format(**r)
        )
        batched, unbatched = r[f"batched_rps_c{c}"], r[f"unbatched_rps_c{c}"]
        print(
            f"  concurrency {c}: batched {batched:.0f} req/s (p99 {r[f'batched_p99_ms_c{c}']} ms, mean batch "
            f"{r['mean_batch_rows']} rows), unbatched {unbatched:.0f} req/s "
            f"(p99 {r[f'unbatched_p99_ms_c{c}']} ms) -> batching gain x{r[f'batching_gain_c{c}']}",
            flush=True,
        )
        print(
            f"  without transport (DynamicBatcher in process, c={c}): "
            f"{r[f'in_process_batched_per_s_c{c}']:.0f} vs {r[f'in_process_unbatched_per_s_c{c}']:.0f} "
            f"predictions/s -> x{r[f'in_process_batching_gain_c{c}']}",
            flush=True,
        )
    head = per_model[0]
    summary = {
        f"batching_gain_c{c}": head[f"batching_gain_c{c}"],
        "grpc_overhead_ratio": head["grpc_overhead_ratio"],
        "models": per_model,
        "concurrency": c,
        "requests": args.requests,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(
        f"machine: {os.cpu_count()} CPUs, 1-minute load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

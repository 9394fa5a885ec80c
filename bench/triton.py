"""paved's KServe server against the real Triton Inference Server on one model repository.

    tools/bazel run //bench:triton -- [--requests N] [--repeats R] [--quick] [--json]
                                      [--baseline-src DIR] [--null-server] [--aio-null-server]

Triton: nvidia-pytriton's `tritonserver` 2.51 with its Python backend, from .venv-triton
(libs/tests/kserve/triton_server.py). paved: `paved.kserve.main --model-repository`, a process.
Both serve the same repository, written to a temp dir:

  batched      a python-backend model (`model.py` with TritonPythonModel) doing row-wise numpy
               pre-processing on 32 FP32 features; execute() stacks every request it is given
               and runs once, as a batched Triton python model does. max_batch_size 64, dynamic
               batching (500 us, preferred 32/64), one instance.
  xgb_python   the same config, its model.py loading //models/xgb's booster with xgboost
               (Triton's stub imports it from .venv-triton) and predicting the stacked rows:
               XGBoost served the way a Triton deployment without FIL does.
  xgb_native   the same booster on paved's native XGBoost backend (Triton's wheel has no FIL
               backend: paved only).

One row per request from a lean KServe v2 gRPC client (raw stubs, requests serialized up front,
the same for both servers). Every answer is checked against the model evaluated in this process
(bit-equal). Concurrency 1 gives latency percentiles; concurrency 32 throughput. Runs alternate
between the servers (both stay up), the median of --repeats is reported, and the machine's
load average is printed since on a shared machine it moves absolute numbers.

Keys (python model `batched` unless named):
  throughput_ratio_vs_triton_c32                 paved req/s / Triton req/s at c32 (goal >= 1.5)
  p99_ratio_vs_triton_c1                         paved p99 / Triton p99 at c1 (goal <= 1.0)
  throughput_ratio_vs_triton_c32_xgboost_python  xgb_python on both
  throughput_ratio_vs_triton_c32_xgboost_native  paved's xgb_native / Triton's xgb_python
  p50_ratio_vs_triton_c1                         paved p50 / Triton p50 at c1 (steadier than p99)
  inside_server_ratio_vs_triton_c1               the request's time inside each server at c1, as
                                                 its ModelStatistics count it (no transport)
With --baseline-src DIR (another paved tree, e.g. `git archive OLD libs/paved | tar -x -C DIR`)
that tree's server runs beside paved's in the same run, and its ratios are reported under
"baseline". With --null-server a third gRPC server that does no work at all (null_grpc_server.cc,
C++, built here with g++ and gRPC's C++ library, Debian's libgrpc++-dev) is measured at c32 in
the same run: `null_server_ratio_vs_triton_c32` is the ceiling of every throughput ratio on
this machine, what the load generator reaches against a server that costs nothing. With
--aio-null-server a Python gRPC server (grpc.aio, paved's runtime; aio_null_server.py) that does
no work is measured the same way, at c1 and c32: `aio_null_server_ratio_vs_triton_c32` and
`aio_null_server_p99_ratio_vs_triton_c1` bound what any server on Python's gRPC runtime, paved's
included, could reach here.
With --json the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.kserve_drive import drive
from libs.tests.kserve.triton_server import paved_kserve_server, triton_server

FEATURES = 32
# The servers that do no work (measured on `batched`'s traffic only).
NULLS = ("null", "aio_null")
BATCHING = """max_batch_size: 64
dynamic_batching {{ max_queue_delay_microseconds: 500 preferred_batch_size: [ 32, 64 ] }}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ {features} ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ {outputs} ] }} ]
"""
# Row-wise arithmetic only (no reductions, no BLAS): the answer for a row is the same bits
# whatever batch it travels in, on numpy 1 (Triton's stub) and numpy 2 (paved) alike.
PREPROCESS = """
MEAN = np.linspace(-1.0, 1.0, 32, dtype=np.float32)
STD = np.linspace(0.5, 2.0, 32, dtype=np.float32)


def preprocess(x):
    z = np.clip((x - MEAN) / STD, np.float32(-3), np.float32(3))
    return (z * np.float32(0.75) + x * x * np.float32(0.01)).astype(np.float32)
"""
MODEL_PY = """import numpy as np
import triton_python_backend_utils as pb_utils
{preamble}

class TritonPythonModel:
    def initialize(self, args):
        {initialize}

    def execute(self, requests):
        rows = [pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy() for r in requests]
        out = {compute}(np.concatenate(rows))
        responses, start = [], 0
        for row in rows:
            part = out[start : start + len(row)]
            start += len(row)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", part)]))
        return responses
"""


def _xgb_dir(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    with contextlib.suppress(Exception):
        from paved.runfiles import runfile

        return Path(runfile("models/xgb/config.json")).parent
    # A plain `python bench/triton.py` from the workspace after a build.
    built = Path(__file__).resolve().parent.parent / "bazel-bin" / "models" / "xgb"
    if (built / "model.ubj").is_file():
        return built
    raise SystemExit("triton bench: no //models/xgb booster: pass --xgb-dir (a folder with model.ubj)")


def write_repository(root: Path, booster: Path, outputs: int) -> None:
    def model(name: str, config: str, files: dict[str, str | Path]) -> None:
        version = root / name / "1"
        version.mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\n{config}')
        for filename, content in files.items():
            if isinstance(content, Path):
                shutil.copy(content, version / filename)
            else:
                (version / filename).write_text(content)

    model(
        "batched",
        'backend: "python"\n' + BATCHING.format(features=FEATURES, outputs=FEATURES),
        {"model.py": MODEL_PY.format(preamble=PREPROCESS, initialize="pass", compute="preprocess")},
    )
    model(
        "xgb_python",
        'backend: "python"\n' + BATCHING.format(features=FEATURES, outputs=outputs),
        {
            "model.py": MODEL_PY.format(
                preamble="import os\n\nimport xgboost\n",
                initialize="path = os.path.join(args['model_repository'], args['model_version'], "
                "'model.ubj')\n"
                "        self.booster = xgboost.Booster(model_file=path)\n"
                "        self.booster.set_param({'nthread': 1})",
                compute="self.booster.inplace_predict",
            ),
            "model.ubj": booster,
        },
    )
    model(
        "xgb_native",
        'backend: "xgboost"\n'
        + BATCHING.format(features=FEATURES, outputs=outputs)
        + 'parameters { key: "nthread" value: { string_value: "1" } }\n'
        + 'parameters { key: "predict_type" value: { string_value: "value" } }\n',
        {"model.ubj": booster},
    )


def _expected(x: np.ndarray, booster_file: Path) -> dict[str, np.ndarray]:
    import xgboost

    namespace: dict = {"np": np}
    exec(PREPROCESS, namespace)  # noqa: S102 (the bench's own model code, the same text both servers run)
    booster = xgboost.Booster(model_file=str(booster_file))
    booster.set_param({"nthread": 1})
    scores = np.stack([booster.inplace_predict(x[i : i + 1])[0] for i in range(len(x))]).astype(np.float32)
    return {"batched": namespace["preprocess"](x), "xgb_python": scores, "xgb_native": scores}


async def _wait_ready(url: str, models: list[str], timeout_s: float) -> None:
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(url)
    try:
        deadline = time.monotonic() + timeout_s
        for model in models:
            while not await client.is_model_ready(model):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{model} at {url} is not ready after {timeout_s:.0f} s")
                await asyncio.sleep(0.1)
    finally:
        await client.close()


def _group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) the live processes of process group `pgid` have used."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # The command name (field 2) may hold spaces: the fields after it are split.
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[2]) == pgid:  # pgrp; utime and stime follow at 11 and 12
            total += int(fields[11]) + int(fields[12])
    return total / tick


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _null_answer(tmp: Path) -> Path:
    """The answer every call to a null server gets: one FP32 1.0, what the bench expects of it."""
    from tritonclient.grpc import service_pb2

    response = service_pb2.ModelInferResponse(model_name="batched", model_version="1")
    response.outputs.add(name="OUTPUT", datatype="FP32", shape=[1, 1])
    response.raw_output_contents.append(np.ones((1, 1), np.float32).tobytes())
    answer = tmp / "null_response.bin"
    answer.write_bytes(response.SerializeToString())
    return answer


@contextlib.contextmanager
def _listening(command: list[str], name: str, env: dict[str, str] | None = None):
    """Starts `command` (a server printing "listening on 127.0.0.1:PORT") in a session of its
    own; yields (url, pgid); kills its process group on exit."""
    import signal
    import subprocess

    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "listening on 127.0.0.1:PORT", or EOF if it failed
        if not line.startswith("listening on "):
            raise SystemExit(f"{name} did not start (exit {proc.poll()})")
        yield line.split()[-1], proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def null_server(tmp: Path, threads: int):
    """Builds and starts null_grpc_server.cc on a free loopback port; yields (url, pgid)."""
    import subprocess

    source = Path(__file__).resolve().parent / "null_grpc_server.cc"
    gxx, pkg_config = shutil.which("g++"), shutil.which("pkg-config")
    flags = None
    if gxx and pkg_config:
        flags = subprocess.run(
            [pkg_config, "--cflags", "--libs", "grpc++"], capture_output=True, text=True, timeout=30
        )
    if flags is None or flags.returncode != 0:
        raise SystemExit(
            "--null-server needs g++, pkg-config and gRPC's C++ library "
            "(Debian: apt-get install g++ pkg-config libgrpc++-dev)"
        )
    binary = tmp / "null_grpc_server"
    subprocess.run(
        [gxx, "-O2", "-std=c++17", str(source), "-o", str(binary), *flags.stdout.split()],
        check=True,
        timeout=600,
    )
    with _listening([str(binary), "0", str(_null_answer(tmp)), str(threads)], "null_grpc_server") as got:
        yield got


def aio_null_server(tmp: Path):
    """Starts aio_null_server.py (grpc.aio doing no work) on a free loopback port; a context
    yielding (url, pgid)."""
    source = Path(__file__).resolve().parent / "aio_null_server.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return _listening([sys.executable, str(source), str(_null_answer(tmp))], "aio_null_server", env)


# The stages of a request each server reports in its statistics (KServe v2's statistics
# extension, Triton's fields): the whole request as the server saw it, its wait for a batch,
# the model's execution.
_STAGES = ("success", "queue", "compute_infer")


def _statistics(url: str, model: str) -> dict[str, tuple[int, int]]:
    """{stage: (count, ns)} from the server's ModelStatistics for `model`."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=model), timeout=30)
    inference = reply.model_stats[0].inference_stats
    return {k: (getattr(inference, k).count, getattr(inference, k).ns) for k in _STAGES}


def _per_request(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Microseconds per request spent in each stage between two readings."""
    n = max(1, after["success"][0] - before["success"][0])
    return {k: (after[k][1] - before[k][1]) / n / 1e3 for k in _STAGES}


def measure(
    urls: dict[str, str], pgids: dict[str, int], x: np.ndarray, expected: dict, args: argparse.Namespace
) -> dict:
    """{(server, model): {p50_us_c1, p99_us_c1, rps_c32, p99_ms_c32, server_cpu_us_c32,
    client_cpu_us_c32}} with runs interleaved; the CPU figures are per request, the server's
    process group (workers and stubs included) and this process (the load generator)."""
    paveds = [server for server in urls if server not in ("triton", *NULLS)]
    pairs = [(server, model) for model in ("batched", "xgb_python") for server in (*paveds, "triton")]
    pairs += [(server, "xgb_native") for server in paveds]
    pairs += [(server, "batched") for server in NULLS if server in urls]
    c = args.concurrency

    def want(server: str, model: str) -> np.ndarray:
        return np.ones((len(x), 1), np.float32) if server in NULLS else expected[model]

    async def run() -> dict:
        for server, model in pairs:  # warm-up: first requests, stubs' imports, batcher threads
            await drive(urls[server], model, x, want(server, model), c, 200, input_name="INPUT")
        keys = ("c1", "rps", "p99c", "server_cpu", "client_cpu", "inside")
        samples: dict = {p: {k: [] for k in keys} for p in pairs}
        for _ in range(args.repeats):
            for pair in pairs:
                server, model = pair
                before = _statistics(urls[server], model) if server not in NULLS else None
                _, latencies = await drive(
                    urls[server], model, x, want(server, model), 1, args.requests_c1, input_name="INPUT"
                )
                if before is not None:
                    samples[pair]["inside"].append(_per_request(before, _statistics(urls[server], model)))
                samples[pair]["c1"].extend(latencies)
                server_cpu, client_cpu = _group_cpu_s(pgids[server]), _self_cpu_s()
                seconds, latencies = await drive(
                    urls[server], model, x, want(server, model), c, args.requests, input_name="INPUT"
                )
                samples[pair]["server_cpu"].append((_group_cpu_s(pgids[server]) - server_cpu) / args.requests)
                samples[pair]["client_cpu"].append((_self_cpu_s() - client_cpu) / args.requests)
                samples[pair]["rps"].append(args.requests / seconds)
                samples[pair]["p99c"].append(float(np.percentile(latencies, 99)))
        out = {}
        for pair, s in samples.items():
            inside = {
                f"server_{k}_us_c1": round(statistics.median(run[k] for run in s["inside"]), 1)
                for k in _STAGES
            } if s["inside"] else {}  # fmt: skip
            out[pair] = {
                "p50_us_c1": round(statistics.median(s["c1"]) * 1e6, 1),
                "p99_us_c1": round(float(np.percentile(s["c1"], 99)) * 1e6, 1),
                **inside,
                f"rps_c{c}": round(statistics.median(s["rps"]), 1),
                f"p99_ms_c{c}": round(statistics.median(s["p99c"]) * 1e3, 2),
                f"server_cpu_us_c{c}": round(statistics.median(s["server_cpu"]) * 1e6, 1),
                f"client_cpu_us_c{c}": round(statistics.median(s["client_cpu"]) * 1e6, 1),
            }
        return out

    return asyncio.run(run())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--xgb-dir", help="folder with the booster model.ubj (default: //models/xgb)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=2000, help="requests per throughput run")
    parser.add_argument("--requests-c1", type=int, default=300, help="requests per concurrency-1 run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per server and model (median)")
    parser.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    parser.add_argument(
        "--null-server",
        action="store_true",
        help="also measure a C++ gRPC server that does no work (the ceiling on this machine; "
        "needs g++ and libgrpc++-dev)",
    )
    parser.add_argument(
        "--aio-null-server",
        action="store_true",
        help="also measure a Python gRPC server (grpc.aio, as paved's) that does no work: the "
        "floor of any server on Python's gRPC runtime",
    )
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="another paved source tree (e.g. `git archive` of an older commit) served as a third "
        "server, 'baseline', in the same run: its ratios are reported beside paved's",
    )
    args = parser.parse_args()
    for flag in ("concurrency", "requests", "requests_c1", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.baseline_src is not None and not (args.baseline_src / "libs" / "paved" / "kserve").is_dir():
        parser.error(f"--baseline-src {args.baseline_src}: no libs/paved/kserve there")
    if args.quick:
        args.requests, args.requests_c1, args.repeats = 400, 100, 1
    booster = _xgb_dir(args.xgb_dir) / "model.ubj"
    if not booster.is_file():
        raise SystemExit(f"triton bench: {booster} not found")
    x = np.random.default_rng(11).standard_normal((512, FEATURES)).astype(np.float32)
    expected = _expected(x, booster)
    outputs = expected["xgb_python"].shape[1]
    c = args.concurrency
    load_before = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="paved-bench-triton-"))
    try:
        repository = tmp / "repository"
        write_repository(repository, booster, outputs)
        quiet = ["--log-level", "warning"]
        with contextlib.ExitStack() as servers:
            triton = servers.enter_context(
                triton_server(repository, tmp / "triton", models=["batched", "xgb_python"])
            )
            paved = servers.enter_context(paved_kserve_server(repository, tmp / "paved", extra_args=quiet))
            urls, pgids = {"paved": paved.grpc}, {"paved": paved.pgid, "triton": triton.pgid}
            if args.baseline_src is not None:
                baseline = paved_kserve_server(
                    repository, tmp / "baseline", extra_args=quiet, source=args.baseline_src
                )
                started = servers.enter_context(baseline)
                urls["baseline"], pgids["baseline"] = started.grpc, started.pgid
            urls["triton"] = triton.grpc
            if args.null_server:
                urls["null"], pgids["null"] = servers.enter_context(null_server(tmp, os.cpu_count() or 2))
            if args.aio_null_server:
                urls["aio_null"], pgids["aio_null"] = servers.enter_context(aio_null_server(tmp))
            for server in urls:
                if server not in ("triton", *NULLS):
                    asyncio.run(_wait_ready(urls[server], ["batched", "xgb_python", "xgb_native"], 120))
            results = measure(urls, pgids, x, expected, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def ratio(a: float, b: float) -> float:
        return round(a / b, 2)

    def ratios(server: str) -> dict[str, float]:
        pb, tb = results[(server, "batched")], results[("triton", "batched")]
        px, tx = results[(server, "xgb_python")], results[("triton", "xgb_python")]
        nx = results[(server, "xgb_native")]
        return {
            f"throughput_ratio_vs_triton_c{c}": ratio(pb[f"rps_c{c}"], tb[f"rps_c{c}"]),
            "p99_ratio_vs_triton_c1": ratio(pb["p99_us_c1"], tb["p99_us_c1"]),
            f"throughput_ratio_vs_triton_c{c}_xgboost_python": ratio(px[f"rps_c{c}"], tx[f"rps_c{c}"]),
            f"throughput_ratio_vs_triton_c{c}_xgboost_native": ratio(nx[f"rps_c{c}"], tx[f"rps_c{c}"]),
            "p99_ratio_vs_triton_c1_xgboost_python": ratio(px["p99_us_c1"], tx["p99_us_c1"]),
            "p50_ratio_vs_triton_c1": ratio(pb["p50_us_c1"], tb["p50_us_c1"]),
            # The request as each server's own statistics time it (decode to response, not the
            # transport): where the c1 gap is, inside the server or around it.
            "inside_server_ratio_vs_triton_c1": ratio(pb["server_success_us_c1"], tb["server_success_us_c1"]),
            f"server_cpu_per_request_ratio_vs_triton_c{c}": ratio(
                pb[f"server_cpu_us_c{c}"], tb[f"server_cpu_us_c{c}"]
            ),
        }

    # What the machine allows: the load generator's own CPU per request (this process, against
    # Triton) bounds what any server could be measured at here, however cheap it were.
    tb = results[("triton", "batched")]
    goal_rps = 1.5 * tb[f"rps_c{c}"]
    client_cores_at_goal = goal_rps * tb[f"client_cpu_us_c{c}"] / 1e6

    # What the load generator reaches against servers that cost nothing (C++), or nothing but
    # Python's gRPC runtime (grpc.aio): no server's ratio can be measured above the first on
    # this machine, nor a grpc.aio server's above the second.
    ceiling = {}
    for server, key in (("null", "null_server"), ("aio_null", "aio_null_server")):
        if (server, "batched") in results:
            floor = results[(server, "batched")]
            ceiling[f"{key}_ratio_vs_triton_c{c}"] = ratio(floor[f"rps_c{c}"], tb[f"rps_c{c}"])
            ceiling[f"{key}_p99_ratio_vs_triton_c1"] = ratio(floor["p99_us_c1"], tb["p99_us_c1"])
    summary: dict = {
        **ratios("paved"),
        **ceiling,
        **({"baseline": ratios("baseline")} if "baseline" in urls else {}),
        "results": {f"{server}/{model}": r for (server, model), r in results.items()},
        "triton_version": "2.51.0 (nvidia-pytriton 0.7.0)",
        "concurrency": c,
        "requests": args.requests,
        "requests_c1": args.requests_c1,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        f"goal_rps_c{c}": round(goal_rps),
        # > cpus: the throughput goal cannot be measured on this machine, whatever the server.
        f"client_cores_at_goal_c{c}": round(client_cores_at_goal, 2),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    for (server, model), r in results.items():
        inside = (
            f"  (inside the server: {r['server_success_us_c1']:.0f} us, of which queue "
            f"{r['server_queue_us_c1']:.0f}, execution {r['server_compute_infer_us_c1']:.0f})"
            if "server_success_us_c1" in r
            else ""
        )
        print(
            f"{server:8} {model:10}  c1 p50 {r['p50_us_c1']:8.0f} us  p99 {r['p99_us_c1']:8.0f} us{inside}   "
            f"c{c} {r[f'rps_c{c}']:8.0f} req/s  p99 {r[f'p99_ms_c{c}']:7.2f} ms  "
            f"CPU/request: server {r[f'server_cpu_us_c{c}']:5.0f} us, "
            f"client {r[f'client_cpu_us_c{c}']:4.0f} us"
        )
    for server, key, what in (
        ("null", "null_server", "a C++ gRPC server doing no work"),
        ("aio_null", "aio_null_server", "a grpc.aio server doing no work"),
    ):
        if f"{key}_ratio_vs_triton_c{c}" in ceiling:
            print(
                f"{what} answers {results[(server, 'batched')][f'rps_c{c}']:.0f} req/s at c{c}: "
                f"x{ceiling[f'{key}_ratio_vs_triton_c{c}']} of Triton; its c1 p99 is "
                f"x{ceiling[f'{key}_p99_ratio_vs_triton_c1']} of Triton's"
            )
    print(
        f"the goal, {goal_rps:.0f} req/s at c{c}, needs {client_cores_at_goal:.2f} cores for the load "
        f"generator alone ({tb[f'client_cpu_us_c{c}']:.0f} us of CPU per request) on {os.cpu_count()} CPUs"
    )
    print(
        f"paved vs Triton, python model: throughput x{summary[f'throughput_ratio_vs_triton_c{c}']} at c{c} "
        f"(goal >= 1.5), p99 x{summary['p99_ratio_vs_triton_c1']} at c1 (goal <= 1.0); XGBoost: python on "
        f"both x{summary[f'throughput_ratio_vs_triton_c{c}_xgboost_python']}, paved native vs Triton python "
        f"x{summary[f'throughput_ratio_vs_triton_c{c}_xgboost_native']} at c{c}"
    )
    if "baseline" in summary:
        b = summary["baseline"]
        print(
            f"baseline ({args.baseline_src}) vs Triton: throughput x{b[f'throughput_ratio_vs_triton_c{c}']} "
            f"at c{c}, p99 x{b['p99_ratio_vs_triton_c1']} (p50 x{b['p50_ratio_vs_triton_c1']}) at c1; "
            f"paved p50 x{summary['p50_ratio_vs_triton_c1']} at c1"
        )
    print(
        f"machine: {os.cpu_count()} CPUs, 1-minute load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`tools/bazel run //bench:launcher [-- --json]`: the launcher's cold and warm starts.

Against moto's S3-compatible server on loopback (started here), with a generated package of
`--size-mb` (default 1024) random bytes in `--shards` weight files plus config/tokenizer:
  * materialization time (package ready and verified in the local cache: model.json, parallel
    ranged GETs, sha256 of every byte, fsync, hardlinked model dir; no engine) cold from S3
    into an empty cache vs warm from the cache: `warm_over_cold` (target <= 0.1);
  * S3 download throughput of a cold materialization vs plain boto3 `download_file` with its
    default TransferConfig, object by object, on the same objects and server, rounds
    interleaved: `s3_throughput_ratio` = paved / boto3 (target >= 0.8). Only paved's number
    includes hashing and fsync;
  * time-to-ready of the tiny model end to end (launcher CLI, cold from S3, embedded mode:
    materialize, plugin check, paved frontend + vLLM boot, readiness gate), reported only.
moto serves a ranged GET by reading the whole object (field notes): its cost grows with the
number of parts, which is why the part size matters on this server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request

MiB = 1 << 20


def _gen_package(work: str, size_mb: int, shards: int) -> tuple[str, int]:
    from paved.launcher.build import build_package

    hf = os.path.join(work, "hf")
    os.makedirs(hf)
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, f)
    with open(os.path.join(hf, "tokenizer.json"), "w") as f:
        json.dump({"version": "1.0"}, f)
    per = size_mb * MiB // shards
    chunk = os.urandom(16 * MiB)
    for i in range(shards):
        with open(os.path.join(hf, f"model-{i + 1:05d}-of-{shards:05d}.safetensors"), "wb") as f:
            left = per
            while left:
                # Distinct content per shard and per chunk (no dedup anywhere).
                piece = (i.to_bytes(4, "little") + left.to_bytes(8, "little") + chunk)[: min(left, 16 * MiB)]
                f.write(piece)
                left -= len(piece)
    out = os.path.join(work, "pkg")
    pkg = build_package(hf, out, "big", "1", link=True)
    return out, pkg.total_bytes()


def _materializer(cache_dir: str, endpoint: str, part_size: int):
    from paved.launcher.cache import Cache
    from paved.launcher.materialize import Materializer
    from paved.launcher.storage import Downloader, TransferConfig, make_s3_client

    config = TransferConfig(part_size=part_size)
    return Materializer(
        Cache(cache_dir),
        Downloader(config, lambda: make_s3_client(endpoint, config=config)),
        progress_tty=False,
    )


def _tiny_time_to_ready(s3, work: str) -> dict:
    from paved.launcher.build import build_package, upload_package
    from paved.launcher.gate import free_port
    from paved.launcher.testing import LauncherProcess
    from paved.testing.fixtures import tiny_model_dir

    args = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 8, "enforce_eager": True}
    build_package(tiny_model_dir(), os.path.join(work, "tiny"), "tiny", "1", args)
    upload_package(os.path.join(work, "tiny"), "s3://bench/tiny/1", s3.client())
    port, admin = free_port(), free_port()
    t0 = time.monotonic()
    proc = LauncherProcess(
        ["s3://bench/tiny/1", "--cache-dir", os.path.join(work, "tiny-cache"),
         "--s3-endpoint-url", s3.endpoint, "--port", str(port), "--admin-port", str(admin)],
        os.path.join(work, "tiny-launcher.log"),
    )  # fmt: skip
    try:
        if not proc.wait_line(r"paved launcher: ready", 900):
            raise SystemExit("tiny launcher did not become ready:\n" + proc.stderr()[-4000:])
        ready_s = time.monotonic() - t0
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/status", timeout=10) as r:
            timings = json.load(r)["timings_s"]
        proc.proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        proc.kill()
    return {"time_to_ready_s": round(ready_s, 2), "phases_s": timings}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="cold and boto3 rounds (interleaved)")
    p.add_argument("--part-size-mb", type=int, default=64, help="paved's ranged GET size (its default: 64)")
    p.add_argument("--skip-e2e", action="store_true", help="skip the tiny model's time-to-ready")
    p.add_argument("--workdir", help="scratch directory (default: a temp dir; needs ~4x --size-mb)")
    args = p.parse_args()

    import logging

    logging.basicConfig(level=logging.WARNING)
    from paved.launcher.build import upload_package
    from paved.launcher.testing import CREDENTIALS, MotoServer

    for k, v in CREDENTIALS.items():
        os.environ.setdefault(k, v)
    work = tempfile.mkdtemp(prefix="paved-bench-launcher-", dir=args.workdir)
    results: dict = {}
    try:
        with MotoServer(os.path.join(work, "moto.log")) as s3:
            client = s3.client()
            client.create_bucket(Bucket="bench")
            t0 = time.monotonic()
            pkg_dir, total = _gen_package(work, args.size_mb, args.shards)
            upload_package(pkg_dir, "s3://bench/big/1", client, multipart_threshold=5 << 30)
            shutil.rmtree(os.path.join(work, "hf"))
            shutil.rmtree(pkg_dir)
            print(f"package: {total / MiB:.0f} MiB in {args.shards} shards, uploaded in "
                  f"{time.monotonic() - t0:.1f}s", file=sys.stderr)  # fmt: skip
            keys = [o["Key"] for o in client.list_objects_v2(Bucket="bench", Prefix="big/1/")["Contents"]]

            cold, boto, warm = [], [], []
            for r in range(args.rounds):
                cache = os.path.join(work, f"cache{r}")
                m = _materializer(cache, s3.endpoint, args.part_size_mb * MiB)
                t = time.monotonic()
                got = m.materialize("s3://bench/big/1")
                cold.append(time.monotonic() - t)
                assert not got.warm and got.fetched_bytes == total
                for _ in range(5):
                    m2 = _materializer(cache, "http://127.0.0.1:9", args.part_size_mb * MiB)  # no network
                    t = time.monotonic()
                    assert m2.materialize("s3://bench/big/1").warm
                    warm.append(time.monotonic() - t)
                shutil.rmtree(cache)

                dest = os.path.join(work, "boto3")
                os.makedirs(dest)
                t = time.monotonic()
                for key in keys:
                    client.download_file("bench", key, os.path.join(dest, key.replace("/", "_")))
                boto.append(time.monotonic() - t)
                shutil.rmtree(dest)
                print(f"round {r + 1}: paved cold {cold[-1]:.2f}s, boto3 download_file {boto[-1]:.2f}s",
                      file=sys.stderr)  # fmt: skip
            results.update(
                package_bytes=total,
                cold_s=round(statistics.median(cold), 3),
                warm_s=round(statistics.median(warm), 6),
                boto3_s=round(statistics.median(boto), 3),
            )
            results["warm_over_cold"] = round(results["warm_s"] / results["cold_s"], 6)
            results["paved_MBps"] = round(total / MiB / results["cold_s"], 1)
            results["boto3_MBps"] = round(total / MiB / results["boto3_s"], 1)
            results["s3_throughput_ratio"] = round(results["paved_MBps"] / results["boto3_MBps"], 3)
            if not args.skip_e2e:
                results["tiny"] = _tiny_time_to_ready(s3, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    r = results
    print(f"\n{'':<44} {'seconds':>9} {'MiB/s':>8}")
    print(
        f"{'paved cold materialize (S3 -> verified cache)':<44} {r['cold_s']:>9.3f} {r['paved_MBps']:>8.1f}"
    )
    print(f"{'boto3 download_file, default settings':<44} {r['boto3_s']:>9.3f} {r['boto3_MBps']:>8.1f}")
    print(f"{'paved warm materialize (cache only)':<44} {results['warm_s']:>9.6f}")
    print(f"\nwarm_over_cold {results['warm_over_cold']} (target <= 0.1), "
          f"s3_throughput_ratio {results['s3_throughput_ratio']} (target >= 0.8)")  # fmt: skip
    if "tiny" in results:
        print(f"tiny model time-to-ready, cold from S3: {results['tiny']['time_to_ready_s']}s "
              f"(phases: {results['tiny']['phases_s']})")  # fmt: skip
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Materialization from a real S3-compatible server (moto, loopback) into the local cache.

Cold start, warm start with the server gone, a corrupted object, a connection cut mid-part
(retry), a tarball package, LRU eviction, and two launcher processes racing on one cache.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading

import pytest

from paved.launcher.build import build_package, upload_package
from paved.launcher.cache import Cache
from paved.launcher.materialize import CacheBudgetError, ChecksumError, Materializer
from paved.launcher.storage import Downloader, Fetch, TransferConfig, TransferError, make_s3_client
from paved.launcher.testing import CREDENTIALS, FlakyProxy, MotoServer, make_wheel, subprocess_env
from paved.testing.fixtures import tiny_model_dir
from paved.testing.http_stub import TricklingServer

for _k, _v in CREDENTIALS.items():
    os.environ.setdefault(_k, _v)

MiB = 1 << 20


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with MotoServer(str(log)) as server:
        server.client().create_bucket(Bucket="models")
        yield server


@pytest.fixture(scope="module")
def tiny_pkg(tmp_path_factory, s3):
    """The tiny model plus a 3 MiB random shard (split into ranged parts with 1 MiB parts) and
    a plugin wheel."""
    hf = tmp_path_factory.mktemp("hf")
    for name in os.listdir(tiny_model_dir()):
        os.symlink(os.path.join(tiny_model_dir(), name), hf / name)
    (hf / "extra.bin").write_bytes(os.urandom(3 * MiB + 12345))
    wheel = make_wheel(str(tmp_path_factory.mktemp("wheels")), "p", "1", {"p.py": "x = 1\n"}, {})
    out = tmp_path_factory.mktemp("pkg") / "tiny"
    pkg = build_package(str(hf), str(out), "tiny", "1", {"max_model_len": 512}, plugin_wheels=(wheel,))
    upload_package(str(out), "s3://models/tiny/1", s3.client())
    return pkg, out


def _materializer(cache_dir, endpoint, part_size=1 * MiB, max_bytes=None, **cfg):
    config = TransferConfig(part_size=part_size, backoff_base_s=0.01, **cfg)
    return Materializer(
        Cache(str(cache_dir), max_bytes),
        Downloader(config, lambda: make_s3_client(endpoint, config=config)),
        progress_tty=False,
    )


def _dir_digest(root):
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def test_cold_then_warm_start_without_network(tmp_path, s3, tiny_pkg, caplog):
    pkg, _ = tiny_pkg
    caplog.set_level("INFO", logger="paved.launcher")
    cold = _materializer(tmp_path / "cache", s3.endpoint).materialize("s3://models/tiny/1")
    assert not cold.warm and cold.fetched_bytes == pkg.total_bytes() and cold.digest == pkg.digest()
    # Exactly the package's files, byte for byte, in one HF directory.
    expected = {f.path: f.sha256 for _, f in pkg.model_files()}
    assert _dir_digest(cold.model_dir) == expected
    # The wheel, fetched from the package's plugins/ prefix, is installed beside the model.
    with open(os.path.join(cold.plugin_dir, "p.py")) as fh:
        assert fh.read() == "x = 1\n"
    assert os.path.isfile(os.path.join(cold.plugin_dir, "p-1.dist-info", "METADATA"))
    # The 3 MiB shard went as 4 ranged GETs; every other file as one GET.
    gets = s3.requests("GET", "/models/tiny/1/")
    assert sum(1 for _, p, _ in gets if p.endswith("extra.bin")) == 4
    assert sum(1 for _, p, _ in gets if p.endswith("model.safetensors")) == 2
    assert any("materialize: done" in r.message for r in caplog.records), "no progress log line"
    # Cache entries are read-only hardlinks into the blob store.
    st = os.stat(os.path.join(cold.model_dir, "extra.bin"))
    assert st.st_nlink == 2 and not st.st_mode & 0o222
    assert os.listdir(tmp_path / "cache" / "tmp") == []

    # Warm: the endpoint is a closed port, so any network access would fail the start.
    dead = _materializer(tmp_path / "cache", "http://127.0.0.1:9", max_attempts=1)
    warm = dead.materialize("s3://models/tiny/1")
    assert warm.warm and warm.fetched_bytes == 0 and warm.model_dir == cold.model_dir
    # A damaged cache entry (file truncated behind the launcher's back) is not served warm.
    blob = os.path.join(tmp_path / "cache", "blobs", "sha256", expected["extra.bin"])
    os.chmod(blob, 0o644)
    with open(blob, "r+b") as f:
        f.truncate(10)
    with pytest.raises(Exception, match=r"127\.0\.0\.1:9|Could not connect"):
        dead.materialize("s3://models/tiny/1")
    again = _materializer(tmp_path / "cache", s3.endpoint).materialize("s3://models/tiny/1")
    assert not again.warm and _dir_digest(again.model_dir) == expected


def test_corrupted_object_fails_and_leaves_no_partial_entry(tmp_path, s3, tiny_pkg):
    pkg, src = tiny_pkg
    client = s3.client()
    upload_package(str(src), "s3://models/corrupt/1", client)
    data = bytearray((src / "weights" / "extra.bin").read_bytes())
    data[2 * MiB + 7] ^= 0x01  # one bit, in the third ranged part
    client.put_object(Bucket="models", Key="corrupt/1/weights/extra.bin", Body=bytes(data))

    m = _materializer(tmp_path / "cache", s3.endpoint)
    with pytest.raises(ChecksumError, match=r"extra\.bin: sha256 mismatch"):
        m.materialize("s3://models/corrupt/1")
    cache = tmp_path / "cache"
    bad_sha = next(f.sha256 for _, f in pkg.model_files() if f.path == "extra.bin")
    assert not (cache / "blobs" / "sha256" / bad_sha).exists()
    assert os.listdir(cache / "tmp") == [] and os.listdir(cache / "packages") == []
    assert os.listdir(cache / "refs") == []
    # Fetched twice (one re-fetch in case the flip happened in transit), then given up.
    assert sum(1 for _, p, _ in s3.requests("GET", "/corrupt/1/weights/extra.bin")) == 8


def test_connection_cut_mid_part_is_retried(tmp_path, s3, tiny_pkg, caplog):
    pkg, _ = tiny_pkg
    proxy = FlakyProxy(s3.port, cut_after=300_000, failures=2)
    try:
        caplog.set_level("WARNING", logger="paved.launcher")
        m = _materializer(tmp_path / "cache", proxy.endpoint)
        got = m.materialize("s3://models/tiny/1")
    finally:
        proxy.close()
    assert proxy.cuts == 2
    assert _dir_digest(got.model_dir) == {f.path: f.sha256 for _, f in pkg.model_files()}
    assert any("retrying in" in r.message for r in caplog.records)


def test_missing_object_is_a_clear_permanent_error(tmp_path, s3):
    m = _materializer(tmp_path / "cache", s3.endpoint)
    with pytest.raises(Exception, match=r"s3://models/nope/model\.json.*(NoSuchKey|Not Found|404)"):
        m.materialize("s3://models/nope")


def test_tarball_package_from_s3(tmp_path, s3):
    build_package(tiny_model_dir(), str(tmp_path / "tiny.tar.gz"), "tiny", "tar")
    upload_package(str(tmp_path / "tiny.tar.gz"), "s3://models/tiny-tar.tar.gz", s3.client())
    m = _materializer(tmp_path / "cache", s3.endpoint)
    got = m.materialize("s3://models/tiny-tar.tar.gz")
    assert got.package.version == "tar"
    assert sorted(os.listdir(got.model_dir)) == sorted(os.listdir(tiny_model_dir()))
    assert m.materialize("s3://models/tiny-tar.tar.gz").warm


def test_lru_eviction_keeps_in_use_packages(tmp_path):
    """Budget for about one package: the least recently used one not in use goes."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "tokenizer.json").write_text("{}")
    pkgs = {}
    for name in ("a", "b", "c"):
        (hf / "w.bin").write_bytes(os.urandom(2 * MiB))
        build_package(str(hf), str(tmp_path / name), "m", name)
        pkgs[name] = str(tmp_path / name)
    m = _materializer(tmp_path / "cache", None, max_bytes=3 * MiB)
    a = m.materialize(pkgs["a"])
    a.hold.release()  # a's launcher exited
    b = m.materialize(pkgs["b"])  # b's launcher keeps running
    c = m.materialize(pkgs["c"])
    cache = Cache(str(tmp_path / "cache"))
    assert not cache.has_package(a.digest), "least recently used, not in use: evicted"
    assert cache.has_package(b.digest), "in use: kept even over budget"
    assert cache.has_package(c.digest)
    assert cache.read_ref(pkgs["a"]) is None
    b.hold.release()
    report = cache.evict(3 * MiB, protect=frozenset({c.digest}))
    assert report is not None and report.packages == (b.digest,)
    assert cache.usage_bytes() <= 3 * MiB
    assert m.materialize(pkgs["c"]).warm


def test_two_launchers_share_one_cache_and_one_download(tmp_path, s3, tiny_pkg):
    pkg, src = tiny_pkg
    upload_package(str(src), "s3://models/race/1", s3.client())
    # Slowed to ~1 s so the two processes surely overlap.
    proxy = FlakyProxy(s3.port, delay_s=0.02)
    args = [
        sys.executable, "-m", "paved.launcher.main", "s3://models/race/1", "--materialize-only",
        "--cache-dir", str(tmp_path / "cache"), "--s3-endpoint-url", proxy.endpoint,
        "--part-size", "1MiB", "--progress", "log",
    ]  # fmt: skip
    env = subprocess_env()
    try:
        procs = [
            subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        proxy.close()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert results[0]["model_dir"] == results[1]["model_dir"]
    assert sorted(r["fetched_bytes"] for r in results) == [0, pkg.total_bytes()]
    # One of them found the other one at work and waited for it.
    waited = [err for _, err in outs if "another launcher is materializing it; waiting" in err]
    assert len(waited) == 1, [err[-2000:] for _, err in outs]
    # Independent of what the launchers report: each object was downloaded once.
    for artifact, f in pkg.model_files():
        gets = s3.requests("GET", f"/models/race/1/{artifact.uri}/{f.path}")
        assert len(gets) == (4 if f.path == "extra.bin" else 2 if f.path == "model.safetensors" else 1), (
            f.path
        )
    assert _dir_digest(results[0]["model_dir"]) == {f.path: f.sha256 for _, f in pkg.model_files()}


def test_verify_rehashes_a_warm_package(tmp_path):
    """Warm starts check sizes; --verify also catches a same-size corruption and repairs it."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "tokenizer.json").write_text("{}")
    (hf / "w.bin").write_bytes(os.urandom(MiB))
    build_package(str(hf), str(tmp_path / "pkg"), "m", "1")
    first = _materializer(tmp_path / "cache", None).materialize(str(tmp_path / "pkg"))
    path = os.path.join(first.model_dir, "w.bin")
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)[0]
        f.seek(1000)
        f.write(bytes([byte ^ 0xFF]))
    assert _materializer(tmp_path / "cache", None).materialize(str(tmp_path / "pkg")).warm
    m = _materializer(tmp_path / "cache", None)
    m.verify = True
    again = m.materialize(str(tmp_path / "pkg"))
    assert not again.warm
    with open(os.path.join(again.model_dir, "w.bin"), "rb") as f, open(hf / "w.bin", "rb") as g:
        assert f.read() == g.read()


def _small_package(tmp_path, name="pkg", size=MiB):
    hf = tmp_path / f"hf-{name}"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "tokenizer.json").write_text("{}")
    (hf / "w.bin").write_bytes(os.urandom(size))
    build_package(str(hf), str(tmp_path / name), "m", name)
    return str(tmp_path / name)


@pytest.mark.parametrize("refresh", [False, True])
def test_damaged_cached_model_json_is_rebuilt(tmp_path, refresh):
    """A cached package whose model.json was cut short (a power loss) is rebuilt, warm or with
    --refresh, instead of failing every later start."""
    pkg = _small_package(tmp_path)
    first = _materializer(tmp_path / "cache", None).materialize(pkg)
    first.hold.release()
    with open(os.path.join(first.package_dir, "model.json"), "w"):
        pass  # zero-length
    again = _materializer(tmp_path / "cache", None).materialize(pkg, refresh=refresh)
    assert not again.warm and again.digest == first.digest
    with open(os.path.join(again.package_dir, "model.json"), "rb") as f:
        assert json.loads(f.read())["version"] == "pkg"
    assert _materializer(tmp_path / "cache", None).materialize(pkg).warm


def test_package_larger_than_the_budget_is_refused_without_evicting(tmp_path):
    """A manifest declaring more bytes than the whole budget (here a lying 1 TiB size) fails
    with an error naming both, and evicts nothing: the cache keeps every package."""
    good = _small_package(tmp_path, "good")
    m = _materializer(tmp_path / "cache", None, max_bytes=64 * MiB)
    m.materialize(good).hold.release()  # its launcher exited: evictable
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    manifest = json.loads((bad / "model.json").read_text())
    manifest["model_id"] = "bad"
    manifest["weights"]["files"][0]["size"] = 1 << 40
    (bad / "model.json").write_text(json.dumps(manifest))
    with pytest.raises(
        CacheBudgetError, match=rf"\({1 << 40} bytes\).*\({64 * MiB} bytes, --cache-max-bytes\)"
    ):
        m.materialize(str(bad))
    assert m.materialize(good).warm


def test_a_tarball_whose_manifest_needs_more_than_the_budget_is_refused_before_fetching(tmp_path):
    """A tarball's size is only a first guess at what it needs: its model.json may name blobs
    outside it (absolute URIs). One naming more than the whole budget fails before anything is
    fetched, as the same manifest as a directory does, and the cached package stays."""
    good = _small_package(tmp_path, "good")
    m = _materializer(tmp_path / "cache", None, max_bytes=64 * MiB)
    m.materialize(good).hold.release()
    src = tmp_path / "src"
    shutil.copytree(good, src)
    manifest = json.loads((src / "model.json").read_text())
    manifest["model_id"] = "big"
    # The weights' other files come from elsewhere, and are large.
    far = {"path": "far.bin", "sha256": "ab" * 32, "size": 1 << 30}
    manifest["weights"]["files"].append(far)
    manifest["weights"]["uri"] = "s3://elsewhere/weights"
    (src / "model.json").write_text(json.dumps(manifest))
    tarball = tmp_path / "big.tar"
    with tarfile.open(tarball, "w") as tar:
        tar.add(src / "model.json", arcname="model.json")
    with pytest.raises(CacheBudgetError, match=r"nothing was fetched"):
        m.materialize(str(tarball))
    assert m.materialize(good).warm


def test_cold_start_clears_crashed_launchers_temp_files_without_a_budget(tmp_path):
    """Without --cache-max-bytes (nothing evicts) a cold start still removes what a killed
    launcher left in tmp/; but never while another launcher materializes (its download)."""
    pkg = _small_package(tmp_path)
    cache = Cache(str(tmp_path / "cache"))
    stale = os.path.join(cache.root, "tmp", "0123456789abcdef.4242.deadbeef")
    with open(stale, "wb") as f:
        f.truncate(MiB)
    busy = cache.lock("gc")
    busy.acquire(shared=True)  # another launcher is fetching: its temp files stay
    try:
        _materializer(tmp_path / "cache", None).materialize(pkg).hold.release()
    finally:
        busy.release()
    assert os.path.exists(stale)
    _materializer(tmp_path / "cache", None).materialize(pkg, refresh=True).hold.release()
    assert not os.path.exists(stale)


def test_a_trickling_s3_stream_is_a_stall_even_while_a_read_is_blocked(tmp_path):
    """Fewer than stall_min_bytes in stall_timeout_s fails the part, checked by a timer: it was
    checked only after a read returned, and a read of a trickling stream did not return."""
    # A 200 for 2 MiB, then one byte every 0.1 s.
    server = TricklingServer(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % (2 * MiB)
    )
    config = TransferConfig(
        workers=1, max_attempts=2, backoff_base_s=0.01, stall_timeout_s=0.5, read_timeout_s=30.0
    )
    downloader = Downloader(config, lambda: make_s3_client(server.url, config=config))
    result = {}

    def fetch():
        try:
            downloader.fetch_all([Fetch("s3://models/w.bin", 2 * MiB, str(tmp_path / "w.part"), "w.bin")])
        except Exception as e:  # noqa: BLE001 - the test inspects it
            result["error"] = e

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    thread.join(60)  # bounds a failure (a read blocked for ever), not a timing assertion
    try:
        assert not thread.is_alive(), "no stall detected: the download is still reading"
    finally:
        server.close()
        thread.join(60)
    error = result["error"]
    assert isinstance(error, TransferError)
    assert "stalled: " in str(error) and "(after 2 attempts)" in str(error), error

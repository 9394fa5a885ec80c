"""Merge Prometheus metrics from three kinds of sources into one text exposition (format 0.0.4).

Sources, in precedence order:
  1. the proxy's own metrics (`paved_metrics_proxy_*`): per-source `up` and scrape duration,
     corrupt files skipped, families dropped, upstream errors;
  2. the engine: every `*.db` file of PROMETHEUS_MULTIPROC_DIR, merged exactly as
     prometheus_client's MultiProcessCollector does (vLLM's `vllm:*` families, and whatever
     else the engine process exports in multiprocess mode);
  3. upstream HTTP `/metrics` endpoints (e.g. Triton's), fetched concurrently, each within a
     deadline, in the order given.

Name clashes: a family belongs to the first source that exposes any of its names (the family
name or any of its sample names, e.g. `x`, `x_total`, `x_bucket`). A later family that reuses
one of them is dropped whole (never merged, never renamed) and counted in
`paved_metrics_proxy_dropped_families_total{source}`; so the output never repeats a HELP/TYPE
and never mixes two sources' samples under one name. Upstream families are passed through
byte for byte (a Triton counter keeps its `nv_inference_count` name; a parse-and-render would
rename it `..._total`) after the whole answer has been validated with prometheus_client's
parser.

Failures never fail the scrape: an upstream that is down, slow or answers garbage yields
`paved_metrics_proxy_up{source="<name>"} 0` and nothing else from it; a `.db` file that cannot
be read is skipped and counted (`paved_metrics_proxy_corrupt_files`); the answer is always 200.
"""

from __future__ import annotations

import contextlib
import glob
import http.client
import logging
import os
import re
import socket
import stat
import struct
import threading
import time
import urllib.parse
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("paved.metrics")
ENGINE = "engine"
PREFIX = "paved_metrics_proxy_"
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_SUFFIXES = ("", "_total", "_created", "_bucket", "_count", "_sum", "_gcount", "_gsum", "_info")


@dataclass(frozen=True)
class Upstream:
    name: str
    url: str
    # The upstream repeats the engine files' families by design (the launcher's frontend: its
    # in-process vLLM metrics are also recorded in the multiprocess directory). Its copies of
    # them are dropped quietly: the files' merge across processes is the one kept, and neither
    # a warning nor `dropped_families` should fire on every replica for the expected overlap.
    mirrors_engine: bool = False

    @classmethod
    def parse(cls, spec: str) -> Upstream:
        """`name=http://host:port/metrics`, or a bare URL (named after host:port)."""
        name, sep, url = spec.partition("=")
        if not sep or "://" in name:
            url, name = spec, ""
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"upstream {spec!r}: expected [name=]http(s)://host:port/path")
        return cls(name or parsed.netloc, url)


@dataclass
class _Block:
    """One metric family of an upstream's text, kept verbatim."""

    name: str
    lines: list[str] = field(default_factory=list)
    sample_names: set[str] = field(default_factory=set)


class UpstreamError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _family_of(sample: str, current: str | None) -> bool:
    return current is not None and any(sample == current + s for s in _SUFFIXES)


def split_families(text: str) -> list[_Block]:
    """Split a valid text exposition into per-family blocks (HELP/TYPE plus samples).

    Lines end at "\n" only, as for Prometheus and the validating parser: str.splitlines() would
    also break at \x0b, \x0c, \x1c-\x1e, \x85, U+2028 and U+2029, and so re-emit one validated
    HELP line as several lines, one of them any sample the upstream chose to smuggle in. Each
    line is stripped, as the validating parser strips it: an indented `# TYPE` (or a sample, or
    a CRLF ending) must name the family the parser saw, or it would pass the name-clash check
    under no name and be re-emitted as it came."""
    blocks: list[_Block] = []
    current: _Block | None = None
    for line in text.split("\n"):
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                directive = f"# {parts[1]} "
                if (
                    current is None
                    or current.name != parts[2]
                    or current.sample_names
                    or any(ln.startswith(directive) for ln in current.lines)
                ):
                    current = _Block(parts[2])
                    blocks.append(current)
                current.lines.append(line)
            continue  # other comments (and OpenMetrics' "# EOF") are dropped
        sample = re.split(r"[{\s]", line, maxsplit=1)[0]
        if current is None or not (_family_of(sample, current.name) or sample in current.sample_names):
            current = _Block(sample)  # an untyped family without HELP/TYPE
            blocks.append(current)
        current.lines.append(line)
        current.sample_names.add(sample)
    return blocks


def _header_problem(path: str) -> str | None:
    """Cheap check of a prometheus_client mmap file: its first 4 bytes are the used length,
    which must cover the header and fit the file. A garbage header would otherwise read as an
    empty file, silently. Anything but a regular file (a directory, a FIFO, a device, a link
    named like one) is a problem too: the merge would fail on it, losing every file's metrics,
    or block on it forever. "gone" means the file vanished: not a problem to count."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "gone"
    except OSError as e:
        return f"cannot stat: {type(e).__name__}: {e}"
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file (mode {stat.filemode(st.st_mode)})"
    try:
        # O_NONBLOCK/O_NOFOLLOW: the path may have been replaced by a FIFO or a link since.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return "gone"
    except OSError as e:
        return f"cannot open: {type(e).__name__}: {e}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"not a regular file (mode {stat.filemode(st.st_mode)})"
        size = st.st_size
        head = os.pread(fd, 4, 0)
    except OSError as e:
        return f"cannot read: {type(e).__name__}: {e}"
    finally:
        os.close(fd)
    if len(head) < 4:
        return f"{size} bytes, shorter than a header"
    used = struct.unpack("i", head)[0]
    if used != 0 and not 8 <= used <= size:  # 0: just created, not initialized yet
        return f"corrupt header (used length {used}, file size {size})"
    return None


class MetricsProxy:
    def __init__(
        self,
        multiproc_dir: str | None,
        upstreams: Iterable[Upstream] = (),
        timeout_s: float = 3.0,
        max_upstream_bytes: int = 32 << 20,
    ):
        self.multiproc_dir = multiproc_dir
        self.upstreams = list(upstreams)
        names = [u.name for u in self.upstreams]
        if len(set(names)) != len(names) or ENGINE in names:
            raise ValueError(f"upstream names must be unique and not {ENGINE!r}: {names}")
        self.timeout_s = timeout_s
        self.max_upstream_bytes = max_upstream_bytes
        self._pool = ThreadPoolExecutor(max(4, 2 * len(self.upstreams)), "paved-metrics-upstream")
        self._lock = threading.Lock()
        self._scrapes = 0
        self._corrupt_skips = 0
        self._dropped: dict[str, int] = defaultdict(int)
        self._errors: dict[tuple[str, str], int] = defaultdict(int)
        self._warned: set[tuple[str, str]] = set()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- engine ------------------------------------------------------------------------------
    def collect_engine(self) -> tuple[list[Metric], int, bool]:
        """(families, corrupt files skipped, ok). Fast path: one merge of every file, exactly as
        MultiProcessCollector.collect; only if that raises is each file checked on its own."""
        path = self.multiproc_dir
        if not path:
            return [], 0, True
        if not os.path.isdir(path):
            return [], 0, False
        files, corrupt = [], []
        for f in glob.glob(os.path.join(path, "*.db")):
            problem = _header_problem(f)
            if problem is None:
                files.append(f)
            elif problem != "gone":
                corrupt.append(f)
                self._warn_once("corrupt", f, f"skipping metrics file {f}: {problem}")
        try:
            return list(MultiProcessCollector.merge(files, accumulate=True)), len(corrupt), True
        except Exception as e:  # noqa: BLE001 - any file may be the bad one: find it below, one by one
            log.debug(
                "merging %d metrics files failed (%s: %s); checking each", len(files), type(e).__name__, e
            )
        good = []
        for f in files:
            try:
                MultiProcessCollector.merge([f], accumulate=True)
                good.append(f)
            except FileNotFoundError:
                continue  # removed since the glob (a dead process's live gauge)
            except Exception as e:  # noqa: BLE001 - a torn or foreign file is skipped, reported once
                corrupt.append(f)
                self._warn_once(
                    "corrupt", f, f"skipping unreadable metrics file {f}: {type(e).__name__}: {e}"
                )
        try:
            return list(MultiProcessCollector.merge(good, accumulate=True)), len(corrupt), True
        except Exception as e:  # noqa: BLE001 - files changed between the checks: give up on this scrape
            self._warn_once("corrupt", path, f"cannot merge {path}: {type(e).__name__}: {e}")
            return [], len(corrupt), False

    # -- upstreams -----------------------------------------------------------------------------
    def fetch(self, upstream: Upstream) -> str:
        """The upstream's exposition text, validated; raises UpstreamError. The whole exchange
        (connect, headers, body) ends within `timeout_s`: a socket timeout bounds one read
        only, and an upstream trickling a byte at a time held a pool thread for ever."""
        deadline = time.monotonic() + self.timeout_s
        url = urllib.parse.urlsplit(upstream.url)
        if not url.hostname:
            raise UpstreamError("config", f"upstream URL {upstream.url!r} names no host")
        conn_cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(url.hostname, url.port, timeout=self.timeout_s)
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            sock = conn.sock
            if sock is not None:  # None while connecting: checked once request() returns
                # shutdown, not close: it wakes a recv blocked in the fetching thread.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        watchdog = threading.Timer(self.timeout_s, expire)
        watchdog.daemon = True
        watchdog.start()
        timeout = UpstreamError("timeout", f"no complete answer within {self.timeout_s}s")
        try:
            try:
                path = url.path or "/"
                conn.request(
                    "GET",
                    path + (f"?{url.query}" if url.query else ""),
                    headers={
                        "Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1",
                        "User-Agent": "paved-metrics-proxy",
                    },
                )
                if expired.is_set():
                    raise timeout
                resp = conn.getresponse()
                if resp.status != 200:
                    raise UpstreamError("http_status", f"HTTP {resp.status}")
                chunks, size = [], 0
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise UpstreamError("timeout", f"no complete answer within {self.timeout_s}s")
                    if conn.sock is not None:
                        conn.sock.settimeout(left)
                    chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
                    if not chunk:
                        break
                    size += len(chunk)
                    if size > self.max_upstream_bytes:
                        raise UpstreamError(
                            "too_large", f"answer larger than {self.max_upstream_bytes} bytes"
                        )
                    chunks.append(chunk)
                if expired.is_set():  # the end seen may be the watchdog's shutdown: a cut answer
                    raise timeout
            except TimeoutError as e:
                raise timeout from e
            except (OSError, http.client.HTTPException) as e:
                if expired.is_set():
                    raise timeout from e
                raise UpstreamError("connect", f"{type(e).__name__}: {e}") from e
        finally:
            watchdog.cancel()
            conn.close()
        try:
            text = b"".join(chunks).decode("utf-8")
            for family in text_string_to_metric_families(text):
                if not _NAME.match(family.name):
                    raise ValueError(f"invalid metric name {family.name!r}")
        except Exception as e:
            raise UpstreamError("parse", f"not a Prometheus text exposition: {type(e).__name__}: {e}") from e
        return text

    # -- merge ---------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The merged exposition. Never raises for a source's failure."""
        t0 = time.monotonic()
        futures = {u.name: self._pool.submit(self._timed_fetch, u) for u in self.upstreams}
        e0 = time.monotonic()
        engine, corrupt, engine_ok = self.collect_engine()
        durations = {ENGINE: time.monotonic() - e0}
        wait(futures.values(), timeout=self.timeout_s + 1.0)
        up = {ENGINE: engine_ok}
        upstream_text: dict[str, str] = {}
        for name, fut in futures.items():
            if not fut.done():
                fut.cancel()
                up[name] = False
                durations[name] = time.monotonic() - t0
                self._count_error(name, "timeout", "no answer in time")
                continue
            text, seconds, error = fut.result()
            durations[name] = seconds
            up[name] = error is None
            if error is None:
                upstream_text[name] = text
            else:
                self._count_error(name, error.reason, str(error))
        with self._lock:
            self._scrapes += 1
            self._corrupt_skips += corrupt

        claimed: set[str] = set()
        engine_out = []
        mirrors = {u.name for u in self.upstreams if u.mirrors_engine}
        for family in engine:
            names = {family.name + s for s in _SUFFIXES} if family.type != "gauge" else {family.name}
            names |= {s.name for s in family.samples}
            if names & claimed or family.name.startswith(PREFIX):
                self._drop(ENGINE, family.name)
                continue
            claimed |= names
            engine_out.append(family)
        from_engine = set(claimed)
        upstream_out: list[str] = []
        for name, text in upstream_text.items():
            for block in split_families(text):
                names = {block.name, *block.sample_names}
                if name in mirrors and names <= from_engine:
                    continue
                if block.name.startswith(PREFIX) or names & claimed:
                    self._drop(name, block.name)
                    continue
                claimed |= names
                upstream_out.extend(block.lines)
        durations["total"] = time.monotonic() - t0
        own = self._own_families(up, durations, corrupt)
        body = _generate(own + engine_out)
        if upstream_out:
            body += ("\n".join(upstream_out) + "\n").encode()
        return body

    def _timed_fetch(self, upstream: Upstream) -> tuple[str, float, UpstreamError | None]:
        t0 = time.monotonic()
        try:
            return self.fetch(upstream), time.monotonic() - t0, None
        except UpstreamError as e:
            return "", time.monotonic() - t0, e
        except Exception as e:  # noqa: BLE001 - never let one upstream fail the scrape
            return "", time.monotonic() - t0, UpstreamError("internal", f"{type(e).__name__}: {e}")

    def render_safely(self) -> bytes:
        try:
            return self.render()
        except Exception as e:
            log.exception("metrics proxy: merge failed; answering with the proxy's own metrics")
            self._count_error("proxy", "internal", str(e))
            return _generate(self._own_families({}, {}, 0))

    # -- bookkeeping ---------------------------------------------------------------------------
    def _drop(self, source: str, family: str) -> None:
        with self._lock:
            self._dropped[source] += 1
        self._warn_once(
            "clash", f"{source}/{family}", f"dropping family {family!r} from {source}: name in use"
        )

    def _count_error(self, source: str, reason: str, message: str) -> None:
        with self._lock:
            self._errors[(source, reason)] += 1
        self._warn_once(f"error-{reason}", source, f"upstream {source}: {reason}: {message}")

    def _warn_once(self, kind: str, key: str, message: str) -> None:
        with self._lock:
            if (kind, key) in self._warned:
                return
            self._warned.add((kind, key))
        log.warning(message)

    def _own_families(self, up: dict[str, bool], durations: dict[str, float], corrupt: int) -> list[Metric]:
        p = PREFIX
        g_up = GaugeMetricFamily(p + "up", "1 if the source answered this scrape, else 0.", labels=["source"])
        for name, ok in up.items():
            g_up.add_metric([name], 1.0 if ok else 0.0)
        g_dur = GaugeMetricFamily(
            p + "scrape_duration_seconds", "Time to collect each source in this scrape.", labels=["source"]
        )
        for name, seconds in durations.items():
            g_dur.add_metric([name], seconds)
        g_corrupt = GaugeMetricFamily(
            p + "corrupt_files", "Unreadable *.db files skipped in this scrape.", value=corrupt
        )
        with self._lock:
            c_scrapes = CounterMetricFamily(p + "scrapes", "Scrapes served.", value=self._scrapes)
            c_skips = CounterMetricFamily(
                p + "corrupt_file_skips",
                "Unreadable *.db files skipped, all scrapes.",
                value=self._corrupt_skips,
            )
            c_drop = CounterMetricFamily(
                p + "dropped_families", "Families dropped for a name already in use.", labels=["source"]
            )
            for source, n in sorted(self._dropped.items()):
                c_drop.add_metric([source], n)
            c_err = CounterMetricFamily(
                p + "upstream_errors", "Failed upstream fetches by reason.", labels=["source", "reason"]
            )
            for (source, reason), n in sorted(self._errors.items()):
                c_err.add_metric([source, reason], n)
        return [g_up, g_dur, g_corrupt, c_scrapes, c_skips, c_drop, c_err]


class _Families:
    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def _generate(families: list[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)

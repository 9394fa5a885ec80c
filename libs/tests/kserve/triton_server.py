"""The real Triton Inference Server for tests and benchmarks: nvidia-pytriton's `tritonserver`
2.51 with its Python backend, from .venv-triton (third_party/python/triton.lock).

tools/bazel builds .venv-triton (ensure_triton_venv): the lock installed with --no-deps, and
`tritonserver-backends/python/` inside it (the wheel's Python backend with the stub for the
venv's Python beside `libtriton_python.so`, where Triton looks for it). Tests get the venv as
$PAVED_TRITON_HOME. What the server needs to run here (../shared/FIELD_NOTES.md, "Triton /
KServe v2"): LD_LIBRARY_PATH on the wheel's `nvidia_pytriton.libs`, and the venv's `bin/` first
on PATH, because the stub finds numpy through the `python3` on PATH and needs numpy 1.x (with
numpy 2 every inference fails). Only the Python backend ships in the wheel: no PyTorch, ONNX,
FIL or vLLM backends, so a repository with such models is served with `models=` naming the
ones Triton can load (explicit model control).
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

__all__ = ["TritonUrls", "find_triton_home", "paved_kserve_server", "triton_server"]

HOME_ENV = "PAVED_TRITON_HOME"
VENV_NAME = ".venv-triton"
_HINT = (
    "tools/bazel builds it from third_party/python/triton.lock before any `test` or `run` "
    "(ensure_triton_venv), e.g. `tools/bazel test //libs/tests/kserve:triton_server_test`; "
    f"or point {HOME_ENV} at such a venv"
)

# What a start that failed for a reason of the moment leaves in the log (see `triton_server`).
_TRANSIENT_START_FAILURES = (b"already in use", b"boost::interprocess::lock_exception")


class TritonUrls(NamedTuple):
    """Where a started server answers. `http` and `grpc` are `127.0.0.1:PORT`, the form
    tritonclient's clients take; `metrics` is the full URL of the Prometheus endpoint. `pgid`:
    the server's process group, it and the processes it started (Python-backend stubs, model
    workers), for a benchmark that reads their CPU time."""

    http: str
    grpc: str
    metrics: str
    pgid: int = 0


class _Layout(NamedTuple):
    home: Path
    server: Path
    backends: Path
    libs: Path


def _repo_venv() -> Path | None:
    """The workspace's .venv-triton, above this file or in `bazel run`'s workspace."""
    starts = [Path(__file__).resolve().parent]
    if os.environ.get("BUILD_WORKSPACE_DIRECTORY"):
        starts.insert(0, Path(os.environ["BUILD_WORKSPACE_DIRECTORY"]))
    for start in starts:
        for folder in (start, *start.parents):
            if (folder / VENV_NAME).is_dir():
                return folder / VENV_NAME
    return None


def find_triton_home() -> Path:
    """The venv holding tritonserver: $PAVED_TRITON_HOME, else the workspace's .venv-triton.

    Never returns a venv the server cannot run from (the binary, the prepared backends folder
    with its stub, the shared libraries): raises RuntimeError naming what builds it instead, so a
    test never skips silently."""
    env = os.environ.get(HOME_ENV)
    if env:
        home = Path(env)
    elif os.environ.get("TEST_TMPDIR"):
        # Under `bazel test` the venv is named by tools/bazel; guessing a path could pick up a
        # stale venv that no lock hash invalidates.
        raise RuntimeError(f"{HOME_ENV} is not set in this test's environment: {_HINT}")
    else:
        found = _repo_venv()
        if found is None:
            raise RuntimeError(f"no {VENV_NAME} in this workspace and {HOME_ENV} is not set: {_HINT}")
        home = found
    _layout(home)
    return home


def _layout(home: Path) -> _Layout:
    sites = sorted(home.glob("lib/python3*/site-packages"))
    if not sites:
        raise RuntimeError(f"{home} is not a venv (no lib/python3*/site-packages): {_HINT}")
    site = sites[-1]
    layout = _Layout(
        home=home,
        server=site / "pytriton" / "tritonserver" / "bin" / "tritonserver",
        backends=home / "tritonserver-backends",
        libs=site / "nvidia_pytriton.libs",
    )
    for path in (layout.server, layout.backends / "python" / "triton_python_backend_stub"):
        if not os.access(path, os.X_OK):
            raise RuntimeError(f"{path} is missing or not executable: {_HINT}")
    if not (layout.backends / "python" / "libtriton_python.so").is_file() or not layout.libs.is_dir():
        raise RuntimeError(f"{home} lacks the Python backend or nvidia_pytriton.libs: {_HINT}")
    return layout


def _free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held together while probing so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@functools.cache
def _python_libdir(home: Path) -> str:
    out = subprocess.run(
        [str(home / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip()


def _server_env(layout: _Layout) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    # The stub embeds Python and takes numpy from the python3 it finds on PATH: the venv's.
    env["PATH"] = f"{layout.home / 'bin'}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
    env["VIRTUAL_ENV"] = str(layout.home)
    # The stub is linked against `libpython3.11.so`, which the loader would take from the system
    # (Debian's 3.11.2) while the stdlib is the venv Python's (3.11.7): extension modules then
    # miss symbols (`_ssl`: `_PyModule_Add`). The venv Python's own libdir goes first.
    libs = [_python_libdir(layout.home), str(layout.libs)]
    if os.environ.get("LD_LIBRARY_PATH"):
        libs.append(os.environ["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    return env


def _get(url: str, timeout_s: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def _wait_ready(proc: subprocess.Popen[bytes], urls: TritonUrls, deadline: float) -> bool:
    """True once the server is ready on HTTP and accepts gRPC connections; False if it exited."""
    grpc_host, grpc_port = urls.grpc.rsplit(":", 1)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(OSError):
            if _get(f"http://{urls.http}/v2/health/ready", 2.0) == 200:
                with socket.create_connection((grpc_host, int(grpc_port)), timeout=2.0):
                    return True
        time.sleep(0.1)
    raise TimeoutError("tritonserver was not ready in time")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (the server and its stubs), SIGKILL if it lingers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
    # Stubs outlive a server that died: the group goes either way.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def log_tail(path: Path, chars: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def triton_server(
    repository: Path,
    tmp: Path,
    *,
    models: Iterable[str] | None = None,
    extra_args: Iterable[str] = (),
    start_timeout_s: float = 180.0,
) -> Iterator[TritonUrls]:
    """Runs tritonserver on (a copy of) `repository` on free loopback ports and yields its TritonUrls once
    it is ready (every model loaded: a model that fails to load makes the start fail).

    `models`: load only these (explicit model control; the index still lists the others, as
    Triton's does). The server's output goes to `tmp/tritonserver.log`; its tail is in the error
    of a failed start and is printed when the block raises. Invariant: when the block exits, the
    server's whole process group (the server and every Python-backend stub) is gone."""
    layout = _layout(find_triton_home())
    tmp.mkdir(parents=True, exist_ok=True)
    log_path = tmp / "tritonserver.log"
    # Served from a copy: the stub's embedded Python ignores PYTHONDONTWRITEBYTECODE and would
    # write __pycache__ beside every model.py of the source tree.
    served = tmp / "repository"
    shutil.rmtree(served, ignore_errors=True)
    shutil.copytree(repository, served, ignore=shutil.ignore_patterns("__pycache__"))
    model_args: list[str] = []
    if models is not None:
        model_args = ["--model-control-mode=explicit", *(f"--load-model={m}" for m in models)]
    proc: subprocess.Popen[bytes] | None = None
    urls: TritonUrls | None = None
    try:
        deadline = time.monotonic() + start_timeout_s
        # Retried (on other ports) when the server exits for a reason of the moment: a probed
        # port taken before the server bound it, or the Python backend's intermittent abort at
        # start (boost::interprocess::lock_exception while its stubs initialise, upstream
        # triton-inference-server/server#8882; it aborted a CI run here once).
        for _ in range(3):
            attempt_starts = log_path.stat().st_size if log_path.exists() else 0
            http, grpc, metrics = _free_ports(3)
            urls = TritonUrls(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics")
            command = [
                str(layout.server),
                f"--model-repository={served.absolute()}",
                f"--backend-directory={layout.backends}",
                "--http-address=127.0.0.1",
                f"--http-port={http}",
                "--grpc-address=127.0.0.1",
                f"--grpc-port={grpc}",
                "--metrics-address=127.0.0.1",
                f"--metrics-port={metrics}",
                "--allow-gpu-metrics=false",
                "--exit-timeout-secs=5",
                *model_args,
                *extra_args,
            ]
            with log_path.open("ab") as log:
                log.write(f"$ {' '.join(command)}\n".encode())
                log.flush()
                proc = subprocess.Popen(
                    command,
                    cwd=tmp,
                    env=_server_env(layout),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            if _wait_ready(proc, urls, deadline):
                break
            _stop(proc)
            proc = None
            with log_path.open("rb") as log:
                log.seek(attempt_starts)
                output = log.read()
            if not any(transient in output for transient in _TRANSIENT_START_FAILURES):
                break
        if proc is None or urls is None:
            raise RuntimeError(f"tritonserver did not start (log {log_path}):\n{log_tail(log_path)}")
        try:
            yield urls._replace(pgid=proc.pid)
        except BaseException:
            print(f"--- tritonserver log ({log_path}), tail:\n{log_tail(log_path)}", file=sys.stderr)
            raise
    finally:
        if proc is not None:
            _stop(proc)


def _forward_lines(proc: subprocess.Popen[bytes], lines: queue.Queue[str]) -> None:
    assert proc.stdout is not None
    for raw in proc.stdout:
        lines.put(raw.decode(errors="replace"))
    lines.put("")


@contextlib.contextmanager
def paved_kserve_server(
    repository: Path,
    tmp: Path,
    *,
    extra_args: Iterable[str] = (),
    start_timeout_s: float = 60.0,
    source: Path | None = None,
) -> Iterator[TritonUrls]:
    """Runs paved's KServe server (`paved.kserve.main --model-repository`) on `repository` in a
    subprocess of this interpreter, on free loopback ports, and yields its TritonUrls once it
    listens (its models may still be loading: wait for the ones you need). Its output goes to
    `tmp/paved-kserve.log` (tail printed when the block raises); the process is stopped (SIGTERM,
    then SIGKILL) when the block exits. `source`: another paved source tree whose `libs/` comes
    first on the server's path (a benchmark's baseline, e.g. `git archive` of an older commit)."""
    tmp.mkdir(parents=True, exist_ok=True)
    log_path = tmp / "paved-kserve.log"
    code = "import sys; from paved.kserve.main import main; sys.exit(main(sys.argv[1:]))"
    command = [
        sys.executable,
        "-c",
        code,
        "--model-repository",
        str(repository.absolute()),
        "--host",
        "127.0.0.1",
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        *extra_args,
    ]
    path = [p for p in sys.path if p]
    if source is not None:
        path.insert(0, str((source / "libs").absolute()))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )
    try:
        # The main prints its bound ports on one line once both listeners are up; a reader thread
        # keeps draining stdout after it, so a full pipe never blocks the server.
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_forward_lines, args=(proc, lines), daemon=True).start()
        ports: tuple[str, str] | None = None
        deadline = time.monotonic() + start_timeout_s
        while ports is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if not line:
                break  # stdout closed: the process exited
            parts = line.split()
            if line.startswith("paved kserve: gRPC") and len(parts) >= 6:
                ports = (parts[3], parts[5])
        if ports is None:
            raise RuntimeError(f"paved kserve did not start (log {log_path}):\n{log_tail(log_path)}")
        grpc_port, http_port = ports
        try:
            yield TritonUrls(
                f"127.0.0.1:{http_port}",
                f"127.0.0.1:{grpc_port}",
                f"http://127.0.0.1:{http_port}/metrics",
                proc.pid,
            )
        except BaseException:
            print(f"--- paved kserve log ({log_path}), tail:\n{log_tail(log_path)}", file=sys.stderr)
            raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

"""`up` as a process (python -m paved.platform.up, what //services/platform:up runs) on the
simulated engine: 2 replicas in each of 2 regions, the package in a loopback S3, an official
`openai` client request through the gateway with the key it printed, /v1/models, then SIGTERM:
exit 0 and no process it started left (every one carries a marker in its environment, inherited
from the `up` process); SIGTERM or SIGHUP while replicas boot, and a failed start (exit 1), leave nothing
either. And the flag checks: each bad flag is exit 2 with a one-line message, before anything
starts (also as `paved up`)."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from paved.cli.main import main as paved_main
from paved.control_plane.prometheus import RULE_FILES
from paved.platform import guardian
from paved.platform.up import (
    MAX_PROMETHEUS_INTERVAL_S,
    PORTS_PER_REGION,
    PROMETHEUS_RETENTION,
    UsageError,
    build_parser,
    config_from_args,
)
from paved.platform.up import main as up_main
from paved.procs import marked_processes
from paved.runfiles import runfile
from paved.testing.ports import port_block

MARKER = "PAVED_TEST_UP"


def replica_ports(regions: int = 1) -> str:
    """`--replica-ports` over a range no concurrent test holds (paved.testing.ports)."""
    return str(port_block(PORTS_PER_REGION * regions)[0])


def marked(token: str) -> dict[int, str]:
    return marked_processes(MARKER, token)


class Up:
    """`python -m paved.platform.up ARGS` with the marker in its environment; its output read
    line by line."""

    def __init__(self, tmp_path: Path, *args: str):
        self.token = f"{os.getpid()}-{time.monotonic_ns()}"
        env = {**os.environ, MARKER: self.token, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        env.pop("PAVED_ADMIN_KEY", None)
        argv = [sys.executable, "-u", "-m", "paved.platform.up", "--work-dir", str(tmp_path / "work"), *args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode(errors="replace"))
        self.lines.put(None)

    def read_until(self, pattern: str, timeout_s: float) -> re.Match[str] | None:
        """The first match of `pattern` in a new line; None once up has exited."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                return None
            self.output.append(line)
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"no {pattern!r} from up within {timeout_s} s:\n{self.text()}")

    def expect(self, pattern: str, timeout_s: float) -> re.Match[str]:
        match = self.read_until(pattern, timeout_s)
        assert match is not None, f"up exited before {pattern!r}:\n{self.text()}"
        return match

    def text(self) -> str:
        return "".join(self.output)

    def wait(self, timeout_s: float = 240) -> int:
        status = self.proc.wait(timeout_s)
        while self.read_until(r"$^", 10) is not None:  # the rest of its output
            pass
        return status

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in marked(self.token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_up_serves_through_the_gateway_and_leaves_nothing_behind(tmp_path: Path) -> None:
    up = Up(
        tmp_path, "--port", "0", "--replica-ports", replica_ports(regions=2),
        "--engine", "sim", "--replicas", "2", "--regions", "2", "--boot-timeout", "240", "--s3",
    )  # fmt: skip
    proc, token, read_until, output = up.proc, up.token, up.expect, up.output
    try:
        gateway = read_until(r"^  gateway: (http://\S+)", 300).group(1)
        kserve = read_until(r"^  gateway KServe v2 gRPC: (\S+)", 30).group(1)
        key = read_until(r"^  api key \(demo\): (\S+)", 30).group(1)
        pids = [int(p) for p in read_until(r"^  pids: ([\d ]+)", 30).group(1).split()]
        listed = re.compile(r"^  replica \S+ (\S+)@v1 \[(r[12])\]: http://\S+  metrics: (http://\S+)")
        replica_lines = [m.groups() for line in output if (m := listed.match(line))]
        assert len(replica_lines) == 6, output
        assert sorted((model, region) for model, region, _ in replica_lines) == sorted(
            [
                ("tiny", "r1"),
                ("tiny", "r1"),
                ("tiny", "r2"),
                ("tiny", "r2"),
                ("xgb_scorer", "r1"),
                ("xgb_scorer", "r2"),
            ]
        )
        # Each replica's metrics come through its launcher's metrics proxy.
        for _, _, url in replica_lines:
            text = httpx.get(url, timeout=10).text
            assert re.search(r'^paved_metrics_proxy_up\{source="\w+"\} 1', text, re.M), (url, text[:500])
        # The packages came from the loopback S3, which the launchers read them from.
        for model in ("tiny", "xgb_scorer"):
            assert any(
                line.startswith(f"registered {model}@v1 from s3://paved-models/") for line in output
            ), output
        work = tmp_path / "work"
        assert (work / "admin_key").stat().st_mode & 0o777 == 0o600

        running = marked(token)
        # The S3, control plane, Prometheus and gateway it printed, and the launchers with their
        # engines.
        assert len(pids) == 4 and set(pids) <= set(running), (pids, running)
        assert [running[pid].split(" -m ", 1)[-1].split()[0] for pid in pids] == [
            "moto.server",
            "paved.control_plane.server",
            "/usr/bin/prometheus",
            "paved.gateway.server",
        ]
        # Prometheus on by default, on loopback, scraping the fleet (prometheus_e2e_test asserts more).
        prom = [
            m.group(1)
            for line in output
            if (m := re.match(r"^  prometheus: (http://127\.0\.0\.1:\d+) ", line))
        ]
        assert len(prom) == 1, output
        assert httpx.get(prom[0] + "/-/ready", timeout=10).status_code == 200
        mains = [cmd.split(" -m ", 1)[-1].split()[0] for cmd in running.values()]
        assert mains.count("paved.launcher.main") == 6, running
        assert mains.count("paved.frontend.server") == 4, running
        assert mains.count("paved.kserve.main") == 2, running

        client = openai.OpenAI(base_url=gateway + "/v1", api_key=key, max_retries=0, timeout=60)
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
        assert raw.http_response.status_code == 200
        assert raw.parse().choices[0].message.content
        assert "tiny" in [m.id for m in client.models.list().data]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=gateway + "/v1", api_key="pvd_wrong", max_retries=0).models.list()
        kserve_through_the_gateway(kserve, key)
        kserve_http_through_the_gateway(gateway, key)

        proc.send_signal(signal.SIGTERM)
        assert up.wait() == 0, up.text()
        assert marked(token) == {}, marked(token)
        assert "up: stopped\n" in output
    finally:
        up.cleanup()


def kserve_through_the_gateway(target: str, key: str) -> None:
    """tritonclient (gRPC) with the tenant's key: the XGBoost fixture scores as xgboost does,
    the (simulated) LLM generates."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    import xgboost

    from paved.runfiles import runfile

    headers = {"authorization": f"Bearer {key}"}
    x = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    expected = xgboost.Booster(model_file=runfile("models/xgb/model.ubj")).inplace_predict(x)
    c = grpcclient.InferenceServerClient(target)
    try:
        t = grpcclient.InferInput("input__0", [4, 32], "FP32")
        t.set_data_from_numpy(x)
        assert np.array_equal(c.infer("xgb_scorer", [t], headers=headers).as_numpy("output__0"), expected)
        prompt = grpcclient.InferInput("text_input", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([b"hello"], dtype=object))
        text = c.infer("tiny", [prompt], headers=headers).as_numpy("text_output")
        assert text is not None and len(text) == 1 and text[0], text
    finally:
        c.close()


def kserve_http_through_the_gateway(gateway: str, key: str) -> None:
    """tritonclient.http with the tenant's key on the gateway's HTTP port: the (simulated) LLM
    is ready and generates over KServe HTTP too (its replicas serve /v2 on their HTTP port), as
    the XGBoost model does."""
    import numpy as np
    import tritonclient.http as httpclient

    headers = {"authorization": f"Bearer {key}"}
    c = httpclient.InferenceServerClient(gateway.removeprefix("http://"), network_timeout=60)
    try:
        assert c.is_model_ready("tiny", headers=headers)
        assert c.is_model_ready("xgb_scorer", headers=headers)
        prompt = httpclient.InferInput("text_input", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([b"hello"], dtype=object))
        text = c.infer("tiny", [prompt], headers=headers).as_numpy("text_output")
        assert text is not None and len(text) == 1 and text[0], text
    finally:
        c.close()


# SIGHUP: the terminal `up` runs in closed (its children, in sessions of their own, get none).
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_while_replicas_boot_stops_everything(tmp_path: Path, sig: signal.Signals) -> None:
    up = Up(tmp_path, "--port", "0", "--replica-ports", replica_ports(), "--engine", "sim", "--replicas", "3")
    try:
        up.expect(r"^replica \S+ tiny@v1 \[local\] \S+: starting", 120)
        assert marked(up.token)
        up.proc.send_signal(sig)
        assert up.wait() == 0, up.text()
        assert marked(up.token) == {}, marked(up.token)
        assert not any(line.startswith("paved platform is up") for line in up.output)
    finally:
        up.cleanup()


def test_a_sigkilled_up_leaves_nothing_behind(tmp_path: Path) -> None:
    """kill -9 (an OOM kill, a CI runner's timeout) runs none of up's teardown: its guardian
    sees the pipe from up close and ends the control plane, the gateway, S3 and every replica."""
    up = Up(tmp_path, "--port", "0", "--replica-ports", replica_ports(), "--engine", "sim", "--replicas", "2")
    try:
        up.expect(r"^replica \S+ tiny@v1 \[local\] \S+: starting", 120)
        children = marked(up.token)
        assert len(children) >= 4, children  # guardian, control plane, gateway, replicas
        up.proc.kill()
        up.proc.wait(10)
        deadline = time.monotonic() + 60
        while marked(up.token) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert marked(up.token) == {}, marked(up.token)
        log = (tmp_path / "work" / "logs" / "guardian.log").read_text()
        assert "up ended without stopping its processes" in log, log
    finally:
        up.cleanup()


# A process that, told to stop, starts another marked one and exits (a supervisor handing over):
# the newcomer, which was not there at the first scan, must get its SIGTERM too.
_HANDS_OVER = r"""
import os, signal, subprocess, sys, time
d = sys.argv[1]
newcomer = (
    "import pathlib, signal, sys, time\n"
    "def stop(*_):\n"
    "    pathlib.Path(sys.argv[1], 'newcomer-termed').touch(); sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "pathlib.Path(sys.argv[1], 'newcomer').touch()\n"
    "time.sleep(60)\n"
)
def stop(*_):
    subprocess.Popen([sys.executable, "-c", newcomer, d], start_new_session=True)
    deadline = time.monotonic() + 20
    while not os.path.exists(os.path.join(d, "newcomer")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(d, "ready"), "w").close()
time.sleep(60)
"""


def test_the_guardian_stops_a_process_that_appears_while_the_others_stop(tmp_path: Path) -> None:
    token = f"guardian-test-{os.getpid()}"
    env = {**os.environ, guardian.MARKER_ENV: token}
    first = subprocess.Popen([sys.executable, "-c", _HANDS_OVER, str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "ready").exists()
        assert guardian.sweep(token, grace_s=20) == 2
        first.wait(10)
        # SIGTERMed (it wrote its file and exited) well before the 20 s grace ran out: not
        # SIGKILLed at its end as a process missing from the first scan used to be.
        assert (tmp_path / "newcomer-termed").exists()
        assert marked(token) == {}
    finally:
        guardian.sweep(token, grace_s=0)
        first.kill()
        first.wait(10)


def test_a_failed_start_exits_1_and_stops_what_it_started(tmp_path: Path) -> None:
    # The gateway's port is taken: the control plane is already up when the gateway fails.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        if port > 65535 - 10:
            pytest.skip("ephemeral port too high for PORT+10")
        up = Up(tmp_path, "--port", str(port), "--replica-ports", replica_ports(), "--engine", "sim")
        try:
            up.expect(r"^starting the gateway", 120)
            assert up.wait() == 1, up.text()
            errors = [line for line in up.output if line.startswith("up: error: ")]
            assert len(errors) == 1 and "gateway exited" in errors[0], up.text()
            assert marked(up.token) == {}, marked(up.token)
        finally:
            up.cleanup()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--regions", "0"], "--regions 0: between 1 and 8"),
        (["--regions", "9"], "--regions 9: between 1 and 8"),
        (["--replicas", "33"], "--replicas 33: between 1 and 32"),
        (["--replicas", "x"], "--replicas 'x': not an integer"),
        (["--engine", "tgi"], "invalid choice: 'tgi'"),
        (["--port", "80"], "--port 80: 0 (any free ports) or 1024"),
        (["--port", "30000"], "overlaps the replica ports"),
        (["--replica-ports", "65000", "--regions", "8"], "must lie within 1024-65535"),
        (["--state", "mysql://h/db"], "--state 'mysql://h/db': sqlite:///PATH or postgresql://"),
        (["--state", "sqlite:///"], "sqlite:///PATH names a file"),
        (["--redis", "http://h:6379"], "--redis 'http://h:6379': redis://HOST:PORT/DB"),
        (["--redis", "redis://h:99999/0"], "redis://HOST:PORT/DB"),
        (["--boot-timeout", "0"], "--boot-timeout 0"),
        (["--prometheus-interval", "0"], "--prometheus-interval 0: between 1 and 15 seconds"),
        (["--s3=yes"], "ignored explicit argument"),
    ],
)
def test_bad_flags_exit_2_before_starting_anything(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    work = tmp_path / "work"
    assert up_main(["--work-dir", str(work), *args]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not work.exists()
    # `paved up` is the same command.
    assert paved_main(["up", "--work-dir", str(work), *args]) == 2
    assert message in capsys.readouterr().err


def test_prometheus_interval_and_retention_fit_the_rules_windows(tmp_path: Path) -> None:
    """At a 60 s scrape a 1m rate holds one sample: PavedVersionErrorRate could never fire. The
    bound leaves four scrapes in the rules' shortest window."""
    work = str(tmp_path / "work")
    with pytest.raises(UsageError, match=r"--prometheus-interval 60: between 1 and 15 seconds"):
        config_from_args(build_parser().parse_args(["--work-dir", work, "--prometheus-interval", "60"]))
    cfg = config_from_args(build_parser().parse_args(["--work-dir", work, "--prometheus-interval", "15"]))
    assert cfg.prometheus_interval_s == MAX_PROMETHEUS_INTERVAL_S == 15
    seconds = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    windows = set()
    for name in RULE_FILES:
        text = Path(runfile(f"ops/prometheus/{name}")).read_text()
        windows |= {int(n) * seconds[u] for n, u in re.findall(r"\[(\d+)([smhd])\]", text)}
    assert min(windows) == 60, sorted(windows)
    assert min(windows) >= 4 * MAX_PROMETHEUS_INTERVAL_S
    # And the history kept covers the longest window (the SLO tickets' 3d).
    assert max(windows) == 3 * 86400, sorted(windows)
    assert PROMETHEUS_RETENTION.endswith("d") and int(PROMETHEUS_RETENTION[:-1]) * 86400 > max(windows)


@pytest.mark.parametrize("kind", ["directory", "not text"])
def test_an_unusable_admin_key_file_is_exit_1_with_one_line(
    kind: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    if kind == "directory":
        (work / "admin_key").mkdir()
    else:
        (work / "admin_key").write_bytes(b"\xff\xfe key")
    assert up_main(["--work-dir", str(work), "--no-prometheus"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("up: error: cannot read the admin key from ") and err.count("\n") == 1, err


def test_work_dir_that_is_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    assert up_main(["--work-dir", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0
    assert "exists and is not a directory" in err


def test_up_on_postgresql_and_redis(tmp_path: Path) -> None:
    """The control plane's state in PostgreSQL 15 (the machine's binaries), the gateway's limits
    in Debian's redis-server: what a shared deployment of the platform uses. And a route option
    set on the deployment (the exact cache) reaching the gateway through the routes feed."""
    import psycopg
    import redis

    from paved.testing.postgres import create_database, postgres_server
    from paved.testing.redis import redis_server

    with postgres_server() as pg, redis_server() as redis_url:
        state = create_database(pg, "paved_up")
        up = Up(
            tmp_path, "--port", "0", "--replica-ports", replica_ports(), "--engine", "sim",
            "--state", state, "--redis", redis_url, "--boot-timeout", "240",
        )  # fmt: skip
        try:
            gateway = up.expect(r"^  gateway: (http://\S+)", 300).group(1)
            control_plane = up.expect(r"^  control plane: (http://\S+)", 30).group(1)
            key = up.expect(r"^  api key \(demo\): (\S+)", 30).group(1)
            admin_key = (tmp_path / "work" / "admin_key").read_text().strip()
            r = httpx.patch(
                gateway + "/admin/v1/tenants/demo",
                headers={"Authorization": f"Bearer {admin_key}"},
                json={"limits": {"requests_per_min": 1000, "tokens_per_min": 100000}},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            client = openai.OpenAI(base_url=gateway + "/v1", api_key=key, max_retries=0, timeout=60)
            # The new limits apply once the gateway's key cache (0.5 s) has let go of the old.
            deadline = time.monotonic() + 30
            while True:
                raw = client.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=2)
                assert raw.parse().choices
                if "x-ratelimit-remaining-requests" in raw.headers or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            for _ in range(2):
                raw = client.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=2)
            # The limiter counted them, in Redis: what every gateway replica would see.
            assert int(raw.headers["x-ratelimit-remaining-requests"]) <= 997, raw.headers
            with psycopg.connect(
                state.replace("postgresql+psycopg://", "postgresql://"), connect_timeout=10
            ) as db:
                rows = db.execute("SELECT model_id, version FROM cp_deployments ORDER BY model_id").fetchall()
            assert rows == [("tiny", "v1"), ("xgb_scorer", "v1")], rows
            r = redis.Redis.from_url(redis_url, socket_timeout=10)
            try:
                assert r.dbsize() > 0
            finally:
                r.close()
            # A route option set on the deployment reaches the gateway through the routes feed:
            # the exact cache answers the second identical deterministic request.
            r = httpx.patch(
                control_plane + "/v1/deployments/tiny/v1",
                headers={"Authorization": f"Bearer {admin_key}"},
                json={"route": {"cache": {"exact": True, "ttl_s": 600}}},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            body = {"model": "tiny", "messages": [{"role": "user", "content": "cache me"}],
                    "max_tokens": 4, "temperature": 0}  # fmt: skip
            deadline, seen = time.monotonic() + 60, []
            while time.monotonic() < deadline:
                raw = client.chat.completions.with_raw_response.create(**body)
                seen.append(raw.headers.get("x-paved-cache"))
                if seen[-1] == "exact":
                    break
                time.sleep(0.5)
            assert seen[-1] == "exact", seen
            up.proc.send_signal(signal.SIGTERM)
            assert up.wait() == 0, up.text()
            assert marked(up.token) == {}, marked(up.token)
        finally:
            up.cleanup()

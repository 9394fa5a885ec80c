"""A whole fleet for scenario tests: the control-plane main, a gateway main following its routes,
the control plane's API, and a traffic driver (the official `openai` client at a fixed rate
through the gateway, every response recorded with the rollout phase it was sent in)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from gateway_proc import GatewayProcess

from paved.procs import marked_processes
from paved.runfiles import runfile
from paved.testing.ports import port_block


class ControlPlaneProcess:
    URL = re.compile(rb"serving control plane on (http://\S+)")

    def __init__(self, *args: str, admin_key: str, state: str, work_dir: Path, regions: list[str]):
        self.admin_key = admin_key
        self.args = args
        self.state = state
        self.work_dir = work_dir
        self.regions = regions
        self.log = tempfile.NamedTemporaryFile(dir=os.environ.get("TEST_TMPDIR"), delete=False)  # noqa: SIM115
        self.start()

    def start(self) -> None:
        region_args = [a for r in self.regions for a in ("--region", r)]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "paved.control_plane.server",
                "--port",
                "0",
                "--state",
                self.state,
                "--work-dir",
                str(self.work_dir),
                "--cache-dir",
                str(self.work_dir / "cache"),
                "--interval",
                "0.5",
                *region_args,
                *self.args,
            ],
            stdout=subprocess.PIPE,
            stderr=self.log,
            # Inherited by every launcher and engine it starts: reap_replicas finds them all.
            env={**os.environ, "PAVED_ADMIN_KEY": self.admin_key, FLEET_ENV: fleet_token(self.work_dir)},
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            match = self.URL.search(line)
            if match:
                self.url = match.group(1).decode()
                threading.Thread(target=self._drain, daemon=True).start()
                return
        raise RuntimeError(f"control plane exited before printing its URL:\n{self.tail()}")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    def tail(self, lines: int = 80) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def api(
        self, method: str, path: str, body: Any = None, expect: int | tuple[int, ...] = (200, 201)
    ) -> Any:
        r = httpx.request(
            method,
            self.url + path,
            json=body,
            headers={"Authorization": f"Bearer {self.admin_key}"},
            timeout=30,
        )
        expected = (expect,) if isinstance(expect, int) else expect
        assert r.status_code in expected, f"{method} {path}: {r.status_code} {r.text}"
        return r.json() if r.content else None

    def kill(self) -> None:
        """SIGKILL: a crash (its replicas keep running, the next leader adopts them)."""
        self.proc.kill()
        self.proc.wait()

    def stop(self, timeout_s: float = 120) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def wait_rollout(self, rollout_id: str, timeout_s: float = 300) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = self.api("GET", f"/v1/rollouts/{rollout_id}")
            if r["status"] != "running":
                return r
            time.sleep(0.5)
        raise AssertionError(f"rollout {rollout_id} still running after {timeout_s} s: {r}\n{self.tail()}")

    def replicas(self, model_id: str | None = None) -> list[dict[str, Any]]:
        path = "/v1/replicas" + (f"?model_id={model_id}" if model_id else "")
        return self.api("GET", path)["data"]

    def wait_for(self, what: str, predicate: Any, timeout_s: float = 180) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}\n{self.tail()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FLEET_ENV = "PAVED_TEST_FLEET"


def fleet_token(work_dir: Path) -> str:
    return hashlib.sha256(str(work_dir).encode()).hexdigest()[:16]


def fleet_processes(work_dir: Path) -> dict[int, str]:
    """pid -> command line of every live process the fleet under `work_dir` started (the
    control plane, launchers, and the engines they run in their own sessions): all carry its
    token in their environment."""
    return marked_processes(FLEET_ENV, fleet_token(work_dir))


def reap_replicas(work_dir: Path) -> None:
    for pid in fleet_processes(work_dir):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class Result:
    at: float
    phase: str
    ok: bool
    status: int | None
    version: str | None
    error: str | None = None


@dataclass
class TrafficDriver:
    """Chat requests at `rate` per second through the gateway until stopped; every one recorded."""

    gateway_url: str
    key: str
    model: str
    rate: float = 5.0
    phase: str = "start"
    structured: bool = False
    results: list[Result] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> TrafficDriver:
        self._thread.start()
        return self

    def stop(self) -> list[Result]:
        self._stop.set()
        self._thread.join(timeout=120)
        return self.results

    async def _one(self, client: openai.AsyncOpenAI) -> None:
        phase = self.phase
        started = time.monotonic()
        kwargs: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
        }
        if self.structured:
            kwargs["max_tokens"] = 40
            kwargs["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": "r",
                    "schema": {
                        "type": "object",
                        "properties": {"ok": {"type": "boolean"}},
                        "required": ["ok"],
                        "additionalProperties": False,
                    },
                },
            }
        try:
            raw = await client.chat.completions.with_raw_response.create(**kwargs)
            out = raw.parse()
            if self.structured:
                value = json.loads(out.choices[0].message.content or "")
                if set(value) != {"ok"} or not isinstance(value["ok"], bool):
                    raise ValueError(f"structured output does not match its schema: {value!r}")
            self.results.append(Result(started, phase, True, 200, raw.headers.get("x-paved-backend")))
        except openai.APIStatusError as e:
            self.results.append(Result(started, phase, False, e.status_code, None, str(e)[:300]))
        except Exception as e:  # noqa: BLE001 - every failure is a recorded result
            self.results.append(Result(started, phase, False, None, None, f"{type(e).__name__}: {e}"[:300]))

    async def _run(self) -> None:
        client = openai.AsyncOpenAI(
            base_url=self.gateway_url + "/v1", api_key=self.key, max_retries=0, timeout=60
        )
        tasks: set[asyncio.Task[None]] = set()
        interval = 1.0 / self.rate
        next_at = time.monotonic()
        while not self._stop.is_set():
            task = asyncio.ensure_future(self._one(client))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        if tasks:
            await asyncio.wait(tasks, timeout=60)
        await client.close()

    def failures(self) -> list[Result]:
        return [r for r in self.results if not r.ok]


def gateway_for(cp: ControlPlaneProcess, tmp: Path, *args: str) -> GatewayProcess:
    return GatewayProcess(
        cp.url + "/v1/routes",
        "--routes-token", cp.admin_key, "--health-interval", "0.5", *args,
        admin_key=cp.admin_key, state_dir=tmp,
    )  # fmt: skip


SIM = "sim://tiny?tokens_per_s=2000&max_num_seqs=64"
FAST = {
    "phases": [50, 100],
    "interval_s": 2,
    "health_timeout_s": 120,
    "fast_rollback_window_s": 1,
    "min_requests": 3,
}


async def chat_burst(
    url: str, key: str, n: int, *, max_tokens: int = 4, timeout_s: float = 120
) -> list[tuple[int | str, float]]:
    """(status, seconds from the burst's start to the answer) of `n` chat requests for `tiny` sent
    at once through the official client with no retries; a failure that is not an HTTP status is
    its exception's type name, so every request has a result."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=timeout_s)
    started = time.perf_counter()

    async def one(i: int) -> tuple[int | str, float]:
        try:
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=max_tokens
            )
            status: int | str = 200
        except openai.APIStatusError as e:
            status = e.status_code
        except Exception as e:  # noqa: BLE001 - every failure is a result
            status = type(e).__name__
        return status, time.perf_counter() - started

    try:
        return list(await asyncio.gather(*(one(i) for i in range(n))))
    finally:
        await client.close()


def tiny_package() -> str:
    return runfile("services/launcher/tiny_package.tar")


def deploy(
    cp, version: str, *, engine: str = SIM, strategy: str = "red_black", replicas: int = 1, regions=None
):
    body = {
        "model_id": "tiny",
        "version": version,
        "package_uri": tiny_package(),
        "strategy": strategy,
        "replicas": replicas,
        "engine": engine,
    }
    if regions:
        body["regions"] = regions
    return cp.api("POST", "/v1/deployments", body)


def rollout(cp, version: str, **params):
    return cp.api(
        "POST", "/v1/rollouts", {"model_id": "tiny", "version": version, "params": {**FAST, **params}}
    )


def first_deploy(cp, gw, key, **kw):
    deploy(cp, "v1", **kw)
    r = cp.wait_rollout(rollout(cp, "v1")["id"])
    assert r["status"] == "succeeded", r
    cp.wait_for("v1 served through the gateway", lambda: serves(gw, key))


def serves(gw, key) -> bool:
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        timeout=30,
    )
    return r.status_code == 200


def audit_messages(cp, rollout_id: str) -> list[str]:
    return [e["message"] for e in cp.api("GET", f"/v1/audit?rollout_id={rollout_id}&limit=1000")["data"]]


def model_messages(cp, model_id: str = "tiny") -> list[str]:
    """Every audit message about `model_id` (its replicas' too) and the fleet-wide ones: what a
    failed scenario prints, since a rollout's own events say only that a replica failed."""
    return [e["message"] for e in cp.api("GET", f"/v1/audit?model_id={model_id}&limit=1000")["data"]]


def region(name: str = "local", n: int = 100) -> str:
    """A `--region` spec over `n` ports this test process alone holds (paved.testing.ports)."""
    lo, hi = port_block(n)
    return f"{name}={lo}-{hi}"


@contextlib.contextmanager
def make_fleet(tmp_path: Path) -> Iterator[Callable[..., tuple[ControlPlaneProcess, GatewayProcess, str]]]:
    """`make(regions=...)` -> (control plane, gateway following it, a tenant's key); all stopped
    and every replica reaped on exit."""
    made: list[Any] = []

    def make(regions: tuple[str, ...] | list[str] | None = None, *cp_args: str):
        if regions is None:
            regions = (region(),)
        key = "adm-" + secrets.token_hex(16)
        gateway_port = free_port()
        cp = ControlPlaneProcess(
            "--gateway-metrics",
            f"http://127.0.0.1:{gateway_port}/metrics",
            *cp_args,
            admin_key=key,
            state=f"sqlite:///{tmp_path / 'cp.sqlite'}",
            work_dir=tmp_path / "work",
            regions=list(regions),
        )
        made.append(cp)
        gw = gateway_for(cp, tmp_path, "--port", str(gateway_port))
        made.append(gw)
        gw.tenant("team")
        return cp, gw, gw.key("team")

    try:
        yield make
    finally:
        for thing in reversed(made):
            thing.stop()
        reap_replicas(tmp_path / "work")

"""A throwaway PostgreSQL 15 server for tests, from the machine's binaries.

`postgres_server()` initialises a cluster in a fresh short directory under /tmp, starts it on a
free loopback port (127.0.0.1 only; its unix socket sits in the same directory) and yields
`postgresql://postgres@127.0.0.1:PORT/postgres`; on exit it always stops the server
(`pg_ctl -m fast stop`) and removes the directory. `create_database(url, name)` adds a fresh
database (much cheaper than a fresh cluster) and returns its URL.

Why it looks like this (docs: /work/shared/FIELD_NOTES.md, "PostgreSQL 15"):
- initdb/pg_ctl/postgres refuse to run as root, and inside Bazel's sandbox only uid 0 is
  mapped, so `runuser` fails there; as root every command runs under
  `unshare --user --map-user=postgres --map-group=postgres --` instead (files stay root-owned).
- Bazel's test env has no LANG, so the cluster is always UTF8 / C.UTF-8 (else SQL_ASCII).
- `$TEST_TMPDIR` is too long for a unix socket path, hence the short mkdtemp under /tmp.
Every subprocess has a timeout, so a broken binary fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

from paved.net import free_port

PG_BIN = Path("/usr/lib/postgresql/15/bin")
_DB_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def _prefix() -> list[str]:
    if os.geteuid() == 0:
        return ["unshare", "--user", "--map-user=postgres", "--map-group=postgres", "--"]
    return []


def _run(args: list[str], log: Path, timeout_s: float) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "LC_"))}
    env["LANG"] = "C.UTF-8"
    with log.open("ab") as out:
        proc = subprocess.run(  # noqa: S603 - fixed PostgreSQL binaries, argv built here
            [*_prefix(), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            timeout=timeout_s,
            check=False,
        )
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{Path(args[0]).name} failed (exit {proc.returncode}):\n{tail}")


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Start a private PostgreSQL 15; yields its superuser URL (trust auth, loopback only)."""
    if not (PG_BIN / "initdb").exists():
        raise RuntimeError(f"PostgreSQL 15 binaries not found in {PG_BIN}")
    base = Path(tempfile.mkdtemp(prefix="pg", dir="/tmp"))
    data = base / "data"
    log = base / "log.txt"
    started = False
    try:
        _run(
            [
                str(PG_BIN / "initdb"),
                "-D",
                str(data),
                "-E",
                "UTF8",
                "--locale=C.UTF-8",
                "-A",
                "trust",
                "-U",
                "postgres",
            ],
            log,
            timeout_s=120,
        )
        # A port picked here can be taken before postgres binds it: retry with another.
        for attempt in range(3):
            port = free_port()
            opts = (
                f"-c listen_addresses=127.0.0.1 -p {port} -k {base} "
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=100"
            )
            try:
                _run(
                    [
                        str(PG_BIN / "pg_ctl"),
                        "-D",
                        str(data),
                        "-w",
                        "-t",
                        "60",
                        "-o",
                        opts,
                        "-l",
                        str(base / "server.log"),
                        "start",
                    ],
                    log,
                    timeout_s=90,
                )
            except RuntimeError:
                # Never leave a half-started server behind before the next try.
                with contextlib.suppress(Exception):
                    _run(
                        [
                            str(PG_BIN / "pg_ctl"),
                            "-D",
                            str(data),
                            "-m",
                            "immediate",
                            "-w",
                            "-t",
                            "30",
                            "stop",
                        ],
                        log,
                        timeout_s=60,
                    )
                if attempt == 2:
                    server_log = (
                        (base / "server.log").read_text(errors="replace")[-2000:]
                        if (base / "server.log").exists()
                        else ""
                    )
                    raise RuntimeError(f"PostgreSQL did not start:\n{server_log}") from None
                continue
            started = True
            break
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        if started:
            with contextlib.suppress(Exception):
                _run(
                    [str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "30", "stop"],
                    log,
                    timeout_s=60,
                )
        shutil.rmtree(base, ignore_errors=True)


def create_database(url: str, name: str) -> str:
    """CREATE DATABASE `name` on the server at `url`; returns the new database's URL."""
    if _DB_NAME.fullmatch(name) is None:
        raise ValueError(f"database name must match {_DB_NAME.pattern}")
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))

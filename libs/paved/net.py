"""Port helpers: a free port to bind now (servers started beside each other), and whether a
port is bound (the local driver's allocation and the tests' port claims)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing has bound on `host` right now (the kernel's pick; a moment's answer)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing has `port` bound on `host` right now (a moment's answer: whoever needs to keep
    it must bind it, or reserve it some other way)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True

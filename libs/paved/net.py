"""Loopback port checks shared by the local driver and the tests' port claims."""

from __future__ import annotations

import socket


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing has `port` bound on `host` right now (a moment's answer: whoever needs to keep
    it must bind it, or reserve it some other way)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True

"""Listening sockets bound before the server starts, so a port of 0 is known (and printed) the
moment the process is ready, and a child process can inherit it."""

from __future__ import annotations

import socket


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock

"""Listening sockets bound before the server starts, so a port of 0 is known (and printed) the
moment the process is ready, and a child process can inherit it."""

from __future__ import annotations

import socket

# A paved server keeps an idle keep-alive connection this long, and every paved client pool lets
# go of one after POOL_KEEPALIVE_S, well before. With the order reversed (uvicorn's default is
# 5 s, aiohttp's pool 15 s) a pooled connection is reused at the instant the server closes it,
# and a POST on it fails with ServerDisconnectedError: a red-black rollout under load lost a
# request that way.
SERVER_KEEPALIVE_S = 75
POOL_KEEPALIVE_S = 15.0


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock

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
# listen()'s backlog for paved's listeners: the kernel caps it at net.core.somaxconn (4096 by
# default since Linux 5.4), so this asks for the deepest accept queue the host allows. asyncio's
# default (100) overflowed under a 300-connection burst (a gateway opening one connection per
# concurrent stream): the kernel dropped the surplus SYNs and those clients retried only after
# 1 s, 3 s, 7 s, past a gateway's connect timeout.
LISTEN_BACKLOG = 65535


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def adopt(fd: int) -> socket.socket:
    """The TCP socket behind an inherited descriptor (a launcher's reserved public port), kept
    from this process's own children. Raises OSError / ValueError if `fd` is not one."""
    sock = socket.socket(fileno=fd)
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.detach()
        raise ValueError(f"descriptor {fd} is not a TCP socket")
    sock.set_inheritable(False)
    return sock

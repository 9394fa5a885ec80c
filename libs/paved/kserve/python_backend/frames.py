"""The frames a Python model's worker process and the server exchange over their socket.

A frame is a pickled message (a tuple whose first item names it) whose large buffers, numpy
arrays among them, travel out of band (pickle protocol 5): the header says how long the pickle
and each buffer are, then the pickle and the buffers follow as they are, so an array crosses
the socket without being copied into the pickle first. Frames on one socket never interleave
(each side sends whole frames under a lock or from one task), and arrive in the order sent:
the server relies on a worker's responses arriving before the "executed" that follows them.

Only the standard library and numpy (through pickle) are used: the worker imports this module
before any of the server's dependencies, and must start fast.
"""

from __future__ import annotations

import pickle
import socket
import struct
import threading
from typing import Any

# meta length, buffer count; then one length per buffer.
HEADER = struct.Struct("<QI")
LENGTH = struct.Struct("<Q")
# A frame larger than this is a broken peer, not a message (tensors this large do not reach a
# KServe server: its gRPC and HTTP limits are far below).
MAX_FRAME_BYTES = 1 << 34


def encode(message: tuple) -> list[bytes | memoryview]:
    """The parts of one frame, in order (write them all, then the frame is complete)."""
    buffers: list[pickle.PickleBuffer] = []
    meta = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    header = HEADER.pack(len(meta), len(views)) + b"".join(LENGTH.pack(v.nbytes) for v in views)
    return [header, meta, *views]


def decode(meta: bytes, buffers: list[Any]) -> tuple:
    message = pickle.loads(meta, buffers=buffers)  # noqa: S301 - our own worker, over a socketpair
    if not isinstance(message, tuple) or not message or not isinstance(message[0], str):
        raise ValueError(f"malformed frame: {type(message).__name__}")
    return message


class BlockingChannel:
    """The worker's end: whole frames sent under a lock (any thread may send), received by one
    reader thread into writable buffers (so a model may change its input arrays in place)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: tuple) -> None:
        parts = encode(message)
        with self._send_lock:
            for part in parts:
                self._sock.sendall(part)

    def _read_exactly(self, size: int) -> bytearray:
        out = bytearray(size)
        view = memoryview(out)
        got = 0
        while got < size:
            n = self._sock.recv_into(view[got:], size - got)
            if n == 0:
                raise EOFError("the server closed the channel")
            got += n
        return out

    def receive(self) -> tuple:
        """The next message; EOFError when the server is gone."""
        meta_len, count = HEADER.unpack(self._read_exactly(HEADER.size))
        lengths = [LENGTH.unpack(self._read_exactly(LENGTH.size))[0] for _ in range(count)]
        if meta_len + sum(lengths) > MAX_FRAME_BYTES:
            raise EOFError(f"frame of {meta_len + sum(lengths)} bytes: the channel is broken")
        meta = bytes(self._read_exactly(meta_len))
        return decode(meta, [self._read_exactly(n) for n in lengths])

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

import os
import pickle
import socket
import struct
import threading

# meta length, buffer count, the buffers' total length; then the body: one length per buffer,
# the pickle, the buffers. A reader takes a frame in two reads (header, body), whatever its
# number of buffers: on the hot path of every batch, each read is a system call.
HEADER = struct.Struct("<QIQ")
LENGTH = struct.Struct("<Q")
# A frame larger than this is a broken peer, not a message (tensors this large do not reach a
# KServe server: its gRPC and HTTP limits are far below).
MAX_FRAME_BYTES = 1 << 34
# The most parts one sendmsg takes (the kernel refuses more with EMSGSIZE): a frame has a part
# per array, e.g. a batch of many requests' responses.
try:
    IOV_MAX = max(16, os.sysconf("SC_IOV_MAX"))
except (ValueError, OSError):
    IOV_MAX = 1024


def encode(message: tuple) -> list[bytes | memoryview]:
    """The parts of one frame, in order (write them all, then the frame is complete)."""
    buffers: list[pickle.PickleBuffer] = []
    meta = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    header = HEADER.pack(len(meta), len(views), sum(v.nbytes for v in views))
    return [header + b"".join(LENGTH.pack(v.nbytes) for v in views) + meta, *views]


def body_size(header: bytes) -> int:
    """The length of the body that follows `header` (ValueError for a broken peer's)."""
    meta_len, count, buffers_len = HEADER.unpack(header)
    size = count * LENGTH.size + meta_len + buffers_len
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes: the channel is broken")
    return size


def decode(header: bytes, body: bytes | bytearray) -> tuple:
    """The message of a frame; its buffers are views of `body` (writable if it is)."""
    meta_len, count, _ = HEADER.unpack(header)
    view = memoryview(body)
    offset = count * LENGTH.size
    lengths = [LENGTH.unpack_from(view, i * LENGTH.size)[0] for i in range(count)]
    meta = view[offset : offset + meta_len]
    offset += meta_len
    buffers = []
    for n in lengths:
        buffers.append(view[offset : offset + n])
        offset += n
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
        parts = [memoryview(p).cast("B") for p in encode(message)]
        with self._send_lock:
            while parts:  # one system call for the frame, unless the socket takes part of it
                sent = self._sock.sendmsg(parts[:IOV_MAX])
                while parts and sent >= parts[0].nbytes:
                    sent -= parts[0].nbytes
                    parts.pop(0)
                if parts and sent:
                    parts[0] = parts[0][sent:]

    def _read_exactly(self, size: int) -> bytearray:
        out = bytearray(size)
        view = memoryview(out)
        got = 0
        while got < size:
            n = self._sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
            if n == 0:
                raise EOFError("the server closed the channel")
            got += n
        return out

    def receive(self) -> tuple:
        """The next message; EOFError when the server is gone."""
        header = bytes(self._read_exactly(HEADER.size))
        try:
            size = body_size(header)
        except ValueError as e:
            raise EOFError(str(e)) from e
        return decode(header, self._read_exactly(size))

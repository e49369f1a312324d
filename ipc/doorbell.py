"""The doorbell between the engine core and its GPU worker: a Unix stream socket.

The ticket ring carries the data; the bell only wakes a peer that stopped spinning and blocked.
Ringing is a one-byte non-blocking send (a full buffer already means "wake up", so it is dropped).
The same connection carries the few control messages (msgspec msgpack frames, never pickle), and its
end-of-file tells either side at once that the other process is gone.

Why a socket and not ZMQ: a PAIR over ipc:// hands every send to a ZMQ I/O thread, which on a 2-core
machine competes with both processes and costs tens of µs per hop; a socket write wakes the blocked
reader from the writer's own thread (scripts/bench_ipc.py measures the round trip).

Wire: a ding is b"\\x00"; a message is b"\\x01", a little-endian u32 length, then msgpack.
The socket lives next to the ring's segment as "<ring name>.bell" (mode 0600), so the sweep that
removes a dead owner's segment removes its doorbell too.
"""

from __future__ import annotations

import os
import select
import socket
import time
import weakref
from collections import deque

import msgspec

from .plan import ModelInfo
from .tickets import SHM_DIR

_DING = b"\x00"
_MSG = 1
_RECV_BYTES = 65536


class WorkerReady(msgspec.Struct, tag="worker_ready"):
    """The worker built its runner and serves the ring; info describes its model (rank: its place in a
    tensor-parallel group, whose every ring rank connects a doorbell of its own)."""

    pid: int
    info: ModelInfo
    rank: int = 0


class WorkerFailed(msgspec.Struct, tag="worker_failed"):
    """The worker could not start (its runner failed to build)."""

    pid: int
    message: str


class Attached(msgspec.Struct, tag="attached"):
    """The engine accepted the worker: its first plan will be ticket first_seq."""

    first_seq: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    """The engine is closing the device: the worker exits."""


BellMessage = WorkerReady | WorkerFailed | Attached | Shutdown
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(BellMessage)


def bell_path(ring_name: str) -> str:
    """Where the doorbell socket of a ring lives."""
    folder = SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp"
    return os.path.join(folder, f"{ring_name}.bell")


class Bell:
    """One side of a connected doorbell: ring the peer, wait to be rung, exchange control messages."""

    def __init__(self, sock: socket.socket) -> None:
        """Wrap a connected socket (see BellListener.accept and Bell.connect)."""
        sock.setblocking(False)
        self._sock = sock
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)
        self._pending = bytearray()
        self._chunk = bytearray(_RECV_BYTES)
        self.inbox: deque[BellMessage] = deque()
        self.peer_gone = False  # the peer closed the connection (exited, or was killed)

    @classmethod
    def connect(cls, path: str, timeout_s: float, keep_trying=lambda: True) -> Bell:
        """Connect to a listening doorbell, retrying until it appears; TimeoutError past timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                return cls(sock)
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
            if time.monotonic() > deadline or not keep_trying():
                raise TimeoutError(f"no doorbell listening at {path}")
            time.sleep(0.01)  # back-off while the owner is still creating the ring

    def ring(self) -> None:
        """Wake the peer if it is blocked in wait(); never blocks."""
        try:
            self._sock.send(_DING)
        except BlockingIOError:
            pass  # the peer has unread dings: it will wake anyway
        except OSError:
            self.peer_gone = True

    def send(self, message: BellMessage, timeout_s: float = 5.0) -> None:
        """Send a control message (rare: startup and shutdown); OSError if the peer is gone."""
        body = _encoder.encode(message)
        frame = bytes([_MSG]) + len(body).to_bytes(4, "little") + body
        self._sock.settimeout(timeout_s)
        try:
            self._sock.sendall(frame)
        finally:
            self._sock.setblocking(False)

    def wait(self, timeout_s: float) -> None:
        """Block until rung, a message arrives, the peer goes, or timeout_s passes; then take it all in."""
        if not self.peer_gone:
            self._poll.poll(max(0, int(timeout_s * 1000)))
            self._drain()

    def receive(self, timeout_s: float) -> BellMessage | None:
        """The next control message, waiting up to timeout_s; None on timeout or if the peer is gone."""
        deadline = time.monotonic() + timeout_s
        while not self.inbox and not self.peer_gone:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.wait(min(left, 0.05))
        return self.inbox.popleft() if self.inbox else None

    def close(self) -> None:
        """Close this side; the peer sees end-of-file."""
        self._sock.close()
        self.peer_gone = True

    def _drain(self) -> None:
        """Read everything that arrived: drop dings, decode messages into the inbox, note EOF."""
        while True:
            try:
                n = self._sock.recv_into(self._chunk)
            except BlockingIOError:
                break
            except OSError:
                n = 0
            if n == 0:
                self.peer_gone = True
                break
            if self._pending or self._chunk.find(_MSG, 0, n) >= 0:
                self._pending += memoryview(self._chunk)[:n]
                self._parse()
            # else: dings only, nothing to keep

    def _parse(self) -> None:
        """Decode the complete messages at the front of the pending bytes."""
        p = self._pending
        while p:
            start = p.find(_MSG)
            if start < 0:
                p.clear()
                return
            del p[:start]  # dings
            if len(p) < 5:
                return
            size = int.from_bytes(p[1:5], "little")
            if len(p) < 5 + size:
                return
            self.inbox.append(_decoder.decode(bytes(p[5 : 5 + size])))
            del p[: 5 + size]


class BellListener:
    """The engine's listening doorbell: a worker (and later its restarts) connects here."""

    def __init__(self, path: str) -> None:
        """Listen at path (mode 0600); the file is removed on close, at exit and on GC."""
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(path)
            os.chmod(path, 0o600)
            self._sock.listen(16)  # a tensor-parallel group's ranks connect at once
        except BaseException:
            self._sock.close()
            raise
        self._finalizer = weakref.finalize(self, _close_listener, self._sock, path)

    def accept(self, timeout_s: float) -> Bell | None:
        """The next worker's connection, or None after timeout_s."""
        self._sock.settimeout(max(timeout_s, 0.0))
        try:
            sock, _ = self._sock.accept()
        except (TimeoutError, socket.timeout, BlockingIOError):
            return None
        return Bell(sock)

    def close(self) -> None:
        """Stop listening and remove the socket file. Idempotent."""
        self._finalizer()


def _close_listener(sock: socket.socket, path: str) -> None:
    """Close a listening socket and unlink its file."""
    sock.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

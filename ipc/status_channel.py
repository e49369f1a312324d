"""How the children of `metrale serve` tell their supervisor what happened: serving, failed, a worker hung.

The supervisor binds a PULL socket in its private run folder (so whoever writes to it is one of its own
children, never another server that happens to own a port) and waits on it: start-up is an event, not a
poll of the client port. Each child connects a PUSH socket and sends `ChildStatus` frames (msgpack).
"""

from __future__ import annotations

import os

import msgspec
import zmq

# ChildStatus.state values.
SERVING = "serving"  # the frontend is bound and an engine core is up: requests can be served
FAILED = "failed"  # the child cannot run (a port in use, a model the worker cannot build); detail says why
WORKER_HUNG = "worker_hung"  # the engine core killed a worker that made no progress; detail says why

# Exit code of a child that cannot run as configured: restarting it would fail the same way.
EXIT_CONFIG = 2


class ChildStatus(msgspec.Struct, kw_only=True):
    """One event from a child process."""

    name: str  # frontend | engine_core
    pid: int
    state: str
    detail: str = ""
    client_endpoint: str = ""  # the frontend's bound addresses, with SERVING
    http_endpoint: str = ""


class StatusSender:
    """A child's end: send events to the supervisor without ever blocking the child for long."""

    def __init__(self, address: str, name: str) -> None:
        self.name = name
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 1000)  # an event sent just before exiting still arrives
        self._sock.setsockopt(zmq.SNDHWM, 64)
        self._sock.connect(address)
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, state: str, detail: str = "", **fields: str) -> None:
        """Send one event (dropped, not waited for, if the supervisor is not reading)."""
        msg = ChildStatus(name=self.name, pid=os.getpid(), state=state, detail=detail, **fields)
        try:
            self._sock.send(self._encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        self._sock.close()


class StatusInbox:
    """The supervisor's end: bind, then receive events with a timeout."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._decoder = msgspec.msgpack.Decoder(ChildStatus)

    def receive(self, timeout_s: float) -> ChildStatus | None:
        """The next event, waiting up to timeout_s; None when none came (or a frame did not decode)."""
        if not self._sock.poll(int(timeout_s * 1000)):
            return None
        try:
            return self._decoder.decode(self._sock.recv(zmq.NOBLOCK))
        except (zmq.Again, msgspec.DecodeError):
            return None

    def close(self) -> None:
        self._sock.close()

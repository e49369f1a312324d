"""FrontendLinks: an engine core's sockets to the frontends it serves (one, or --api-server-count of them).

Each frontend binds an input and an output address for each engine core (frontend/engine_link.py). The engine core
connects one PULL to every frontend's input address (libzmq takes from them in turn) and one PUSH to each frontend's
output address, and sends what answers an id to the frontend the id names (ipc/frontend_ids.py): a request's
outputs, a StatsResponse, a LoraUpdated. What concerns every frontend (EngineReady, WorkerLost, WorkerBack) goes to
all. A frontend that has been sent nothing for heartbeat_s gets an empty EngineOutputs: its heartbeat (a frontend
with requests live counts a silent engine core as stalled).

The PUSH sockets are unbounded (SNDHWM 0): while a dead frontend is restarted, the tick loop must not block on its
socket; what queued for it meanwhile reaches its successor, which ignores ids that are not its own.

With several frontends a monitor on each PUSH tells when a frontend's connection drops (it died) and when one
connects again (its successor bound the address): until then another frontend may re-attach the dead one's
resumable requests (an HTTP retry that the shared port gave to a live frontend; output_ledger.py). The events are
read only when a re-attach asks (`is_down`), not on every tick.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import zmq

from metrale.ipc.frontend_ids import frontend_of_prefix, prefix_of
from metrale.ipc.messages import EngineLoad, EngineOutput, EngineOutputs, RequestOutputDelta

_MAX_ROUTES = 4096  # prefixes remembered (a few per frontend start); past this the cache starts over


class FrontendLinks:
    """The inbox from every frontend, an outbox to each, and which frontend an id belongs to."""

    def __init__(self, ctx: zmq.Context, addresses: list[tuple[str, str]], heartbeat_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """addresses: (input, output) of each frontend, frontend 0 first."""
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self.inbox = ctx.socket(zmq.PULL)
        for inp, _ in addresses:
            self.inbox.connect(inp)
        self._outs: list[zmq.Socket] = []
        for _, out in addresses:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(out)
            self._outs.append(sock)
        self._sent_at = [clock()] * len(self._outs)  # the last frame to each frontend (outputs or a heartbeat)
        events = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        self._monitors = [sock.get_monitor_socket(events) for sock in self._outs] if len(self._outs) > 1 else []
        self._down: set[int] = set()  # frontends whose connection dropped and has not come back
        self._routes: dict[str, int] = {}  # prefix -> frontend
        self._encoder = msgspec.msgpack.Encoder()

    def __len__(self) -> int:
        return len(self._outs)

    def frontend_of(self, request_id: str) -> int:
        """The frontend an id's answer goes to (0 for an id that names none it knows)."""
        if len(self._outs) == 1:
            return 0
        prefix = prefix_of(request_id)
        k = self._routes.get(prefix)
        return k if k is not None else self._route(prefix)

    def _route(self, prefix: str) -> int:
        """A prefix not seen before: its frontend, remembered."""
        k = frontend_of_prefix(prefix)
        if not 0 <= k < len(self._outs):
            k = 0
        if len(self._routes) >= _MAX_ROUTES:
            self._routes.clear()
        self._routes[prefix] = k
        return k

    def is_down(self, request_id: str) -> bool:
        """Whether the frontend an id belongs to lost its connection (it died) and no successor has connected yet."""
        for k, monitor in enumerate(self._monitors):
            while True:
                try:
                    frames = monitor.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                event = int.from_bytes(frames[0][:2], "little")
                if event == zmq.EVENT_DISCONNECTED:
                    self._down.add(k)
                elif event == zmq.EVENT_CONNECTED:
                    self._down.discard(k)
        return bool(self._monitors) and self.frontend_of(request_id) in self._down

    def broadcast(self, msg: EngineOutput) -> None:
        """Send one message to every frontend."""
        frame = self._encoder.encode(msg)
        for k in range(len(self._outs)):
            self._send_frame(k, frame)

    def answer(self, request_id: str, msg: EngineOutput) -> None:
        """Send what answers request_id to the frontend that asked."""
        self._send_frame(self.frontend_of(request_id), self._encoder.encode(msg))

    def send_outputs(self, outputs: list[RequestOutputDelta], load: EngineLoad | None) -> None:
        """One tick's outputs, each to its frontend; a frontend with none gets its heartbeat when it is due."""
        now = self.clock()
        if len(self._outs) == 1:
            if outputs or now - self._sent_at[0] >= self.heartbeat_s:
                self._send_frame(0, self._encoder.encode(EngineOutputs(outputs=outputs, load=load)))
            return
        parts: list[list[RequestOutputDelta]] = [[] for _ in self._outs]
        routes = self._routes
        for out in outputs:  # frontend_of, inlined: this loop runs over every row of every tick
            prefix = out.request_id.partition("-")[0]
            k = routes.get(prefix)
            parts[k if k is not None else self._route(prefix)].append(out)
        for k, part in enumerate(parts):
            if part or now - self._sent_at[k] >= self.heartbeat_s:
                self._send_frame(k, self._encoder.encode(EngineOutputs(outputs=part, load=load)))

    def _send_frame(self, k: int, frame: bytes) -> None:
        self._outs[k].send(frame)
        self._sent_at[k] = self.clock()

    def close(self) -> None:
        """Close the inbox at once; each outbox lingers a moment so a last answer goes out."""
        self.inbox.close(0)
        for sock, monitor in zip(self._outs, self._monitors):
            sock.disable_monitor()
            monitor.close(0)
        for sock in self._outs:
            sock.close()

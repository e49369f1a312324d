"""EngineLink: the frontend's end of the engine core's two sockets, and the contract the engine core keeps.

Socket contract with the engine core
------------------------------------
The FRONTEND binds both ipc:// endpoints; the engine core connects to them (so an engine-core restart simply
reconnects, and ZMQ queues nothing for a peer that is not there):

* ``engine_input_address``: frontend PUSH (bind) → engine core PULL (connect). One frame = msgpack of one
  ``EngineInput`` (AddRequest | AbortRequest | StatsRequest | GrammarVocab | LoraUpdate), tagged by "type".
* ``engine_output_address``: engine core PUSH (connect) → frontend PULL (bind). One frame = msgpack of one
  ``EngineOutput`` (EngineOutputs | StatsResponse | EngineReady | WorkerLost | WorkerBack | LoraUpdated).

What the engine core must do:

1. Send ``EngineReady`` once per start, when it can take work. The frontend holds requests until the first
   one. On EVERY EngineReady the frontend assumes a fresh engine: for each live request it sends
   ``AbortRequest`` for the id it used before (if any) and an ``AddRequest`` under a NEW request_id whose
   ``output_token_ids`` are the tokens already streamed; the engine treats those as already generated
   (they count toward max_tokens and min_tokens, feed the penalties, and seeded sampling continues at their
   positions).
2. Treat ``request_id`` as an opaque string, unique per submission. Ignore an AbortRequest for an id it does
   not know. After an AbortRequest it need not send anything more for that id (a final delta is ignored).
3. Per tick, send one ``EngineOutputs`` with a ``RequestOutputDelta`` per request that produced something:
   new ids in order; ``finish_reason`` ("stop" | "length" | "abort" | "error") exactly once, on the last one.
   With "error", ``error`` is the message and ``error_code`` an ErrorCode value (ipc/errors.py: e.g.
   ``"worker_fault"``; none means "internal"). Stop strings are the frontend's
   job; EOS, stop_token_ids, max_tokens and max_model_len are the engine core's.
4. Answer ``StatsRequest{id}`` with ``StatsResponse{id, stats}`` (same id), and ``LoraUpdate{id, name, path}`` (load an
   adapter, or unload it with path "") with ``LoraUpdated{id, error}`` once it is done or refused.

5. When its worker dies, send ``WorkerLost`` (its requests are requeued and wait); when the new worker serves,
   ``WorkerBack``. Under data parallel (``EngineOutputs.load``) report its load with its outputs.

The frontend answers outputs for request ids of its own that it does not know (a request it already finished) with
an AbortRequest, once. On each EngineReady (or adoption) it sends ``FrontendUp{prefix}``: the engine core then
aborts the plain requests of earlier frontends and holds their resumable ones for a re-attach
(engine_core/output_ledger.py: ``AddRequest.resume_key`` / ``reattach``). While it has seen no EngineReady it sends
``StatsRequest{id: "<prefix>-ready"}`` every ``ready_probe_s``; a StatsResponse to it means an engine core is
already running (the frontend was restarted) and the frontend adopts it.

With several frontends (--api-server-count) each binds its own two addresses for every engine core, and each engine
core connects to all of them and sends each answer to the frontend whose prefix its id opens with
(ipc/frontend_ids.py: the prefix names the frontend's index; engine_core/frontend_links.py); EngineReady, WorkerLost
and WorkerBack go to every frontend; a FrontendUp touches only the requests of the frontends before it at its index.

Under data parallel the frontend holds one EngineLink per replica (frontend/replicas.py). A monitor on the output
socket tells at once when a replica's engine core disconnects (it died): its requests move to another replica.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from metrale.ipc.frontend_ids import new_prefix
from metrale.ipc.messages import (
    AbortRequest, EngineStats, LoraUpdate, LoraUpdated, RequestOutputDelta, StatsRequest, StatsResponse,
)

_RECENT_ABORTS = 4096  # engine ids remembered as aborted, so a late output is not answered twice
_OUTBOX_RETRY_S = 0.005  # while the engine core's input socket has no peer


@dataclass(slots=True)
class PendingStats:
    """A StatsRequest waiting for the engine core: what to do with its answer, and with none in time."""

    timer: asyncio.TimerHandle
    answer: Callable[[EngineStats], None]
    fail: Callable[[str], None]  # called with why


class EngineLink:
    """Sends to the engine core without waiting, remembers what it aborted and which stats it asked for."""

    def __init__(self, index: int = 0, frontend: int = 0) -> None:
        self.index = index  # the replica it reaches
        # Engine ids of this frontend never collide with a previous one's, and name its index (--api-server-count).
        self.prefix = new_prefix(frontend)
        self._ids = itertools.count()
        self.up = False  # an engine core said EngineReady (or answered the readiness probe)
        self._probe_id = f"{self.prefix}-ready"
        self._outbox: deque[bytes] = deque()  # frames the engine core's socket could not take yet
        self._outbox_timer: asyncio.TimerHandle | None = None
        self._recent_aborts: OrderedDict[str, None] = OrderedDict()
        self._pending_stats: dict[str, PendingStats] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._to_engine: zmq.asyncio.Socket | None = None
        self._from_engine: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None

    # ---- lifecycle -------------------------------------------------------------------

    def open(self, ctx: zmq.asyncio.Context, input_address: str, output_address: str) -> None:
        """Bind the two ipc:// sockets the engine core connects to (on the running loop)."""
        self._loop = asyncio.get_running_loop()
        self._to_engine = ctx.socket(zmq.PUSH)
        self._from_engine = ctx.socket(zmq.PULL)
        for sock in (self._to_engine, self._from_engine):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # the engine core is trusted: never drop what it must see
            sock.setsockopt(zmq.RCVHWM, 0)
        if input_address.startswith("tcp://"):  # a replica on another host: notice a host that vanished too
            for sock in (self._to_engine, self._from_engine):
                sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
        self._to_engine.bind(input_address)
        self._from_engine.bind(output_address)
        self._monitor = self._from_engine.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def cancel_retry(self) -> None:
        """Stop retrying the outbox (the server is stopping)."""
        if self._outbox_timer is not None:
            self._outbox_timer.cancel()

    def close(self) -> None:
        """Close both sockets (and the monitor) without lingering."""
        if self._from_engine is not None and self._monitor is not None:
            try:
                self._from_engine.disable_monitor()
            except zmq.ZMQError:
                pass
        for sock in (self._monitor, self._to_engine, self._from_engine):
            if sock is not None:
                sock.close(linger=0)

    async def recv(self) -> bytes:
        """The next frame from the engine core."""
        return await self._from_engine.recv()

    async def disconnected(self) -> None:
        """Return when an engine core's connection to the output socket drops (the process died or left)."""
        while True:
            frames = await self._monitor.recv_multipart()
            if int.from_bytes(frames[0][:2], "little") == zmq.EVENT_DISCONNECTED:
                return

    def drop_outbox(self) -> None:
        """Forget frames still waiting for a dead engine core (its replacement never knew their requests)."""
        self._outbox.clear()

    # ---- frontend → engine core --------------------------------------------------------

    def new_request_id(self) -> str:
        """A fresh engine request id, unique to this frontend."""
        return f"{self.prefix}-{next(self._ids)}"

    def send(self, msg: msgspec.Struct) -> None:
        """Send one message to the engine core without waiting; in order, later if its socket is not there yet.

        An engine core that sent EngineReady may not have finished connecting its input socket; a dead one's
        replacement connects later. Frames wait in an outbox (retried every few ms) rather than being dropped.
        """
        self._outbox.append(self._encoder.encode(msg))
        if self._outbox_timer is None:  # else a retry is already scheduled
            self._flush_outbox()

    def _flush_outbox(self) -> None:
        """Send queued engine frames until the socket refuses one; retry shortly when it does."""
        self._outbox_timer = None
        while self._outbox:
            future = self._to_engine.send(self._outbox[0], flags=zmq.DONTWAIT)
            exc = future.exception() if future.done() else None
            if isinstance(exc, zmq.Again):
                self._outbox_timer = self._loop.call_later(_OUTBOX_RETRY_S, self._flush_outbox)
                return
            if exc is not None:
                raise exc
            self._outbox.popleft()

    def abort(self, engine_ids: list[str]) -> None:
        """Tell the engine core to drop these requests; remember them so late outputs are not re-aborted."""
        if not engine_ids:
            return
        for engine_id in engine_ids:
            self._recent_aborts[engine_id] = None
        while len(self._recent_aborts) > _RECENT_ABORTS:
            self._recent_aborts.popitem(last=False)
        self.send(AbortRequest(request_ids=engine_ids))

    def on_orphan(self, out: RequestOutputDelta, aborts: list[str]) -> None:
        """Output for an engine id with no live request: abort it once (the engine core may not know it ended). One of
        an earlier frontend's ids is the engine core's to hold for a re-attach, or to drop (FrontendUp)."""
        if not out.request_id.startswith(self.prefix + "-"):
            return
        if out.finish_reason is not None:
            self._recent_aborts.pop(out.request_id, None)
        elif out.request_id not in self._recent_aborts:
            aborts.append(out.request_id)

    async def probe(self, every_s: float) -> None:
        """Until an engine core is up, ask for stats now and then: one that answers was running before us."""
        probe = self._encoder.encode(StatsRequest(id=self._probe_id))
        while True:
            if not self.up:
                future = self._to_engine.send(probe, flags=zmq.DONTWAIT)
                if future.done() and future.exception() is not None and not isinstance(future.exception(), zmq.Again):
                    raise future.exception()
            await asyncio.sleep(every_s)

    # ---- stats -------------------------------------------------------------------------

    def ask_stats(self, answer: Callable[[EngineStats], None], fail: Callable[[str], None], timeout_s: float) -> str:
        """Ask the engine core for its counters: answer(stats) when they come, fail(why) after timeout_s.

        Returns the internal id the request goes by (for forget_stats)."""
        internal = f"{self.prefix}-s{next(self._ids)}"
        timer = self._loop.call_later(timeout_s, self._stats_timed_out, internal)
        self._pending_stats[internal] = PendingStats(timer, answer, fail)
        self.send(StatsRequest(id=internal))
        return internal

    def forget_stats(self, internal: str) -> None:
        """Drop a stats request whose caller no longer waits (answered, timed out or cancelled)."""
        pending = self._pending_stats.pop(internal, None)
        if pending is not None:
            pending.timer.cancel()

    def answer_stats(self, msg: StatsResponse) -> bool:
        """Hand a StatsResponse to the request it answers; True when it answers the readiness probe instead."""
        if msg.id == self._probe_id:
            return True
        pending = self._pending_stats.pop(msg.id, None)
        if pending is not None:
            pending.timer.cancel()
            pending.answer(msg.stats)
        return False

    def ask_lora(self, name: str, path: str, answer: Callable[[str | None], None], fail: Callable[[str], None],
                 timeout_s: float) -> str:
        """Ask the engine core to load (path) or unload ("") an adapter: answer(error or None) when it says, fail(why)
        after timeout_s. Returns the internal id (for forget_stats)."""
        internal = f"{self.prefix}-l{next(self._ids)}"
        timer = self._loop.call_later(timeout_s, self._stats_timed_out, internal)
        self._pending_stats[internal] = PendingStats(timer, answer, fail)
        self.send(LoraUpdate(id=internal, name=name, path=path))
        return internal

    def answer_lora(self, msg: LoraUpdated) -> None:
        """Hand a LoraUpdated to the request it answers."""
        pending = self._pending_stats.pop(msg.id, None)
        if pending is not None:
            pending.timer.cancel()
            pending.answer(msg.error)

    def _stats_timed_out(self, internal: str) -> None:
        """The engine core did not answer a StatsRequest in time."""
        pending = self._pending_stats.pop(internal, None)
        if pending is not None:
            pending.fail("the engine core did not answer")

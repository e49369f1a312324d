"""AsyncClient: the asyncio reference client, on the caller's event loop.

The socket is a plain ZeroMQ DEALER watched through its file descriptor (loop.add_reader), not zmq.asyncio:
zmq.asyncio makes a future and schedules an event check for every frame, which at one frame per request per
decode step was most of a streaming client's CPU. ZeroMQ's descriptor is edge-triggered, so on every wake-up
the client takes frames until the socket reports none left, and it looks again after each of its own sends
(a send can consume the edge). Answers are routed to their request's queue by id. Every AsyncClient of a
process shares one zmq context (one ZeroMQ I/O thread, however many clients): a client owns only its socket,
which close() closes; the context lives as long as the process. A monitor of the socket tells when the connection
broke and came back (the frontend was restarted): every live request is then re-attached where its stream was (a
Resume per request, client_protocol.ResumeBook).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator

import zmq

from metrale.ipc.messages import (
    Admin, AdminReply, Delta, EngineStats, Error, Health, HealthQuery, ModelInfoQuery, ModelInfoReply, Stats, StatsQuery,
)
from metrale.ipc.sampling import SamplingParams

from .client_protocol import (
    DEFAULT_PORT,
    DEFAULT_TIMEOUT_S,
    ClientClosed,
    Completion,
    RequestError,
    ResumeBook,
    abort_frame,
    check_new_id,
    decode_answer,
    keyed,
    encode,
    generate_message,
    is_noise,
    log,
    new_id,
    query_answer,
    server_address,
    timeout_error,
    unreachable,
    ServerUnreachable,
    UNREACHABLE_CHECK_S,
)

_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+
_shared: tuple[int, zmq.Context] | None = None  # (the pid that made it, the context)
_shared_lock = threading.Lock()


def shared_context() -> zmq.Context:
    """This process's zmq context for AsyncClients; a new one after a fork or if someone terminated it."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared[0] != os.getpid() or _shared[1].closed:
            _shared = (os.getpid(), zmq.Context())
        return _shared[1]


class AsyncClient:
    """asyncio client on a DEALER socket's descriptor; answers are routed to requests by id."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        timeout: float = DEFAULT_TIMEOUT_S,
        *,
        address: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self.address = server_address(host, port, address)
        self.timeout = timeout
        self.api_key = api_key  # sent in every message (docs/protocol.md §3); the server's --api-key
        self._sock = shared_context().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(self.address)
        self._fd = self._sock.getsockopt(zmq.FD)
        self._monitor_fd = self._monitor.getsockopt(zmq.FD)
        self._book = ResumeBook()
        self._connection_lost = False  # the connection broke: re-attach once it is back
        self._resuming: asyncio.Task | None = None  # sending the Resumes
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop watching the descriptor
        self._waiters: dict[str, asyncio.Queue] = {}
        self._writers: list[asyncio.Future] = []  # sends waiting for room in the socket's queue
        self._closed = False
        self._heard = False  # a frame came from the server (so something listens there)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop watching the socket, close it, and fail every request still waiting (the shared context stays)."""
        if self._closed:
            return
        self._closed = True
        self._fail_all(ClientClosed("the client was closed"))
        self._waiters.clear()
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    async def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Run a request, yielding its Deltas; leaving the loop early aborts it."""
        request_id = request_id or new_id()
        msg = generate_message(request_id, prompt, token_ids, params, self.api_key, lora, self._book.session)
        q = self._register(request_id)
        self._book.started(msg)
        finished = False
        try:
            await self._send(encode(msg))
            while True:
                msg = await self._wait(q, request_id)
                if is_noise(msg):
                    continue
                if isinstance(msg, Error):
                    finished = True
                    raise RequestError(msg.code, msg.message, request_id)
                finished = msg.finish_reason is not None
                yield msg
                if finished:
                    return
        finally:
            self._waiters.pop(request_id, None)
            self._book.ended(request_id)
            if not finished and not self._closed:  # left early: the server should stop working on it
                try:
                    self._sock.send(abort_frame(request_id, self.api_key), flags=zmq.DONTWAIT)
                except zmq.ZMQError as e:
                    log.warning("metrale client: could not send the abort of %r: %s", request_id, e)
                self._look_again()

    async def complete(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora: str | None = None,
    ) -> Completion:
        """Run a request to its end and return the whole output."""
        done = Completion(id=request_id or new_id())
        async for delta in self.generate(prompt, token_ids=token_ids, params=params, request_id=done.id, lora=lora):
            done.add(delta)
        return done

    async def abort(self, request_id: str) -> None:
        """Ask the server to stop a request; its stream then ends with finish_reason "abort"."""
        await self._send(abort_frame(request_id, self.api_key))

    async def stats(self) -> EngineStats:
        """The engine core's counters."""
        return (await self.server_stats()).stats

    async def server_stats(self) -> Stats:
        """The engine core's counters and what the frontend measured (`frontend`: recent latencies)."""
        return await self._ask(StatsQuery(id=new_id()))

    async def health(self) -> Health:
        """Each server process's pid, uptime, restarts and the last fault."""
        return await self._ask(HealthQuery(id=new_id()))

    async def model_info(self) -> ModelInfoReply:
        """The served model: name, vocabulary size, max_model_len, eos ids and chat template."""
        return await self._ask(ModelInfoQuery(id=new_id()))

    async def kill_worker(self, signal: str = "KILL", *, rank: int = 0, replica: int = 0) -> AdminReply:
        """Admin (a server with --enable-admin): send a GPU worker SIGKILL, SIGTERM or SIGSTOP (KILL, TERM, STOP)."""
        return await self._ask(Admin(id=new_id(), action="kill", signal=signal, rank=rank, replica=replica))

    async def restart_worker(self, *, rank: int = 0, replica: int = 0) -> AdminReply:
        """Admin (a server with --enable-admin): stop a GPU worker (TERM, then KILL); a new one takes over."""
        return await self._ask(Admin(id=new_id(), action="restart", rank=rank, replica=replica))

    async def _ask(self, msg: StatsQuery | HealthQuery | ModelInfoQuery | Admin):
        """Send a one-answer query and wait for its answer."""
        q = self._register(msg.id)
        try:
            await self._send(keyed(msg, self.api_key))
            reply = await self._wait(q, msg.id)
        finally:
            self._waiters.pop(msg.id, None)
        return query_answer(reply, msg.id)

    def _register(self, request_id: str) -> asyncio.Queue:
        """Route answers for request_id to a new queue; watch the socket from this loop."""
        check_new_id(self._closed, self._waiters, request_id)
        self._watch()
        q = self._waiters[request_id] = asyncio.Queue()
        return q

    def _watch(self) -> None:
        """Watch the socket's descriptor from the running loop (the first use, or a client reused under a
        new loop)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
                self._loop.remove_reader(self._monitor_fd)
            self._loop = loop
            loop.add_reader(self._fd, self._on_events)
            loop.add_reader(self._monitor_fd, self._on_connection_events)
            loop.call_soon(self._on_connection_events)  # edge-triggered: what came before would not wake it

    async def _send(self, frame: bytes) -> None:
        """Send one frame, waiting while the socket's queue is full (the high-water mark)."""
        if self._closed:
            raise ClientClosed("the client is closed")
        self._watch()
        while True:
            try:
                self._sock.send(frame, flags=zmq.DONTWAIT)
                break
            except zmq.Again:
                room = self._loop.create_future()
                self._writers.append(room)
                self._look_again()
                await room
        self._look_again()

    def _look_again(self) -> None:
        """Check the socket's events on the next loop pass: a send or receive of ours may have taken
        the descriptor's edge, and it would not fire again for what is already waiting."""
        if self._loop is not None and not self._closed:
            self._loop.call_soon(self._on_events)

    def _on_events(self) -> None:
        """Take every frame that has arrived and wake waiting sends, until the socket reports nothing."""
        try:
            self._take_events()
        except zmq.ZMQError as e:  # the socket broke (its context was terminated): fail every waiter
            self._fail_all(ClientClosed(f"the client's socket failed: {e}"))

    def _take_events(self) -> None:
        """_on_events' loop; a ZMQError other than EAGAIN propagates."""
        sock = self._sock
        while not self._closed:
            events = sock.getsockopt(zmq.EVENTS)
            if events & zmq.POLLOUT and self._writers:
                for room in self._writers:
                    if not room.done():
                        room.set_result(None)
                self._writers.clear()
            if not events & zmq.POLLIN:
                return
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._route(frame)

    def _on_connection_events(self) -> None:
        """The monitor's events: after a break, once the connection is back, take every answer that came on the old
        connection (so each request's count is what it received), then re-attach every live request."""
        while not self._closed:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            event = int.from_bytes(frames[0][:2], "little")
            if event == zmq.EVENT_DISCONNECTED:
                self._connection_lost = True
            elif self._connection_lost:
                self._connection_lost = False
                self._on_events()
                frames = self._book.resume_frames()
                if frames:
                    log.info("metrale client: the connection to %s came back; re-attaching %d request(s)",
                             self.address, len(frames))
                if frames:  # in order, waiting for room when there are many (the high-water mark)
                    self._resuming = self._loop.create_task(self._send_each(frames))

    async def _send_each(self, frames: list[bytes]) -> None:
        try:
            for frame in frames:
                await self._send(frame)
        except ClientClosed:
            pass

    def _fail_all(self, error: ClientClosed) -> None:
        """Stop watching the socket and hand error to every request and send still waiting."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
            self._loop.remove_reader(self._monitor_fd)
        for q in self._waiters.values():
            q.put_nowait(error)
        for w in self._writers:
            if not w.done():
                w.set_exception(error)
        self._writers.clear()

    async def _wait(self, q: asyncio.Queue, request_id: str):
        """The next message for a request; TimeoutError when the server stays silent for `timeout`."""
        try:
            if not q.empty():
                item = q.get_nowait()
            elif not self._heard and self.timeout > UNREACHABLE_CHECK_S:
                try:
                    item = await asyncio.wait_for(q.get(), UNREACHABLE_CHECK_S)
                except asyncio.TimeoutError:
                    error = await asyncio.get_running_loop().run_in_executor(None, unreachable, self.address)
                    if error is not None:
                        raise error from None
                    item = await asyncio.wait_for(q.get(), self.timeout - UNREACHABLE_CHECK_S)
            elif _timeout is not None:  # one timer handle; wait_for costs a task per message
                async with _timeout(self.timeout):
                    item = await q.get()
            else:
                item = await asyncio.wait_for(q.get(), self.timeout)
        except ServerUnreachable:
            raise
        except asyncio.TimeoutError:
            raise timeout_error(self.address, request_id, self.timeout) from None
        if isinstance(item, BaseException):
            raise item
        return item

    def _route(self, frame: bytes) -> None:
        """Hand one server frame to its request's queue (frames of finished requests are dropped)."""
        self._heard = True
        msg = decode_answer(frame)
        if msg is None:
            return
        q = self._waiters.get(msg.id)
        if q is not None:
            self._book.received(msg)
            q.put_nowait(msg)

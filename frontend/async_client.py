"""AsyncClient: the asyncio reference client, on the caller's event loop (zmq.asyncio).

One reader task, started with the first request, routes every answer to its request's queue by id. Every
AsyncClient of a process shares one zmq context (one ZeroMQ I/O thread, however many clients): a client owns
only its socket, which close() closes; the context lives as long as the process.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from metrale.ipc.messages import Delta, EngineStats, Error, Health, HealthQuery, StatsQuery
from metrale.ipc.sampling import SamplingParams

from .client_protocol import (
    DEFAULT_PORT,
    DEFAULT_TIMEOUT_S,
    ClientClosed,
    Completion,
    RequestError,
    abort_frame,
    check_new_id,
    decode_answer,
    encode,
    generate_frame,
    is_noise,
    log,
    new_id,
    query_answer,
    server_address,
    timeout_error,
)

_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+
_shared: tuple[int, zmq.asyncio.Context] | None = None  # (the pid that made it, the context)
_shared_lock = threading.Lock()


def shared_context() -> zmq.asyncio.Context:
    """This process's zmq context for AsyncClients; a new one after a fork or if someone terminated it."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared[0] != os.getpid() or _shared[1].closed:
            _shared = (os.getpid(), zmq.asyncio.Context())
        return _shared[1]


class AsyncClient:
    """asyncio client on zmq.asyncio; one reader task routes answers to requests by id."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        timeout: float = DEFAULT_TIMEOUT_S,
        *,
        address: str | None = None,
    ) -> None:
        self.address = server_address(host, port, address)
        self.timeout = timeout
        self._sock = shared_context().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.address)
        self._drain_sock = zmq.Socket.shadow(self._sock.underlying)  # reads what else has arrived, no future each
        self._waiters: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._closed = False

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the reader, close the socket, and fail every request still waiting (the shared context stays)."""
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for q in self._waiters.values():
            q.put_nowait(ClientClosed("the client was closed"))
        self._waiters.clear()
        self._drain_sock = None
        self._sock.close(linger=0)

    async def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Run a request, yielding its Deltas; leaving the loop early aborts it."""
        request_id = request_id or new_id()
        frame = generate_frame(request_id, prompt, token_ids, params)
        q = self._register(request_id)
        finished = False
        try:
            await self._sock.send(frame)
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
            if not finished and not self._closed:  # left early: the server should stop working on it
                sent = self._sock.send(abort_frame(request_id), flags=zmq.DONTWAIT)
                if sent.done() and sent.exception() is not None:
                    log.warning("metrale client: could not send the abort of %r: %s", request_id, sent.exception())

    async def complete(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Completion:
        """Run a request to its end and return the whole output."""
        done = Completion(id=request_id or new_id())
        async for delta in self.generate(prompt, token_ids=token_ids, params=params, request_id=done.id):
            done.add(delta)
        return done

    async def abort(self, request_id: str) -> None:
        """Ask the server to stop a request; its stream then ends with finish_reason "abort"."""
        await self._sock.send(abort_frame(request_id))

    async def stats(self) -> EngineStats:
        """The engine core's counters."""
        reply = await self._ask(StatsQuery(id=new_id()))
        return reply.stats

    async def health(self) -> Health:
        """Each server process's pid, uptime, restarts and the last fault."""
        return await self._ask(HealthQuery(id=new_id()))

    async def _ask(self, msg: StatsQuery | HealthQuery):
        """Send a one-answer query and wait for its answer."""
        q = self._register(msg.id)
        try:
            await self._sock.send(encode(msg))
            reply = await self._wait(q, msg.id)
        finally:
            self._waiters.pop(msg.id, None)
        return query_answer(reply, msg.id)

    def _register(self, request_id: str) -> asyncio.Queue:
        """Route answers for request_id to a new queue; start the reader on first use."""
        check_new_id(self._closed, self._waiters, request_id)
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_forever())
        q = self._waiters[request_id] = asyncio.Queue()
        return q

    async def _wait(self, q: asyncio.Queue, request_id: str):
        """The next message for a request; TimeoutError when the server stays silent for `timeout`."""
        try:
            if not q.empty():
                item = q.get_nowait()
            elif _timeout is not None:  # one timer handle; wait_for costs a task per message
                async with _timeout(self.timeout):
                    item = await q.get()
            else:
                item = await asyncio.wait_for(q.get(), self.timeout)
        except asyncio.TimeoutError:
            raise timeout_error(self.address, request_id, self.timeout) from None
        if isinstance(item, BaseException):
            raise item
        return item

    async def _read_forever(self) -> None:
        """Route every server frame to its request's queue."""
        while True:
            self._route(await self._sock.recv())
            while True:  # then whatever else is queued, without a future per frame
                try:
                    frame = self._drain_sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._route(frame)

    def _route(self, frame: bytes) -> None:
        """Hand one server frame to its request's queue (frames of finished requests are dropped)."""
        msg = decode_answer(frame)
        if msg is None:
            return
        q = self._waiters.get(msg.id)
        if q is not None:
            q.put_nowait(msg)

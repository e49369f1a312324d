"""Client and AsyncClient: the reference Python clients of docs/protocol.md.

Both speak ZMQ DEALER → the server's ROUTER, one msgpack frame per message, and route the answers by request id,
so any number of requests can stream at once over one client:

    with Client() as client:
        for delta in client.generate("Once upon a time", params=SamplingParams(max_tokens=32)):
            print(delta.text, end="")
        print(client.complete("2 + 2 =").text)

The sync Client owns one background thread that does all socket I/O (ZMQ sockets are not thread-safe), so it
may be used from many threads at once. AsyncClient runs on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from metrale.ipc.messages import (
    Abort,
    Delta,
    EngineStats,
    Error,
    Generate,
    Health,
    HealthQuery,
    ServerMessage,
    Stats,
    StatsQuery,
    TokenLogprob,
)
from metrale.ipc.sampling import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_PORT = 7410
DEFAULT_TIMEOUT_S = 60.0
_STOP_IO = b""  # the sync client's I/O thread exits when it reads an empty frame from its inbox


class RequestError(Exception):
    """The server answered a request with Error{code, message}."""

    def __init__(self, code: str, message: str, request_id: str = "") -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class ClientClosed(RuntimeError):
    """The client was closed while a request was waiting for its answer."""


@dataclass(slots=True)
class Completion:
    """A whole request's output, as `complete()` returns it."""

    id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, delta: Delta) -> None:
        """Fold one streamed delta into the completion."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.prompt_tokens = delta.prompt_tokens or 0
            self.completion_tokens = delta.completion_tokens or 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ServerMessage)


def _generate_frame(
    request_id: str, prompt: str | None, token_ids: list[int] | None, params: SamplingParams | None
) -> bytes:
    """The Generate frame for one request."""
    if (prompt is None) == (token_ids is None):
        raise ValueError("give exactly one of prompt and token_ids")
    msg = Generate(id=request_id, prompt=prompt, token_ids=token_ids, sampling=params or SamplingParams())
    return _encoder.encode(msg)


def _is_noise(msg: Delta | Error) -> bool:
    """A frame that says nothing about a running request's output.

    An empty non-final Delta is the server checking that the client is still there; an Error "unknown_id" only
    ever answers an Abort (of a request that had already finished), never a Generate.
    """
    if isinstance(msg, Error):
        return msg.code == "unknown_id"
    return msg.finish_reason is None and not msg.text and not msg.token_ids and not msg.logprobs


def _timeout_error(address: str, request_id: str, timeout: float) -> TimeoutError:
    """The error for a server that went silent."""
    return TimeoutError(
        f"no answer from the metrale server at {address} for request {request_id!r} within {timeout:g} s "
        "(is `metrale serve` running and listening there?)"
    )


def _new_id() -> str:
    """A fresh request id."""
    return uuid.uuid4().hex


# ---- sync ----------------------------------------------------------------------------


class Client:
    """Blocking client; safe to share between threads."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        timeout: float = DEFAULT_TIMEOUT_S,
        *,
        address: str | None = None,
    ) -> None:
        self.address = address or f"tcp://{host}:{port}"
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._lock = threading.RLock()  # guards _waiters and the outbox (re-entrant: __del__ may run under it)
        self._waiters: dict[str, queue.SimpleQueue] = {}
        self._closed = False
        inbox_addr = f"inproc://metrale-client-{uuid.uuid4().hex}"
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.setsockopt(zmq.SNDHWM, 0)  # while the server is down, requests queue (and time out)
        self._dealer.connect(self.address)
        # Callers hand frames to the I/O thread over an unbounded inproc pair, so a caller never blocks on it.
        self._inbox = self._ctx.socket(zmq.PAIR)  # read by the I/O thread
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.bind(inbox_addr)
        self._outbox = self._ctx.socket(zmq.PAIR)  # written by callers, under _lock
        self._outbox.setsockopt(zmq.SNDHWM, 0)
        self._outbox.connect(inbox_addr)
        self._io = threading.Thread(target=self._io_loop, name="metrale-client-io", daemon=True)
        self._io.start()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the I/O thread, close the sockets, and fail every request still waiting."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._outbox.send(_STOP_IO)
            waiters, self._waiters = self._waiters, {}
        self._io.join()
        for q in waiters.values():
            q.put(ClientClosed("the client was closed"))
        for sock in (self._outbox, self._inbox, self._dealer):
            sock.close(linger=0)
        self._ctx.term()

    def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> DeltaStream:
        """Start a request now; iterate the result for its Deltas (the last has a finish_reason)."""
        request_id = request_id or _new_id()
        frame = _generate_frame(request_id, prompt, token_ids, params)
        q = self._register(request_id)
        try:
            self._post(frame)
        except BaseException:
            self._unregister(request_id)
            raise
        return DeltaStream(self, request_id, q)

    def complete(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Completion:
        """Run a request to its end and return the whole output."""
        stream = self.generate(prompt, token_ids=token_ids, params=params, request_id=request_id)
        done = Completion(id=stream.request_id)
        with stream:
            for delta in stream:
                done.add(delta)
        return done

    def abort(self, request_id: str) -> None:
        """Ask the server to stop a request; its stream then ends with finish_reason "abort"."""
        self._post(_encoder.encode(Abort(id=request_id)))

    def stats(self) -> EngineStats:
        """The engine core's counters."""
        reply = self._ask(lambda rid: StatsQuery(id=rid))
        assert isinstance(reply, Stats)
        return reply.stats

    def health(self) -> Health:
        """Each server process's pid, uptime, restarts and the last fault."""
        reply = self._ask(lambda rid: HealthQuery(id=rid))
        assert isinstance(reply, Health)
        return reply

    def _ask(self, make) -> Stats | Health:
        """Send a one-answer query and wait for its answer."""
        request_id = _new_id()
        q = self._register(request_id)
        try:
            self._post(_encoder.encode(make(request_id)))
            reply = self._wait(q, request_id)
        finally:
            self._unregister(request_id)
        if isinstance(reply, Error):
            raise RequestError(reply.code, reply.message, request_id)
        return reply

    def _wait(self, q: queue.SimpleQueue, request_id: str):
        """The next message for a request; TimeoutError when the server stays silent for `timeout`."""
        try:
            item = q.get(timeout=self.timeout)
        except queue.Empty:
            raise _timeout_error(self.address, request_id, self.timeout) from None
        if isinstance(item, BaseException):
            raise item
        return item

    def _register(self, request_id: str) -> queue.SimpleQueue:
        """Route answers for request_id to a new queue."""
        with self._lock:
            if self._closed:
                raise ClientClosed("the client is closed")
            if request_id in self._waiters:
                raise ValueError(f"request id {request_id!r} is already running on this client")
            q = self._waiters[request_id] = queue.SimpleQueue()
        return q

    def _unregister(self, request_id: str) -> None:
        """Stop routing answers for request_id."""
        with self._lock:
            self._waiters.pop(request_id, None)

    def _post(self, frame: bytes) -> None:
        """Hand a frame to the I/O thread."""
        with self._lock:
            if self._closed:
                raise ClientClosed("the client is closed")
            self._outbox.send(frame)

    def _io_loop(self) -> None:
        """The I/O thread: forward outgoing frames to the server, route incoming frames to their requests."""
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._inbox, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll():
                if sock is self._inbox:
                    frame = self._inbox.recv()
                    if frame == _STOP_IO:
                        return
                    self._dealer.send(frame)
                else:
                    self._route(self._dealer.recv())

    def _route(self, data: bytes) -> None:
        """Put one server frame on its request's queue."""
        try:
            msg = _decoder.decode(data)
        except msgspec.DecodeError:
            log.warning("metrale client: undecodable frame from the server dropped")
            return
        with self._lock:
            q = self._waiters.get(msg.id)
        if q is not None:
            q.put(msg)
        elif isinstance(msg, Error):
            log.debug("metrale client: error for no running request: %s", msg)


class DeltaStream:
    """The Deltas of one running request; closing it early aborts the request."""

    def __init__(self, client: Client, request_id: str, q: queue.SimpleQueue) -> None:
        self.request_id = request_id
        self._client = client
        self._queue = q
        self._done = False

    def __iter__(self) -> DeltaStream:
        return self

    def __next__(self) -> Delta:
        """The next Delta; RequestError for an Error, TimeoutError when the server goes silent."""
        if self._done:
            raise StopIteration
        try:
            while True:
                msg = self._client._wait(self._queue, self.request_id)
                if _is_noise(msg):
                    continue
                if isinstance(msg, Error):
                    self._end(abort=False)
                    raise RequestError(msg.code, msg.message, self.request_id)
                break
        except (TimeoutError, ClientClosed):
            self._end(abort=True)
            raise
        if msg.finish_reason is not None:
            self._end(abort=False)
        return msg

    def __enter__(self) -> DeltaStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening; a request that has not finished is aborted."""
        if not self._done:
            self._end(abort=True)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _end(self, abort: bool) -> None:
        """Unregister the request, telling the server to stop it when it is still running."""
        self._done = True
        self._client._unregister(self.request_id)
        if abort:
            try:
                self._client.abort(self.request_id)
            except ClientClosed:
                pass


# ---- async ---------------------------------------------------------------------------


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
        self.address = address or f"tcp://{host}:{port}"
        self.timeout = timeout
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.address)
        self._waiters: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._closed = False

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the reader, close the socket, and fail every request still waiting."""
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for q in self._waiters.values():
            q.put_nowait(ClientClosed("the client was closed"))
        self._waiters.clear()
        self._sock.close(linger=0)
        self._ctx.term()

    async def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Run a request, yielding its Deltas; leaving the loop early aborts it."""
        request_id = request_id or _new_id()
        frame = _generate_frame(request_id, prompt, token_ids, params)
        q = self._register(request_id)
        finished = False
        try:
            await self._sock.send(frame)
            while True:
                msg = await self._wait(q, request_id)
                if _is_noise(msg):
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
                sent = self._sock.send(_encoder.encode(Abort(id=request_id)), flags=zmq.DONTWAIT)
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
        done = Completion(id=request_id or _new_id())
        async for delta in self.generate(prompt, token_ids=token_ids, params=params, request_id=done.id):
            done.add(delta)
        return done

    async def abort(self, request_id: str) -> None:
        """Ask the server to stop a request; its stream then ends with finish_reason "abort"."""
        await self._sock.send(_encoder.encode(Abort(id=request_id)))

    async def stats(self) -> EngineStats:
        """The engine core's counters."""
        reply = await self._ask(StatsQuery(id=_new_id()))
        return reply.stats

    async def health(self) -> Health:
        """Each server process's pid, uptime, restarts and the last fault."""
        return await self._ask(HealthQuery(id=_new_id()))

    async def _ask(self, msg: StatsQuery | HealthQuery):
        """Send a one-answer query and wait for its answer."""
        q = self._register(msg.id)
        try:
            await self._sock.send(_encoder.encode(msg))
            reply = await self._wait(q, msg.id)
        finally:
            self._waiters.pop(msg.id, None)
        if isinstance(reply, Error):
            raise RequestError(reply.code, reply.message, msg.id)
        return reply

    def _register(self, request_id: str) -> asyncio.Queue:
        """Route answers for request_id to a new queue; start the reader on first use."""
        if self._closed:
            raise ClientClosed("the client is closed")
        if request_id in self._waiters:
            raise ValueError(f"request id {request_id!r} is already running on this client")
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_forever())
        q = self._waiters[request_id] = asyncio.Queue()
        return q

    async def _wait(self, q: asyncio.Queue, request_id: str):
        """The next message for a request; TimeoutError when the server stays silent for `timeout`."""
        try:
            item = await asyncio.wait_for(q.get(), self.timeout)
        except asyncio.TimeoutError:
            raise _timeout_error(self.address, request_id, self.timeout) from None
        if isinstance(item, BaseException):
            raise item
        return item

    async def _read_forever(self) -> None:
        """Route every server frame to its request's queue."""
        while True:
            data = await self._sock.recv()
            try:
                msg = _decoder.decode(data)
            except msgspec.DecodeError:
                log.warning("metrale client: undecodable frame from the server dropped")
                continue
            q = self._waiters.get(msg.id)
            if q is not None:
                q.put_nowait(msg)

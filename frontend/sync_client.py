"""Client: the blocking reference client, safe to share between threads.

One background thread does all socket I/O (ZMQ sockets are not thread-safe): callers hand it frames over an
inproc pair and wait on a queue per request, which the thread fills with the server's answers. It also watches the
connection: when it comes back after a break (the frontend was restarted), it re-attaches every live request where
its stream was (a Resume per request, client_protocol.ResumeBook), so a frontend's death costs a stream nothing.
"""

from __future__ import annotations

import queue
import threading

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
    UNREACHABLE_CHECK_S,
)

_STOP_IO = b""  # the I/O thread exits when it reads an empty frame from its inbox


class Client:
    """Blocking client; safe to share between threads."""

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
        self._ctx = zmq.Context()
        self._lock = threading.RLock()  # guards _waiters and the outbox (re-entrant: __del__ may run under it)
        self._waiters: dict[str, queue.SimpleQueue] = {}
        self._closed = False
        self._heard = False  # a frame came from the server (so something listens there)
        self._book = ResumeBook()  # under _lock
        self._connection_lost = False  # (I/O thread) the connection broke: re-attach once it is back
        inbox_addr = f"inproc://metrale-client-{new_id()}"
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.setsockopt(zmq.SNDHWM, 0)  # while the server is down, requests queue (and time out)
        self._monitor = self._dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
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
        self._dealer.disable_monitor()
        for sock in (self._outbox, self._inbox, self._monitor, self._dealer):
            sock.close(linger=0)
        self._ctx.term()

    def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora: str | None = None,
    ) -> DeltaStream:
        """Start a request now; iterate the result for its Deltas (the last has a finish_reason)."""
        request_id = request_id or new_id()
        msg = generate_message(request_id, prompt, token_ids, params, self.api_key, lora, self._book.session)
        q = self._register(request_id)
        try:
            with self._lock:  # before the I/O thread can see an answer
                self._book.started(msg)
            self._post(encode(msg))
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
        lora: str | None = None,
    ) -> Completion:
        """Run a request to its end and return the whole output."""
        stream = self.generate(prompt, token_ids=token_ids, params=params, request_id=request_id, lora=lora)
        done = Completion(id=stream.request_id)
        with stream:
            for delta in stream:
                done.add(delta)
        return done

    def abort(self, request_id: str) -> None:
        """Ask the server to stop a request; its stream then ends with finish_reason "abort"."""
        self._post(abort_frame(request_id, self.api_key))

    def stats(self) -> EngineStats:
        """The engine core's counters."""
        return self.server_stats().stats

    def server_stats(self) -> Stats:
        """The engine core's counters and what the frontend measured (`frontend`: recent latencies)."""
        reply = self._ask(lambda rid: StatsQuery(id=rid))
        assert isinstance(reply, Stats)
        return reply

    def health(self) -> Health:
        """Each server process's pid, uptime, restarts and the last fault."""
        reply = self._ask(lambda rid: HealthQuery(id=rid))
        assert isinstance(reply, Health)
        return reply

    def model_info(self) -> ModelInfoReply:
        """The served model: name, vocabulary size, max_model_len, eos ids and chat template."""
        reply = self._ask(lambda rid: ModelInfoQuery(id=rid))
        assert isinstance(reply, ModelInfoReply)
        return reply

    def kill_worker(self, signal: str = "KILL", *, rank: int = 0, replica: int = 0) -> AdminReply:
        """Admin (a server with --enable-admin): send a GPU worker SIGKILL, SIGTERM or SIGSTOP (KILL, TERM, STOP)."""
        reply = self._ask(lambda rid: Admin(id=rid, action="kill", signal=signal, rank=rank, replica=replica))
        assert isinstance(reply, AdminReply)
        return reply

    def restart_worker(self, *, rank: int = 0, replica: int = 0) -> AdminReply:
        """Admin (a server with --enable-admin): stop a GPU worker (TERM, then KILL); a new one takes over."""
        reply = self._ask(lambda rid: Admin(id=rid, action="restart", rank=rank, replica=replica))
        assert isinstance(reply, AdminReply)
        return reply

    def _ask(self, make) -> Stats | Health | ModelInfoReply | AdminReply:
        """Send a one-answer query and wait for its answer."""
        request_id = new_id()
        q = self._register(request_id)
        try:
            self._post(keyed(make(request_id), self.api_key))
            reply = self._wait(q, request_id)
        finally:
            self._unregister(request_id)
        return query_answer(reply, request_id)

    def _wait(self, q: queue.SimpleQueue, request_id: str):
        """The next message for a request; TimeoutError when the server stays silent for `timeout`
        (ServerUnreachable within seconds when nothing listens at the address at all)."""
        try:
            if self._heard or self.timeout <= UNREACHABLE_CHECK_S:
                item = q.get(timeout=self.timeout)
            else:
                try:
                    item = q.get(timeout=UNREACHABLE_CHECK_S)
                except queue.Empty:
                    error = unreachable(self.address)
                    if error is not None:
                        raise error from None
                    item = q.get(timeout=self.timeout - UNREACHABLE_CHECK_S)
        except queue.Empty:
            raise timeout_error(self.address, request_id, self.timeout) from None
        if isinstance(item, BaseException):
            raise item
        return item

    def _register(self, request_id: str) -> queue.SimpleQueue:
        """Route answers for request_id to a new queue."""
        with self._lock:
            check_new_id(self._closed, self._waiters, request_id)
            q = self._waiters[request_id] = queue.SimpleQueue()
        return q

    def _unregister(self, request_id: str) -> None:
        """Stop routing answers for request_id."""
        with self._lock:
            self._waiters.pop(request_id, None)
            self._book.ended(request_id)

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
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll():
                if sock is self._inbox:
                    frame = self._inbox.recv()
                    if frame == _STOP_IO:
                        return
                    self._dealer.send(frame)
                elif sock is self._monitor:
                    self._on_connection_event(self._monitor.recv_multipart())
                else:
                    self._route(self._dealer.recv())

    def _on_connection_event(self, frames: list[bytes]) -> None:
        """A break of the connection, or its (re)establishment: after a break, first take every answer that came on
        the old connection (so each request's count is what it received), then re-attach every live request."""
        event = int.from_bytes(frames[0][:2], "little")
        if event == zmq.EVENT_DISCONNECTED:
            self._connection_lost = True
            return
        if not self._connection_lost:
            return
        self._connection_lost = False
        while True:
            try:
                self._route(self._dealer.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        with self._lock:
            frames = self._book.resume_frames()
        if frames:
            log.info("metrale client: the connection to %s came back; re-attaching %d request(s)", self.address,
                     len(frames))
        for frame in frames:
            self._dealer.send(frame)

    def _route(self, data: bytes) -> None:
        """Put one server frame on its request's queue."""
        self._heard = True
        msg = decode_answer(data)
        if msg is None:
            return
        with self._lock:
            q = self._waiters.get(msg.id)
            if q is not None:
                self._book.received(msg)
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
                if is_noise(msg):
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

"""FrontendServer: clients' requests in, tokenized for the engine core; engine tokens in, text streamed out.

One asyncio (uvloop) process. Clients speak docs/protocol.md to a ZMQ ROUTER; the server validates each frame,
tokenizes, hands the engine core an AddRequest, detokenizes what comes back (stop strings included) and
streams Delta frames. Nothing waits on the engine: every socket send is non-blocking and every engine answer is
matched to its request when it arrives.

Socket contract with the engine core
------------------------------------
The FRONTEND binds both ipc:// endpoints; the engine core connects to them (so an engine-core restart simply
reconnects, and ZMQ queues nothing for a peer that is not there):

* ``engine_input_address``: frontend PUSH (bind) → engine core PULL (connect). One frame = msgpack of one
  ``EngineInput`` (AddRequest | AbortRequest | StatsRequest), tagged by "type".
* ``engine_output_address``: engine core PUSH (connect) → frontend PULL (bind). One frame = msgpack of one
  ``EngineOutput`` (EngineOutputs | StatsResponse | EngineReady).

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
   With "error", ``error`` is ``"<code>: <message>"`` where code is one of the protocol's error codes (e.g.
   ``"worker_fault: worker died"``) or just a message (code "internal"). Stop strings are the frontend's
   job; EOS, stop_token_ids, max_tokens and max_model_len are the engine core's.
4. Answer ``StatsRequest{id}`` with ``StatsResponse{id, stats}`` (same id).

The frontend answers outputs for request ids it does not know (a request it already finished, or one from
before a frontend restart) with an AbortRequest, once. While it has seen no EngineReady it sends
``StatsRequest{id: "<prefix>-ready"}`` every ``ready_probe_s``; a StatsResponse to it means an engine core is
already running (the frontend was restarted) and the frontend adopts it.

In-process clients: the HTTP API (http_api.py, started on the same loop when ``http_port`` is set) submits through
``generate_local`` / ``abort_local``: the same validation, tokenization, AddRequest, detokenization and abort
path as a Generate frame, with every answer handed to a callback instead of the ROUTER.

Client disconnects: a ROUTER is not told which peer left, so the server sends with ROUTER_MANDATORY and treats a
send that fails (peer gone, or so far behind that its queue is full) as a disconnect: that client's requests are
aborted. Every streamed delta is such a probe; when the socket monitor reports a disconnect, clients with live
requests on that connection (or all, when the connection is unknown) are probed with an empty Delta.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import logging
import os
import secrets
import signal
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from metrale.ipc.messages import (
    Abort,
    AbortRequest,
    AddRequest,
    ClientMessage,
    Delta,
    EngineOutput,
    EngineOutputs,
    EngineReady,
    Error,
    Generate,
    Health,
    HealthQuery,
    ProcessHealth,
    RequestOutputDelta,
    Stats,
    StatsQuery,
    StatsRequest,
    StatsResponse,
)
from metrale.ipc.sampling import SamplingParams

from .detokenizer import Decoder, IncrementalDetokenizer
from .metrics import Metrics
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

ERROR_CODES = frozenset({"bad_request", "too_long", "busy", "internal", "worker_fault", "unknown_id"})
_RECENT_ABORTS = 4096  # engine ids remembered as aborted, so a late output is not answered twice
_PROBE_DELAYS_S = (0.05, 0.5)  # after a disconnect event: libzmq tears the pipe down just after reporting it
_OUTBOX_RETRY_S = 0.005  # while the engine core's input socket has no peer
_SYNC_ENCODE_CHARS = 8192  # longer prompts are tokenized off the event loop (~1 ms per 1,500 characters)


@dataclass(slots=True)
class FrontendConfig:
    """Where the frontend listens and the limits it enforces."""

    model_dir: str
    engine_input_address: str  # ipc:// the frontend binds; the engine core connects a PULL
    engine_output_address: str  # ipc:// the frontend binds; the engine core connects a PUSH
    client_address: str = "tcp://127.0.0.1:7410"  # a port of * binds any free port (see client_endpoint)
    max_model_len: int | None = None  # until EngineReady says; default config.json's max_position_embeddings
    max_frame_bytes: int = 8 << 20  # larger frames get Error "too_long"
    hard_frame_bytes: int = 64 << 20  # larger frames make libzmq drop the connection
    max_id_chars: int = 256
    client_send_hwm: int = 100_000  # frames queued to one client before it counts as gone
    heartbeat_s: float = 5.0  # ZMTP PINGs; a peer silent for 3 intervals is disconnected (0 disables)
    engine_reply_timeout_s: float = 10.0  # StatsQuery answered with Error "internal" after this
    ready_probe_s: float = 2.0
    http_host: str = "127.0.0.1"
    http_port: int | None = None  # serve the OpenAI-compatible HTTP API here too (0: any free port)
    served_model_name: str | None = None  # the HTTP API's model id; default the model folder's name


@dataclass(slots=True)
class RequestState:
    """One live request: who asked, under which engine id, and its detokenizer."""

    client: bytes
    client_id: str
    params: SamplingParams
    arrival: float = 0.0
    prompt_ids: list[int] = field(default_factory=list)
    detok: IncrementalDetokenizer | None = None  # None while the prompt is being tokenized
    engine_id: str = ""  # "" until submitted to an engine core
    sink: LocalSink | None = None  # an in-process client's callback; None: answers go to the ROUTER
    decoder: Decoder | None = None  # detokenize with this instead of the server's tokenizer
    last_token_at: float | None = None  # when its last tokens came (None before the first)


@dataclass(slots=True)
class ClientState:
    """A connected client with live requests: its reply envelope, connection fd and requests by its own id."""

    envelope: tuple[bytes, ...]
    fd: int | None
    requests: dict[str, RequestState] = field(default_factory=dict)
    local: bool = False  # an in-process client (never probed over the ROUTER)


@dataclass(slots=True)
class PendingStats:
    """A StatsQuery waiting for the engine core."""

    client: bytes
    envelope: tuple[bytes, ...]
    client_id: str
    timer: asyncio.TimerHandle
    future: asyncio.Future | None = None  # an in-process caller's (engine_stats); then client is unused


class Rejected(Exception):
    """A request the server will not run; becomes Error{code, message}."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _IdOnly(msgspec.Struct):
    """Just the id of a frame that failed to decode as a ClientMessage."""

    id: object = None


HealthSource = Callable[[], Health]
LocalSink = Callable[[Delta | Error], None]
_LOCAL_PREFIX = b"\x00local-"  # ROUTER ids are 5 bytes from libzmq or never start with 0: no collision


class FrontendServer:
    """The frontend process's event loop: client ROUTER, engine PUSH/PULL, socket monitors."""

    def __init__(
        self,
        config: FrontendConfig,
        tokenizer: Tokenizer | None = None,
        health_source: HealthSource | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer or Tokenizer.from_dir(config.model_dir)
        self.health_source = health_source
        self.clock = clock
        self.client_endpoint: str | None = None  # the bound client address, once `bound` is set
        self.bound = threading.Event()
        self._started = clock()
        self._prefix = secrets.token_hex(4)  # engine ids of this frontend never collide with a previous one's
        self._ids = itertools.count()
        self._clients: dict[bytes, ClientState] = {}
        self._by_engine_id: dict[str, RequestState] = {}
        self._pending_stats: dict[str, PendingStats] = {}
        self._recent_aborts: OrderedDict[str, None] = OrderedDict()
        self._engine_up = False
        self.engine_ready = threading.Event()  # set once an engine core is up (for callers and tests)
        self._engine_outbox: deque[bytes] = deque()  # frames the engine core's socket could not take yet
        self._outbox_timer: asyncio.TimerHandle | None = None
        self._background: set[asyncio.Task] = set()  # long prompts being tokenized
        self._vocab_size = self.tokenizer.vocab_size
        self._max_model_len = config.max_model_len or _model_max_len(config.model_dir, self.tokenizer)
        self._client_decoder = msgspec.msgpack.Decoder(ClientMessage)
        self._engine_decoder = msgspec.msgpack.Decoder(EngineOutput)
        self.metrics = Metrics()
        self.http_endpoint: str | None = None  # "http://host:port" once the HTTP API listens
        self._encoder = msgspec.msgpack.Encoder()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = False
        self._router: zmq.asyncio.Socket | None = None
        self._to_engine: zmq.asyncio.Socket | None = None
        self._from_engine: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None

    # ---- lifecycle -------------------------------------------------------------------

    async def run(self) -> None:
        """Bind, serve until shutdown(), then close every socket."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self._stop_requested:
            self._stop.set()
        ctx = zmq.asyncio.Context()
        tasks: list[asyncio.Task] = []
        stop: asyncio.Task | None = None
        http = None
        try:
            self._open_sockets(ctx)
            if self.config.http_port is not None:
                from .http_api import HttpApi  # aiohttp is imported only by a server that serves HTTP

                http = HttpApi(self)
                self.http_endpoint = await http.start(self.config.http_host, self.config.http_port)
            self.bound.set()
            tasks = [
                asyncio.create_task(self._serve_clients(), name="frontend-clients"),
                asyncio.create_task(self._serve_engine(), name="frontend-engine"),
                asyncio.create_task(self._watch_clients(), name="frontend-monitor"),
                asyncio.create_task(self._probe_engine(), name="frontend-ready-probe"),
            ]
            stop = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop and task.exception() is not None:
                    raise task.exception()
        finally:
            tasks += [*self._background, *([stop] if stop is not None else [])]
            for task in tasks:
                task.cancel()
            if self._outbox_timer is not None:
                self._outbox_timer.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if http is not None:
                await http.stop()
            self._close_sockets()
            ctx.term()
            self.bound.set()  # a waiter must not hang when binding failed

    def shutdown(self) -> None:
        """Ask run() to return; safe from any thread and before run() starts."""
        self._stop_requested = True
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def _open_sockets(self, ctx: zmq.asyncio.Context) -> None:
        """Bind the client ROUTER (with its monitor) and the two engine ipc:// sockets."""
        cfg = self.config
        router = self._router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished peer fails instead of vanishing
        router.setsockopt(zmq.SNDHWM, cfg.client_send_hwm)
        router.setsockopt(zmq.MAXMSGSIZE, cfg.hard_frame_bytes)
        if cfg.heartbeat_s > 0:
            router.setsockopt(zmq.HEARTBEAT_IVL, int(cfg.heartbeat_s * 1000))
            router.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(cfg.heartbeat_s * 3000))
        self._monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        router.bind(cfg.client_address)
        self.client_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._to_engine = ctx.socket(zmq.PUSH)
        self._from_engine = ctx.socket(zmq.PULL)
        for sock in (self._to_engine, self._from_engine):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # the engine core is trusted: never drop what it must see
            sock.setsockopt(zmq.RCVHWM, 0)
        self._to_engine.bind(cfg.engine_input_address)
        self._from_engine.bind(cfg.engine_output_address)
        log.info("frontend listening on %s; engine core at %s / %s", self.client_endpoint,
                 cfg.engine_input_address, cfg.engine_output_address)

    def _close_sockets(self) -> None:
        """Close every socket without lingering (unsent frames are for peers that are going away too)."""
        if self._router is not None and self._monitor is not None:
            try:
                self._router.disable_monitor()
            except zmq.ZMQError:
                pass
        for sock in (self._monitor, self._router, self._to_engine, self._from_engine):
            if sock is not None:
                sock.close(linger=0)

    # ---- clients → server ------------------------------------------------------------

    async def _serve_clients(self) -> None:
        """Receive client frames forever; one bad frame never stops the loop."""
        while True:
            frames = await self._router.recv_multipart(copy=False)
            try:
                self._on_client_frames(frames)
            except Exception:  # a bug handling one frame must not take the server down
                log.exception("frontend: failed to handle a client frame")

    def _on_client_frames(self, frames: list[zmq.Frame]) -> None:
        """Decode one client message and act on it, or answer Error."""
        if len(frames) < 2:
            return
        client = frames[0].bytes
        envelope = tuple(f.bytes for f in frames[1:-1])  # empty for a DEALER; kept for REQ-style peers
        payload = frames[-1]
        data = payload.buffer
        if len(data) > self.config.max_frame_bytes:
            message = f"frame of {len(data)} bytes exceeds max_frame_bytes {self.config.max_frame_bytes}"
            self._reject(client, envelope, _salvage_id(data), "too_long", message)
            return
        try:
            msg = self._client_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._reject(client, envelope, _salvage_id(data), "bad_request", f"malformed message: {exc}")
            return
        if not msg.id or len(msg.id) > self.config.max_id_chars:
            self._reject(client, envelope, "", "bad_request", f"id must have 1..{self.config.max_id_chars} characters")
            return
        if isinstance(msg, Generate):
            self._on_generate(client, envelope, _srcfd(payload), msg)
        elif isinstance(msg, Abort):
            self._on_abort(client, envelope, msg)
        elif isinstance(msg, StatsQuery):
            self._on_stats_query(client, envelope, msg)
        elif isinstance(msg, HealthQuery):
            self._send(client, envelope, self._health(msg.id))

    def _on_generate(self, client: bytes, envelope: tuple[bytes, ...], fd: int | None, msg: Generate) -> None:
        """Validate and register a request; tokenize it (off the loop when long) and admit it."""
        try:
            req = self._register(client, envelope, fd, msg)
        except Rejected as exc:
            self._reject(client, envelope, msg.id, exc.code, exc.message)
            return
        self._tokenize_then_admit(req, msg)

    def _register(self, client: bytes, envelope: tuple[bytes, ...], fd: int | None, msg: Generate,
                  local: bool = False) -> RequestState:
        """Check a Generate and file it under its client; Rejected when it cannot run."""
        state = self._clients.get(client)
        if state is not None and msg.id in state.requests:
            raise Rejected("bad_request", f"duplicate id {msg.id!r}: a request with it is running")
        self._check_shape(msg)
        try:
            msg.sampling.validate(self._vocab_size)
        except ValueError as exc:
            raise Rejected("bad_request", f"sampling.{exc}") from None
        if state is None:
            state = self._clients[client] = ClientState(envelope=envelope, fd=fd, local=local)
        state.fd = fd if fd is not None else state.fd
        req = RequestState(client=client, client_id=msg.id, params=msg.sampling, arrival=self.clock())
        state.requests[msg.id] = req
        return req

    def _tokenize_then_admit(self, req: RequestState, msg: Generate, add_special_tokens: bool = True) -> None:
        """Admit a registered request: its token ids, or its prompt tokenized (off the loop when long)."""
        if msg.token_ids is not None:
            self._admit(req, msg.token_ids)
        elif len(msg.prompt) <= _SYNC_ENCODE_CHARS:
            self._admit(req, self.tokenizer.encode(msg.prompt, add_special_tokens=add_special_tokens))
        else:  # a long prompt takes long to tokenize: the loop keeps streaming meanwhile
            task = asyncio.create_task(self._encode_then_admit(req, msg.prompt, add_special_tokens))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _check_shape(self, msg: Generate) -> None:
        """Exactly one of prompt and token_ids, and token ids in the vocabulary; else Rejected."""
        if (msg.prompt is None) == (msg.token_ids is None):
            raise Rejected("bad_request", "exactly one of prompt and token_ids must be given")
        if msg.token_ids is not None:
            bad = [t for t in msg.token_ids if not 0 <= t < self._vocab_size]
            if bad:
                raise Rejected("bad_request", f"token_ids must be in [0, {self._vocab_size}) (got {bad[:5]})")

    async def _encode_then_admit(self, req: RequestState, prompt: str, add_special_tokens: bool = True) -> None:
        """Tokenize a long prompt on the tokenizer's threads, then admit the request."""
        try:
            ids = await self.tokenizer.encode_async(prompt, add_special_tokens=add_special_tokens)
        except Exception as exc:  # the tokenizer failing on one prompt fails that request only
            log.exception("frontend: tokenizing request %r failed", req.client_id)
            if self._is_live(req):
                self._send_final(req, Error(id=req.client_id, code="internal", message=f"tokenizer failed: {exc}"))
            return
        self._admit(req, ids)

    def _admit(self, req: RequestState, prompt_ids: list[int]) -> None:
        """Check the prompt's length; start detokenizing and submit to the engine core when one is up."""
        if not self._is_live(req):  # aborted or disconnected while its prompt was being tokenized
            return
        if not prompt_ids:
            self._send_final(req, Error(id=req.client_id, code="bad_request", message="the prompt is empty"))
            return
        if self._max_model_len is not None and len(prompt_ids) >= self._max_model_len:
            message = (f"the prompt has {len(prompt_ids)} tokens; max_model_len is {self._max_model_len} "
                       "(the prompt and at least one new token must fit)")
            self._send_final(req, Error(id=req.client_id, code="too_long", message=message))
            return
        req.prompt_ids = prompt_ids
        req.detok = IncrementalDetokenizer(req.decoder or self.tokenizer, prompt_ids, req.params)
        if self._engine_up:
            self._submit(req)

    def _is_live(self, req: RequestState) -> bool:
        """True while req is its client's running request with its id."""
        state = self._clients.get(req.client)
        return state is not None and state.requests.get(req.client_id) is req

    def _on_abort(self, client: bytes, envelope: tuple[bytes, ...], msg: Abort) -> None:
        """End a live request with finish_reason "abort"; an id that is not live gets Error unknown_id."""
        state = self._clients.get(client)
        req = state.requests.get(msg.id) if state is not None else None
        if req is None:
            self._reject(client, envelope, msg.id, "unknown_id", f"no running request with id {msg.id!r}")
            return
        text = req.detok.flush() if req.detok is not None else ""
        self._finish(req, "abort", text, [], None)
        self._abort_engine([req.engine_id] if req.engine_id else [])

    def _on_stats_query(self, client: bytes, envelope: tuple[bytes, ...], msg: StatsQuery) -> None:
        """Ask the engine core for its counters; the answer is matched by an internal id."""
        internal = f"{self._prefix}-s{next(self._ids)}"
        if not self._engine_up:
            self._reject(client, envelope, msg.id, "busy", "the engine core is not ready")
            return
        self._send_engine(StatsRequest(id=internal))
        timer = self._loop.call_later(self.config.engine_reply_timeout_s, self._stats_timed_out, internal)
        self._pending_stats[internal] = PendingStats(client, envelope, msg.id, timer)

    def _stats_timed_out(self, internal: str) -> None:
        """The engine core did not answer a StatsRequest in time."""
        pending = self._pending_stats.pop(internal, None)
        message = "the engine core did not answer"
        if pending is None:
            return
        if pending.future is not None:
            if not pending.future.done():
                pending.future.set_exception(TimeoutError(message))
        else:
            self._reject(pending.client, pending.envelope, pending.client_id, "internal", message)

    def _health(self, request_id: str) -> Health:
        """Health from the supervisor's source when there is one, else what this process knows."""
        fault = None
        if self.health_source is not None:
            try:
                return msgspec.structs.replace(self.health_source(), id=request_id)
            except Exception as exc:  # a broken source must not leave the client without an answer
                log.exception("frontend: the health source failed")
                fault = f"health source failed: {exc}"
        uptime = self.clock() - self._started
        me = ProcessHealth(name="frontend", pid=os.getpid(), uptime_s=uptime, restarts=0, alive=True)
        return Health(id=request_id, healthy=self._engine_up and fault is None, processes=[me], last_fault=fault)

    # ---- in-process clients (the HTTP API) -------------------------------------------

    @property
    def vocab_size(self) -> int:
        """The engine core's vocabulary size (the tokenizer's until an engine core says)."""
        return self._vocab_size

    @property
    def max_model_len(self) -> int | None:
        """Longest sequence (prompt + output) the engine core takes."""
        return self._max_model_len

    def open_local(self) -> bytes:
        """A fresh key under which one in-process caller (an HTTP request) files its requests."""
        return _LOCAL_PREFIX + str(next(self._ids)).encode()

    def generate_local(
        self,
        key: bytes,
        request_id: str,
        sink: LocalSink,
        params: SamplingParams,
        *,
        prompt: str | None = None,
        token_ids: list[int] | None = None,
        add_special_tokens: bool = True,
        decoder: Decoder | None = None,
    ) -> None:
        """Start a request exactly as a Generate frame would; its Deltas (or its one Error) go to sink.

        sink is called on the event loop; the last message is a Delta with a finish_reason or an Error. A decoder
        replaces the tokenizer for detokenizing (e.g. one that keeps reasoning tags in the text).
        """
        msg = Generate(id=request_id, prompt=prompt, token_ids=token_ids, sampling=params)
        try:
            req = self._register(key, (), None, msg, local=True)
        except Rejected as exc:
            sink(Error(id=request_id, code=exc.code, message=exc.message))
            return
        req.sink, req.decoder = sink, decoder
        self._tokenize_then_admit(req, msg, add_special_tokens)

    def abort_local(self, key: bytes) -> None:
        """Abort every live request filed under key (its caller went away); its sinks hear nothing more."""
        self._drop_client(key, "closed")

    async def engine_stats(self, timeout_s: float | None = None) -> EngineStats:
        """The engine core's counters; Rejected("busy") before one is up, TimeoutError when it does not answer."""
        if not self._engine_up:
            raise Rejected("busy", "the engine core is not ready")
        internal = f"{self._prefix}-s{next(self._ids)}"
        future = self._loop.create_future()
        wait_s = self.config.engine_reply_timeout_s if timeout_s is None else timeout_s
        timer = self._loop.call_later(wait_s, self._stats_timed_out, internal)
        self._pending_stats[internal] = PendingStats(b"", (), "", timer, future)
        self._send_engine(StatsRequest(id=internal))
        try:
            return await future
        finally:  # the caller may have been cancelled
            if self._pending_stats.pop(internal, None) is not None:
                timer.cancel()

    def health(self) -> Health:
        """Each process's health, as a HealthQuery is answered."""
        return self._health("")

    # ---- engine core → server --------------------------------------------------------

    async def _serve_engine(self) -> None:
        """Receive engine-core frames forever."""
        while True:
            data = await self._from_engine.recv()
            try:
                self._on_engine_message(self._engine_decoder.decode(data))
            except msgspec.DecodeError:
                log.exception("frontend: undecodable frame from the engine core")
            except Exception:
                log.exception("frontend: failed to handle an engine-core frame")

    def _on_engine_message(self, msg: EngineOutputs | StatsResponse | EngineReady) -> None:
        """Dispatch one engine-core message."""
        if isinstance(msg, EngineOutputs):
            aborts: list[str] = []
            for out in msg.outputs:
                self._on_output(out, aborts)
            self._abort_engine(aborts)
        elif isinstance(msg, StatsResponse):
            self._on_stats_response(msg)
        elif isinstance(msg, EngineReady):
            self._on_engine_ready(msg)

    def _on_output(self, out: RequestOutputDelta, aborts: list[str]) -> None:
        """Detokenize one request's new tokens and stream them; collect engine ids to abort."""
        req = self._by_engine_id.get(out.request_id)
        if req is None:
            self._on_orphan(out, aborts)
            return
        if out.finish_reason == "error":
            code, message = _engine_error(out.error)
            self._send_final(req, Error(id=req.client_id, code=code, message=message))
            return
        before = len(req.detok.output_ids)
        text, stopped = req.detok.push(out.new_token_ids)
        accepted = req.detok.output_ids[before:]
        if accepted:
            self._tokens_came(req, len(accepted))
        wants_logprobs = out.logprobs is not None and req.params.logprobs is not None
        logprobs = out.logprobs[: len(accepted)] if wants_logprobs else None
        if stopped:
            self._finish(req, "stop", text, accepted, logprobs)
            if out.finish_reason is None:
                aborts.append(out.request_id)
        elif out.finish_reason is not None:
            text += req.detok.flush()
            reason = "stop" if req.detok.stopped else out.finish_reason
            self._finish(req, reason, text, accepted, logprobs)
        else:
            delta = Delta(id=req.client_id, text=text, token_ids=accepted, logprobs=logprobs)
            self._deliver(req, delta, self._clients[req.client].envelope)

    def _tokens_came(self, req: RequestState, count: int) -> None:
        """Time to first token, or the gap per token since the request's last tokens."""
        now = self.clock()
        if req.last_token_at is None:
            self.metrics.first_token(now - req.arrival)
        else:
            self.metrics.next_tokens((now - req.last_token_at) / count)
        req.last_token_at = now

    def _on_orphan(self, out: RequestOutputDelta, aborts: list[str]) -> None:
        """Output for an engine id with no live request: abort it once (the engine core may not know it ended)."""
        if out.finish_reason is not None:
            self._recent_aborts.pop(out.request_id, None)
        elif out.request_id not in self._recent_aborts:
            aborts.append(out.request_id)

    def _on_stats_response(self, msg: StatsResponse) -> None:
        """Answer the StatsQuery this response belongs to; a readiness probe's answer adopts the engine core."""
        if msg.id == f"{self._prefix}-ready":
            if not self._engine_up:
                log.info("frontend: adopting a running engine core (it answered the readiness probe)")
                self._engine_came_up()
            return
        pending = self._pending_stats.pop(msg.id, None)
        if pending is None:
            return
        pending.timer.cancel()
        if pending.future is not None:
            if not pending.future.done():
                pending.future.set_result(msg.stats)
        else:
            self._send(pending.client, pending.envelope, Stats(id=pending.client_id, stats=msg.stats))

    def _on_engine_ready(self, msg: EngineReady) -> None:
        """A fresh engine core: take its limits and (re)submit every live request."""
        log.info("frontend: engine core ready (vocab %d, max_model_len %d)", msg.vocab_size, msg.max_model_len)
        self._vocab_size = msg.vocab_size
        self._max_model_len = msg.max_model_len
        self._engine_came_up()

    def _engine_came_up(self) -> None:
        """Submit every live request under a new engine id, aborting the id it had."""
        self._engine_up = True
        self.engine_ready.set()
        old = [req.engine_id for state in self._clients.values() for req in state.requests.values() if req.engine_id]
        self._abort_engine(old)
        for state in self._clients.values():
            for req in state.requests.values():
                if req.detok is not None:  # else it is submitted once its prompt is tokenized
                    self._submit(req)

    # ---- server → engine core --------------------------------------------------------

    def _submit(self, req: RequestState) -> None:
        """Send a request to the engine core under a fresh engine id."""
        if req.engine_id:
            self._by_engine_id.pop(req.engine_id, None)
        req.engine_id = f"{self._prefix}-{next(self._ids)}"
        self._by_engine_id[req.engine_id] = req
        add = AddRequest(
            request_id=req.engine_id,
            prompt_token_ids=req.prompt_ids,
            params=req.params,
            output_token_ids=list(req.detok.output_ids),
        )
        self._send_engine(add)

    def _abort_engine(self, engine_ids: list[str]) -> None:
        """Tell the engine core to drop these requests; remember them so late outputs are not re-aborted."""
        if not engine_ids:
            return
        for engine_id in engine_ids:
            self._recent_aborts[engine_id] = None
        while len(self._recent_aborts) > _RECENT_ABORTS:
            self._recent_aborts.popitem(last=False)
        self._send_engine(AbortRequest(request_ids=engine_ids))

    def _send_engine(self, msg: msgspec.Struct) -> None:
        """Send one message to the engine core without waiting; in order, later if its socket is not there yet.

        An engine core that sent EngineReady may not have finished connecting its input socket; a dead one's
        replacement connects later. Frames wait in an outbox (retried every few ms) rather than being dropped.
        """
        self._engine_outbox.append(self._encoder.encode(msg))
        if self._outbox_timer is None:  # else a retry is already scheduled
            self._flush_engine_outbox()

    def _flush_engine_outbox(self) -> None:
        """Send queued engine frames until the socket refuses one; retry shortly when it does."""
        self._outbox_timer = None
        while self._engine_outbox:
            future = self._to_engine.send(self._engine_outbox[0], flags=zmq.DONTWAIT)
            exc = future.exception() if future.done() else None
            if isinstance(exc, zmq.Again):
                self._outbox_timer = self._loop.call_later(_OUTBOX_RETRY_S, self._flush_engine_outbox)
                return
            if exc is not None:
                raise exc
            self._engine_outbox.popleft()

    async def _probe_engine(self) -> None:
        """Until an engine core is up, ask for stats now and then: one that answers was running before us."""
        probe = self._encoder.encode(StatsRequest(id=f"{self._prefix}-ready"))
        while True:
            if not self._engine_up:
                future = self._to_engine.send(probe, flags=zmq.DONTWAIT)
                if future.done() and future.exception() is not None and not isinstance(future.exception(), zmq.Again):
                    raise future.exception()
            await asyncio.sleep(self.config.ready_probe_s)

    # ---- server → clients ------------------------------------------------------------

    def _finish(self, req: RequestState, reason: str, text: str, token_ids: list[int], logprobs) -> None:
        """Send a request's final Delta and forget it."""
        final = Delta(
            id=req.client_id,
            text=text,
            token_ids=token_ids,
            finish_reason=reason,
            logprobs=logprobs,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.detok.output_ids) if req.detok is not None else 0,
        )
        self._send_final(req, final)

    def _send_final(self, req: RequestState, msg: Delta | Error) -> None:
        """Forget a request, then send its final message (its client may be forgotten with it)."""
        envelope = self._clients[req.client].envelope
        self._forget(req)
        self._count_finished(req, msg.finish_reason if isinstance(msg, Delta) else "error")
        self._deliver(req, msg, envelope)

    def _deliver(self, req: RequestState, msg: Delta | Error, envelope: tuple[bytes, ...]) -> None:
        """Hand a request's message to its in-process sink, or send it to its ROUTER peer."""
        if req.sink is None:
            self._send(req.client, envelope, msg)
            return
        try:
            req.sink(msg)
        except Exception:  # a failing in-process caller must not stop the other requests
            log.exception("frontend: an in-process sink failed for request %r", req.client_id)

    def _count_finished(self, req: RequestState, reason: str) -> None:
        """Metrics of one finished request."""
        completion = len(req.detok.output_ids) if req.detok is not None else 0
        self.metrics.finished(reason, len(req.prompt_ids), completion, self.clock() - req.arrival)

    def _forget(self, req: RequestState) -> None:
        """Remove a request from every index (its client entry too when it was the last one)."""
        self._by_engine_id.pop(req.engine_id, None)
        state = self._clients.get(req.client)
        if state is not None:
            state.requests.pop(req.client_id, None)
            if not state.requests:
                del self._clients[req.client]

    def _reject(self, client: bytes, envelope: tuple[bytes, ...], request_id: str, code: str, message: str) -> None:
        """Answer a frame with Error; its id is "" when none could be read."""
        log.info("frontend: rejected %r: %s: %s", request_id, code, message)
        self._send(client, envelope, Error(id=request_id, code=code, message=message))

    def _send(self, client: bytes, envelope: tuple[bytes, ...], msg: msgspec.Struct) -> bool:
        """Send one frame without waiting; a client that cannot take it is gone and its requests are aborted."""
        future = self._router.send_multipart([client, *envelope, self._encoder.encode(msg)], flags=zmq.DONTWAIT)
        exc = future.exception() if future.done() else None
        if exc is None:
            return True
        if isinstance(exc, zmq.ZMQError) and exc.errno in (errno.EHOSTUNREACH, errno.EAGAIN):
            self._drop_client(client, "disconnected" if exc.errno == errno.EHOSTUNREACH else "not reading")
            return False
        raise exc

    def _drop_client(self, client: bytes, why: str) -> None:
        """Abort every live request of a client that is gone."""
        state = self._clients.pop(client, None)
        if state is None:
            return
        engine_ids = []
        for req in state.requests.values():
            self._count_finished(req, "abort")
            self._by_engine_id.pop(req.engine_id, None)
            if req.engine_id:
                engine_ids.append(req.engine_id)
        log.info("frontend: client %s %s; aborting %d request(s)", client.hex(), why, len(state.requests))
        self._abort_engine(engine_ids)

    async def _watch_clients(self) -> None:
        """On each disconnect the monitor reports, probe the clients that may have been on that connection."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                fd = int(event["value"])
                for delay in _PROBE_DELAYS_S:
                    self._loop.call_later(delay, self._probe_clients, fd)

    def _probe_clients(self, fd: int) -> None:
        """Send an empty Delta to each client with live requests on connection fd (all when fd is unknown)."""
        for client, state in list(self._clients.items()):
            if not state.local and (state.fd is None or state.fd == fd):
                some_id = next(iter(state.requests))
                self._send(client, state.envelope, Delta(id=some_id))


def _salvage_id(data: memoryview | bytes) -> str:
    """The string id of a frame that failed validation, or "" when there is none to read."""
    try:
        found = msgspec.msgpack.decode(data, type=_IdOnly).id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""
    return found if isinstance(found, str) else ""


def _srcfd(frame: zmq.Frame) -> int | None:
    """The file descriptor of the connection a frame came in on, when libzmq tells."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None


def _engine_error(error: str | None) -> tuple[str, str]:
    """An engine core's error string as (code, message): "<code>: <message>" or a bare message."""
    if not error:
        return "internal", "the engine core failed the request"
    code, sep, rest = error.partition(":")
    if sep and code.strip() in ERROR_CODES:
        return code.strip(), rest.strip() or error
    return "internal", error


def _model_max_len(model_dir: str, tokenizer: Tokenizer) -> int | None:
    """config.json's max_position_embeddings, else tokenizer_config's model_max_length."""
    path = Path(model_dir) / "config.json"
    if path.is_file():
        value = json.loads(path.read_text(encoding="utf-8")).get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return tokenizer.model_max_length


def main(config: FrontendConfig, health_source: HealthSource | None = None) -> None:
    """The frontend process: serve on uvloop until SIGTERM or SIGINT."""
    import uvloop

    server = FrontendServer(config, health_source=health_source)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.shutdown)
        await server.run()

    uvloop.run(serve())

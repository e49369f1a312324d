"""FrontendServer: clients' requests in, tokenized for the engine core; engine tokens in, text streamed out.

One asyncio (uvloop) process. Clients speak docs/protocol.md to a ZMQ ROUTER; the server validates each frame
(frame_checks.py), tokenizes, hands the engine core an AddRequest, detokenizes what comes back (stop strings
included) and streams Delta frames (live_requests.py holds each request through that life). Nothing waits on the
engine: every socket send is non-blocking and every engine answer is matched to its request when it arrives.
The engine core's two sockets, and the contract it keeps on them, are engine_link.py's. Under data parallel
there is one engine core per replica (replicas.py): each request goes to the replica the router picks, and a
replica whose engine core disconnects or loses its worker has its requests moved to the others at once.

Several frontends (--api-server-count N): N of these processes, each with its own ZMQ port and its own links to
every engine core, share the HTTP port (SO_REUSEPORT); what they must agree on is shared through the run folder
(served_state.py: run-time LoRA adapters) or gathered when asked (api_servers.py: /metrics sums every frontend's).

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
import gc
import itertools
import logging
import operator
import os
import resource
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from metrale.frontend_heartbeat import Heartbeat
from metrale.ipc.admin_channel import AdminLink
from metrale.ipc.messages import (
    Abort,
    Admin,
    ClientMessage,
    Delta,
    EngineOutput,
    EngineOutputs,
    EngineReady,
    EngineStats,
    Error,
    FrontendUp,
    Generate,
    Health,
    HealthQuery,
    ModelInfoQuery,
    ModelInfoReply,
    ProcessHealth,
    Resume,
    Stats,
    StatsQuery,
    StatsResponse,
    LoraUpdate,
    LoraUpdated,
    WorkerBack,
    WorkerLost,
)
from metrale.ipc.errors import ErrorCode
from metrale.ipc.frontend_ids import frontend_name
from metrale.config import lora_pairs
from metrale.ipc.beam_params import BeamSearchParams
from metrale.ipc.pooling import PoolingParams
from metrale.ipc.sampling import SamplingParams, logprobs_cap
from metrale.ipc.status_channel import EXIT_CONFIG, FAILED, SERVING, StatusSender
from metrale.model_facts import generation_defaults, resolve_model
from metrale.settings import DEFAULTS

from .admin_access import admin_refusal, peer_address
from .api_key import UNAUTHORIZED_MESSAGE, ApiKey
from .chat import chat_template_source
from .detokenizer import Decoder
from .engine_link import EngineLink
from .replicas import ReplicaSet
from .served_state import StateFile
from .frame_checks import Rejected, read_client_frame, source_fd
from .live_requests import LiveRequests, LocalSink
from .metrics import Metrics
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")

# libzmq's send without pyzmq's wrapper (zmq.Socket.send adds a Python layer and an enum flag per call), for the
# batched sends of one engine message; flags as plain ints.
_raw_send = zmq.backend.Socket.send
_DONTWAIT = int(zmq.DONTWAIT)
_by_client = operator.itemgetter(0)
_MORE = int(zmq.DONTWAIT | zmq.SNDMORE)
_CLOSE_LINGER_MS = 2000  # a shutdown's final frames get this long to reach their clients
_PROBE_DELAYS_S = (0.05, 0.5)  # after a disconnect event: libzmq tears the pipe down just after reporting it
_LOCAL_PREFIX = b"\x00local-"  # ROUTER ids are 5 bytes from libzmq or never start with 0: no collision

HealthSource = Callable[[], Health]


@dataclass(slots=True)
class FrontendConfig:
    """Where the frontend listens and the limits it enforces; a setting's field has the table's default
    (metrale/settings.py)."""

    model_dir: str
    engine_input_address: str  # ipc:// the frontend binds; the engine core connects a PULL
    engine_output_address: str  # ipc:// the frontend binds; the engine core connects a PUSH
    # Data parallel: [input, output] addresses of the engine cores of replicas 1 .. N-1 (replica 0's are above).
    replica_addresses: list[list[str]] = field(default_factory=list)
    client_address: str = "tcp://127.0.0.1:7410"  # a port of * binds any free port (see client_endpoint)
    max_model_len: int | None = DEFAULTS.max_model_len  # until EngineReady says; None: the model's (model_facts)
    max_frame_bytes: int = DEFAULTS.max_frame_bytes  # larger frames get Error "too_long"
    hard_frame_bytes: int = 64 << 20  # larger frames make libzmq drop the connection
    max_id_chars: int = 256
    client_send_hwm: int = 100_000  # frames queued to one client before it counts as gone
    heartbeat_s: float = 5.0  # ZMTP PINGs; a peer silent for 3 intervals is disconnected (0 disables)
    engine_reply_timeout_s: float = 10.0  # StatsQuery answered with Error "internal" after this
    ready_probe_s: float = 0.25  # a restarted frontend adopts the running engine core this soon
    http_host: str = DEFAULTS.host
    http_port: int | None = DEFAULTS.http_port  # serve the OpenAI-compatible HTTP API here too (0: any free port)
    # --served-model-name: the names /v1/models lists and requests must give (the first is the one replies
    # carry); none: the model folder's name (its path is accepted too).
    served_model_names: list[str] = field(default_factory=list)
    # --lora-modules: NAME=PATH of each adapter the engine serves; a request names one as its model.
    lora_modules: list[str] = field(default_factory=list)
    # --allow-runtime-lora-updating: POST /v1/load_lora_adapter and /v1/unload_lora_adapter are served
    allow_runtime_lora_updating: bool = DEFAULTS.allow_runtime_lora_updating
    # --chat-template: a file, or inline Jinja; None: the model's own
    chat_template: str | None = DEFAULTS.chat_template
    generation_config: str = DEFAULTS.generation_config  # HTTP requests' sampling defaults (generation_defaults)
    log_requests: bool = not DEFAULTS.disable_log_requests  # an access-log line per HTTP request
    enable_force_include_usage: bool = DEFAULTS.enable_force_include_usage  # every HTTP stream ends with its usage
    enable_per_request_metrics: bool = DEFAULTS.enable_per_request_metrics  # vLLM's "metrics" in HTTP answers
    return_tokens_as_token_ids: bool = DEFAULTS.return_tokens_as_token_ids  # HTTP logprobs name tokens by id
    max_logprobs: int = DEFAULTS.max_logprobs  # the most alternatives a token's logprobs list (-1: the vocabulary)
    stream_interval: int = DEFAULTS.stream_interval  # a request's tokens go out every this many (first, last at once)
    status_address: str | None = None  # the supervisor's status inbox (ipc/status_channel.py)
    state_path: str | None = None  # the supervisor's file for what every frontend must know (served_state.py)
    # --api-server-count: how many frontends serve together, and which this one is (its engine ids name it;
    # frontend i's ZMQ port is --port + i). With several, each serves its own counters on a private socket
    # (api_server_sockets[i], in the supervisor's run folder) for the one a scrape of /metrics reaches.
    api_server_count: int = DEFAULTS.api_server_count
    api_server_index: int = 0
    api_server_sockets: list[str] = field(default_factory=list)
    shutdown_timeout_s: float = DEFAULTS.shutdown_timeout_s  # on SIGTERM, live requests get this long to finish
    stall_s: float = 30.0  # /health is unhealthy when requests are live and the engine was silent this long
    grammar_timeout_s: float = DEFAULTS.grammar_timeout_s  # grammars that take longer to compile are refused
    tool_call_parser: str = DEFAULTS.tool_call_parser  # the chat route's tool-call format (frontend/tool_parsers.py)
    # --api-key: every request but health must carry it (frontend/api_key.py). The supervisor hands it over in
    # the environment (METRALE_API_KEY), never on a command line that `ps` shows.
    api_key: str | None = DEFAULTS.api_key
    admin_address: str | None = None  # the supervisor's admin inbox (ipc/admin_channel.py); None: admin is off
    admin_allow_remote: bool = DEFAULTS.admin_allow_remote  # take admin requests from non-loopback peers too
    admin_timeout_s: float = 5.0
    # HTTP clients that hold a connection without sending: a body must arrive whole within http_body_timeout_s
    # (else 408), and a connection with no request in flight is closed after http_idle_timeout_s.
    http_body_timeout_s: float = 30.0
    http_idle_timeout_s: float = 75.0


class BindError(OSError):
    """An address the frontend must listen on is taken; the message names the port."""


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
        if config.chat_template is not None:  # every chat, and model_info, sees the operator's template
            self.tokenizer.chat_template = chat_template_source(config.chat_template)
        self.health_source = health_source
        self.clock = clock
        self.client_endpoint: str | None = None  # the bound client address, once `bound` is set
        self.bound = threading.Event()
        self.engine_ready = threading.Event()  # set once an engine core is up (for callers and tests)
        self.http_endpoint: str | None = None  # "http://host:port" once the HTTP API listens
        self.metrics = Metrics(clock, config.api_server_index)
        self.replicas = ReplicaSet(1 + len(config.replica_addresses), config.api_server_index)
        self.facts = resolve_model(config.model_dir, config.max_model_len)
        self.model_names = list(config.served_model_names) or [self.facts.name]
        self.sampling_defaults = generation_defaults(config.model_dir, config.generation_config)
        if self.sampling_defaults:
            log.info("frontend: HTTP requests' sampling defaults from %s: %s (--generation-config vllm: none)",
                     "the model's generation_config.json" if config.generation_config == "auto"
                     else config.generation_config, self.sampling_defaults)
        max_model_len = self.facts.max_model_len
        # The LoRA adapters served, by name (their folders): --lora-modules', then those loaded or unloaded at run
        # time (update_lora, or another frontend's). An engine core that starts later loads the run-time ones too
        # (_engine_came_up).
        self.adapters: dict[str, str] = dict(lora_pairs(config.lora_modules))
        self.state = StateFile(config.state_path)
        earlier = self.state.load()  # what the frontends before this one (or beside it) changed
        if earlier is not None:
            self.adapters.clear()
            self.adapters.update(earlier.adapters)
        self.requests = LiveRequests(self.tokenizer, self.replicas, self.metrics, clock, self._send,
                                     self.tokenizer.vocab_size, max_model_len, config.stream_interval,
                                     config.grammar_timeout_s, self.facts.pooling, self.facts.hidden_size,
                                     config.max_logprobs)
        self._started = clock()
        self._local_keys = itertools.count()
        self._client_decoder = msgspec.msgpack.Decoder(ClientMessage)
        self._engine_decoder = msgspec.msgpack.Decoder(EngineOutput)
        self._encoder = msgspec.msgpack.Encoder()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = False
        self._router: zmq.asyncio.Socket | None = None
        self._router_sync: zmq.Socket | None = None  # the same socket without futures, for batched sends
        self._monitor: zmq.asyncio.Socket | None = None
        # (client, envelope, payload) queued while one engine message is handled
        self._batch: list[tuple[bytes, tuple[bytes, ...], bytes]] | None = None
        self._status = StatusSender(config.status_address, self.name) if config.status_address else None
        self._draining = False  # shutting down: new requests are refused, live ones get shutdown_timeout_s
        self._live_at_shutdown = 0
        self._engine_heard_at = clock()  # the engine core's last message (its heartbeat while it works)
        self._rejections_logged: set[str] = set()  # codes whose rejections were logged at INFO once
        self.api_key = ApiKey(config.api_key)
        self._admin: AdminLink | None = None  # to the supervisor, with --enable-admin

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
                try:
                    self.http_endpoint = await http.start(self.config.http_host, self.config.http_port)
                except OSError as exc:
                    raise BindError(exc.errno, f"HTTP port {self.config.http_port} on {self.config.http_host} "
                                               f"cannot be bound ({os.strerror(exc.errno) if exc.errno else exc}); choose another with --http-port") from None
            self.bound.set()
            self._report_serving()
            tasks = [
                asyncio.create_task(self._serve_clients(), name="frontend-clients"),
                asyncio.create_task(self._watch_clients(), name="frontend-monitor"),
            ]
            for link in self.replicas.links:
                tasks += [
                    asyncio.create_task(self._serve_engine(link), name=f"frontend-engine-{link.index}"),
                    asyncio.create_task(self._watch_engine(link), name=f"frontend-engine-monitor-{link.index}"),
                    asyncio.create_task(link.probe(self.config.ready_probe_s), name=f"frontend-ready-probe-{link.index}"),
                ]
            stop = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop and task.exception() is not None:
                    raise task.exception()
        finally:
            tasks += [*self.requests.background, *([stop] if stop is not None else [])]
            for task in tasks:
                task.cancel()
            self.replicas.cancel_retry()
            await asyncio.gather(*tasks, return_exceptions=True)
            if http is not None:
                await http.stop()
            self._close_sockets()
            ctx.term()
            self.bound.set()  # a waiter must not hang when binding failed

    def shutdown(self) -> None:
        """Ask run() to return; safe from any thread and before run() starts."""
        self._stop_requested = True
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # run() ended and its loop closed meanwhile: nothing left to stop
                pass

    def begin_shutdown(self) -> None:
        """SIGTERM: refuse new requests, give live ones shutdown_timeout_s to finish, end the rest with Error
        "shutdown" (every live request gets a final message), then stop. A second call stops at once."""
        if self._draining or self._loop is None:
            self.shutdown()
            return
        self._draining = True
        self.requests.refusing = (ErrorCode.SHUTDOWN, "the server is shutting down")
        self._live_at_shutdown = self.requests.num_live
        log.info("frontend: shutting down; %d live requests get %.1f s to finish", self.requests.num_live,
                 self.config.shutdown_timeout_s)
        task = self._loop.create_task(self._drain_then_stop(), name="frontend-drain")
        self.requests.background.add(task)

    async def _drain_then_stop(self) -> None:
        """Wait (up to shutdown_timeout_s) for live requests to end; end those left with Error "shutdown"."""
        try:
            await asyncio.wait_for(self.requests.idle.wait(), self.config.shutdown_timeout_s)
        except asyncio.TimeoutError:
            pass
        left = self.requests.num_live
        log.info("frontend: shut down: of %d requests live at the signal, %d finished within the %.1f s drain, %d "
                 "were ended with Error shutdown", self._live_at_shutdown, max(0, self._live_at_shutdown - left),
                 self.config.shutdown_timeout_s, left)
        self.requests.end_all(ErrorCode.SHUTDOWN, "the server is shutting down; the request was stopped")
        await asyncio.sleep(0)  # let in-process sinks (HTTP streams) take their final messages
        self.shutdown()

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
        try:
            router.bind(cfg.client_address)
        except zmq.ZMQError as exc:
            port = cfg.client_address.rsplit(":", 1)[-1]
            raise BindError(exc.errno, f"port {port} ({cfg.client_address}, the ZMQ client address) cannot be bound "
                                       f"({os.strerror(exc.errno)}); choose another with --port") from None
        self._router_sync = zmq.Socket.shadow(router.underlying)  # not closed itself: closing router closes it
        self.client_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replicas.open(ctx, [(cfg.engine_input_address, cfg.engine_output_address),
                                 *((a, b) for a, b in cfg.replica_addresses)])
        if cfg.admin_address is not None:
            self._admin = AdminLink(ctx, cfg.admin_address)
        log.info("frontend listening on %s; engine core at %s / %s", self.client_endpoint,
                 cfg.engine_input_address, cfg.engine_output_address)

    def _close_sockets(self) -> None:
        """Close every socket without lingering (unsent frames are for peers that are going away too)."""
        if self._router is not None and self._monitor is not None:
            try:
                self._router.disable_monitor()
            except zmq.ZMQError:
                pass
        for sock in (self._monitor, self._router):
            if sock is not None:
                # Final messages (a shutdown's errors) may still be queued: give them a moment to go out.
                sock.close(linger=_CLOSE_LINGER_MS if self._draining else 0)
        self._router_sync = None
        self.replicas.close()
        self.requests.close()  # the grammar compiler's helper process
        if self._admin is not None:
            self._admin.close()

    # ---- clients → server ------------------------------------------------------------

    async def _serve_clients(self) -> None:
        """Receive client frames forever; one bad frame never stops the loop."""

        def handle(frames: list[zmq.Frame]) -> None:
            try:
                self._on_client_frames(frames)
            except Exception:  # a bug handling one frame must not take the server down
                log.exception("frontend: failed to handle a client frame")

        await serve_frames(lambda: self._router.recv_multipart(copy=False), handle)

    def _on_client_frames(self, frames: list[zmq.Frame]) -> None:
        """Decode one client message and act on it, or answer Error."""
        if len(frames) < 2:
            return
        client = frames[0].bytes
        envelope = tuple(f.bytes for f in frames[1:-1])  # empty for a DEALER; kept for REQ-style peers
        payload = frames[-1]
        cfg = self.config
        try:
            msg = read_client_frame(self._client_decoder, payload.buffer, cfg.max_frame_bytes, cfg.max_id_chars)
        except Rejected as exc:
            self._reject(client, envelope, exc.request_id, exc.code.value, exc.message)
            return
        if not isinstance(msg, HealthQuery) and not self.api_key.allows(msg.api_key):
            self._reject(client, envelope, msg.id, ErrorCode.UNAUTHORIZED.value, UNAUTHORIZED_MESSAGE)
            return
        if isinstance(msg, Generate):
            self._on_generate(client, envelope, source_fd(payload), msg)
        elif isinstance(msg, Abort):
            self._on_abort(client, envelope, msg)
        elif isinstance(msg, StatsQuery):
            self._on_stats_query(client, envelope, msg)
        elif isinstance(msg, HealthQuery):
            self._send(client, envelope, self._health(msg.id))
        elif isinstance(msg, ModelInfoQuery):
            self._send(client, envelope, self._model_info(msg.id))
        elif isinstance(msg, Admin):
            self._on_admin(client, envelope, msg, peer_address(payload))

    def _on_admin(self, client: bytes, envelope: tuple[bytes, ...], msg: Admin, peer: str | None) -> None:
        """Worker control: refused (admin_disabled) unless admin is on and the peer may use it, else forwarded to
        the supervisor, which owns the worker; its answer goes back to the client."""
        cfg = self.config
        refused = admin_refusal(self._admin is not None, cfg.admin_allow_remote, peer, cfg.client_address)
        if refused is not None:
            self._reject(client, envelope, msg.id, ErrorCode.ADMIN_DISABLED.value, refused)
            return
        log.warning("frontend: admin request from %s: %s worker rank %d replica %d%s", peer or "a local peer",
                    msg.action, msg.rank, msg.replica, f" with SIG{msg.signal}" if msg.action == "kill" else "")

        async def forward() -> None:
            answer = await self._admin.ask(msgspec.structs.replace(msg, api_key=None), cfg.admin_timeout_s)
            self._send(client, envelope, answer)

        task = self._loop.create_task(forward(), name="frontend-admin")
        self.requests.background.add(task)
        task.add_done_callback(self.requests.background.discard)

    def _on_generate(self, client: bytes, envelope: tuple[bytes, ...], fd: int | None, msg: Generate) -> None:
        """Validate and register a request (a Resume too); tokenize it (off the loop when long) and admit it."""
        if isinstance(msg, Resume) and self.requests.find(client, msg.id) is not None:
            return  # its Generate reached this frontend after all: it streams from the start on this connection
        try:
            req = self.requests.register(client, envelope, fd, msg)
        except Rejected as exc:
            self._reject(client, envelope, msg.id, exc.code.value, exc.message)
            return
        self.requests.tokenize_then_admit(req, msg)

    def _on_abort(self, client: bytes, envelope: tuple[bytes, ...], msg: Abort) -> None:
        """End a live request with finish_reason "abort"; an id that is not live gets Error unknown_id."""
        req = self.requests.find(client, msg.id)
        if req is None:
            self._reject(client, envelope, msg.id, "unknown_id", f"no running request with id {msg.id!r}")
            return
        self.requests.abort(req)

    def _on_stats_query(self, client: bytes, envelope: tuple[bytes, ...], msg: StatsQuery) -> None:
        """Ask the engine core for its counters; the answer (or Error "internal" in time) goes to the client."""
        if not self.replicas.any_up:
            self._reject(client, envelope, msg.id, "busy", "the engine core is not ready")
            return
        self.replicas.ask_stats(
            lambda stats: self._send(client, envelope, Stats(id=msg.id, stats=stats,
                                                             frontend=self.metrics.window.snapshot())),
            lambda why: self._reject(client, envelope, msg.id, "internal", why),
            self.config.engine_reply_timeout_s,
        )

    def _model_info(self, request_id: str) -> ModelInfoReply:
        """What model is served (from the model facts and the tokenizer: no engine core needed)."""
        facts, tok = self.facts, self.tokenizer
        return ModelInfoReply(id=request_id, model=self.model_names[0], architecture=facts.architecture,
                              vocab_size=self.requests.vocab_size, max_model_len=self.requests.max_model_len or facts.max_model_len,
                              eos_token_ids=list(facts.eos_token_ids), bos_token_id=tok.bos_token_id,
                              chat_template=tok.chat_template)

    def _health(self, request_id: str) -> Health:
        """Health from the supervisor's source when there is one, else what this process knows; healthy only
        when the engine can serve and is making progress."""
        health = None
        if self.health_source is not None:
            try:
                health = msgspec.structs.replace(self.health_source(), id=request_id)
            except Exception as exc:  # a broken source must not leave the client without an answer
                log.exception("frontend: the health source failed")
                health = Health(id=request_id, healthy=False, last_fault=f"health source failed: {exc}")
        if health is None:
            uptime = self.clock() - self._started
            me = ProcessHealth(name=self.name, pid=os.getpid(), uptime_s=uptime, restarts=0, alive=True)
            health = Health(id=request_id, healthy=True, processes=[me])
        health.ready = self.replicas.any_up and not self._draining
        health.replicas_ready = [link.up and not self.replicas.paused[link.index] for link in self.replicas.links]
        stalled = self.clock() - self._engine_heard_at if self.requests.num_submitted else 0.0
        health.progress_s = stalled
        if self._draining:
            health.waiting_for = "nothing: the server is shutting down"
        elif not self.replicas.any_up:
            health.waiting_for = "the engine core: it is starting (loading the model) or restarting"
        elif stalled > self.config.stall_s:
            health.waiting_for = (f"progress: the engine core completed no step for {stalled:.0f} s with "
                                  f"{self.requests.num_submitted} requests live")
        health.healthy = health.healthy and health.waiting_for is None
        return health

    # ---- in-process clients (the HTTP API) -------------------------------------------

    @property
    def name(self) -> str:
        """"frontend", or "frontend I" for frontend I > 0 of --api-server-count (as the supervisor names them)."""
        return frontend_name(self.config.api_server_index)

    @property
    def vocab_size(self) -> int:
        """The engine core's vocabulary size (the tokenizer's until an engine core says)."""
        return self.requests.vocab_size

    @property
    def max_logprobs(self) -> int:
        """The most alternatives a token's logprobs may list: --max-logprobs (-1: the vocabulary)."""
        return logprobs_cap(self.config.max_logprobs, self.vocab_size)

    @property
    def max_model_len(self) -> int | None:
        """Longest sequence (prompt + output) the engine core takes."""
        return self.requests.max_model_len

    def open_local(self) -> bytes:
        """A fresh key under which one in-process caller (an HTTP request) files its requests."""
        return _LOCAL_PREFIX + str(next(self._local_keys)).encode()

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
        cache_salt: str | None = None,
        strict_length: bool = False,
        pooling: PoolingParams | None = None,
        lora: str | None = None,
        resume_key: str | None = None,
        resume_offset: int | None = None,
        beam: BeamSearchParams | None = None,
    ) -> None:
        """Start a request exactly as a Generate frame would (pooling: an embeddings request; lora: its adapter); its
        Deltas (or its one Error) go to sink. resume_key: the engine core holds it under this key; with resume_offset,
        it re-attaches to the request held there (a retry after a frontend restart), skipping the first
        resume_offset output tokens.

        sink is called on the event loop; the last message is a Delta with a finish_reason or an Error. A decoder
        replaces the tokenizer for detokenizing (e.g. one that keeps reasoning tags in the text).
        """
        msg = Generate(id=request_id, prompt=prompt, token_ids=token_ids, sampling=params, cache_salt=cache_salt,
                       pooling=pooling, lora=lora, beam=beam)
        try:
            req = self.requests.register(key, (), None, msg, local=True)
        except Rejected as exc:
            sink(Error(id=request_id, code=exc.code.value, message=exc.message))
            return
        req.sink, req.decoder, req.strict_length = sink, decoder, strict_length
        req.resume_key = resume_key
        if resume_key is not None and resume_offset is not None:
            self.requests.resume_from(req, resume_offset)
        self.requests.tokenize_then_admit(req, msg, add_special_tokens)

    def abort_local(self, key: bytes) -> None:
        """Abort every live request filed under key (its caller went away); its sinks hear nothing more."""
        self.requests.drop_client(key, "closed")

    async def engine_stats(self, timeout_s: float | None = None) -> EngineStats:
        """The engine core's counters; Rejected("busy") before one is up, TimeoutError when it does not answer."""
        if not self.replicas.any_up:
            raise Rejected("busy", "the engine core is not ready")
        future = self._loop.create_future()

        def answer(stats: EngineStats) -> None:
            """The counters came: the caller gets them (unless it stopped waiting)."""
            if not future.done():
                future.set_result(stats)

        def fail(why: str) -> None:
            """No answer in time: the caller gets TimeoutError."""
            if not future.done():
                future.set_exception(TimeoutError(why))

        wait_s = self.config.engine_reply_timeout_s if timeout_s is None else timeout_s
        asked = self.replicas.ask_stats(answer, fail, wait_s)
        try:
            return await future
        finally:  # the caller may have been cancelled
            self.replicas.forget_stats(asked)

    async def update_lora(self, name: str, path: str, timeout_s: float = 120.0) -> None:
        """Load (path) or unload ("") a LoRA adapter on every engine core that is up; RuntimeError with the first
        refusal (an adapter loaded on some replicas stays there), Rejected("busy") before one is up. The served
        adapters (self.adapters) follow; one loaded so is loaded again into every engine core that starts later."""
        links = [link for link in self.replicas.links if link.up]
        if not links:
            raise Rejected("busy", "the engine core is not ready")
        futures, asked = [], []
        for link in links:
            future = self._loop.create_future()

            def settle(error: str | None, future=future) -> None:
                """Its engine core's answer (None: done) or why none came: the first one counts."""
                if not future.done():
                    future.set_result(error)

            asked.append((link, link.ask_lora(name, path, settle, settle, timeout_s)))
            futures.append(future)
        try:
            errors = [e for e in await asyncio.gather(*futures) if e is not None]
        finally:
            for link, internal in asked:
                link.forget_stats(internal)
        if errors:
            raise RuntimeError(errors[0])
        self._serve_adapters(self.state.update(dict(lora_pairs(self.config.lora_modules)), name, path))

    def refresh_adapters(self) -> None:
        """Serve what another frontend loaded or unloaded since this one last looked (--api-server-count > 1)."""
        if self.config.api_server_count > 1:
            changed = self.state.if_changed()
            if changed is not None:
                self._serve_adapters(changed.adapters)

    def _serve_adapters(self, adapters: dict[str, str]) -> None:
        """Serve these adapters (in place: the HTTP API holds the same dict)."""
        if adapters != self.adapters:
            self.adapters.clear()
            self.adapters.update(adapters)

    def health(self) -> Health:
        """Each process's health, as a HealthQuery is answered."""
        return self._health("")

    # ---- engine core → server --------------------------------------------------------

    async def _serve_engine(self, link: EngineLink) -> None:
        """Receive one replica's engine-core frames forever."""

        def handle(data: bytes) -> None:
            self._engine_heard_at = self.clock()
            # An engine message of N rows holds thousands of objects at once (its rows, their lists, the Deltas):
            # with the collector on, CPython would run it several times a message and walk every live request's
            # state each time. Off while the message is handled, its objects are freed by reference counting
            # before the collector next runs.
            collecting = gc.isenabled()
            gc.disable()
            try:
                self._on_engine_message(link, self._engine_decoder.decode(data))
            except msgspec.DecodeError:
                log.exception("frontend: undecodable frame from the engine core")
            except Exception:
                log.exception("frontend: failed to handle an engine-core frame")
            finally:
                if collecting:
                    gc.enable()

        await serve_frames(link.recv, handle)

    def _on_engine_message(self, link: EngineLink, msg: EngineOutput) -> None:
        """Dispatch one engine-core message (from replica link.index)."""
        if isinstance(msg, EngineOutputs):
            aborts: list[str] = []
            self._batch = []
            try:
                self.requests.on_outputs(msg.outputs, aborts, link)
            finally:
                batch, self._batch = self._batch, None
                self._send_batch(batch)
            link.abort(aborts)
            if msg.load is not None:
                self.replicas.note_load(link.index, msg.load)
        elif isinstance(msg, LoraUpdated):
            link.answer_lora(msg)
        elif isinstance(msg, StatsResponse):
            if link.answer_stats(msg) and not link.up:
                log.info("frontend: adopting a running engine core of replica %d (it answered the readiness probe)",
                         link.index)
                self._engine_came_up(link)
        elif isinstance(msg, EngineReady):
            log.info("frontend: engine core%s ready (vocab %d, max_model_len %d)", _of(link), msg.vocab_size,
                     msg.max_model_len)
            self.requests.vocab_size = msg.vocab_size
            self.requests.max_model_len = msg.max_model_len
            self.replicas.router.block_size = msg.block_size
            self._engine_came_up(link)
        elif isinstance(msg, WorkerLost):
            self.replicas.set_paused(link.index, True)
            self.requests.move_off(link.index)
        elif isinstance(msg, WorkerBack):
            self.replicas.set_paused(link.index, False)
            self.requests.resubmit_waiting()

    async def _watch_engine(self, link: EngineLink) -> None:
        """When a replica's engine core disconnects (it died), take it out of routing and move its requests."""
        while True:
            await link.disconnected()
            if link.up:
                log.warning("frontend: the engine core%s disconnected", _of(link))
                self.replicas.set_up(link.index, False)
                self.requests.move_off(link.index)

    def _engine_came_up(self, link: EngineLink) -> None:
        """A fresh engine core: submit its live requests again under new engine ids (aborting the ids they had),
        and whatever waited for an engine core."""
        self.replicas.set_up(link.index, True)
        self._engine_heard_at = self.clock()
        self._rejections_logged.clear()
        self.engine_ready.set()
        link.send(FrontendUp(prefix=link.prefix))  # the requests of a frontend before this one are ours to re-attach
        self.refresh_adapters()
        at_start = dict(lora_pairs(self.config.lora_modules))  # what every engine core loads by itself
        for name, path in self.adapters.items():  # before the requests that may name them
            if at_start.get(name) != path:
                link.send(LoraUpdate(id=f"{link.prefix}-reload-{name}", name=name, path=path))
        for name in at_start.keys() - self.adapters.keys():  # unloaded at run time
            link.send(LoraUpdate(id=f"{link.prefix}-unload-{name}", name=name, path=""))
        self.requests.resubmit(link.index)
        self._report_serving()

    def _report_serving(self) -> None:
        """Tell the supervisor (once bound and with an engine up) that requests can be served."""
        if self._status is not None and self.replicas.all_up and self.bound.is_set():
            self._status.send(SERVING, client_endpoint=self.client_endpoint or "", http_endpoint=self.http_endpoint or "")

    # ---- server → clients ------------------------------------------------------------

    def _reject(self, client: bytes, envelope: tuple[bytes, ...], request_id: str, code: str, message: str) -> None:
        """Answer a frame with Error; its id is "" when none could be read. The first rejection of each code
        (since the engine came up) is logged at INFO, the rest at DEBUG: a client probing a starting server, or
        a fuzzer, must not flood the log."""
        if code in self._rejections_logged:
            log.debug("frontend: rejected %r: %s: %s", request_id, code, message)
        else:
            self._rejections_logged.add(code)
            log.info("frontend: rejected %r: %s: %s (further %s rejections are logged at debug level)", request_id,
                     code, message, code)
        self._send(client, envelope, Error(id=request_id, code=code, message=message))

    def _send(self, client: bytes, envelope: tuple[bytes, ...], msg: msgspec.Struct) -> None:
        """Send one frame without waiting (queued while an engine message is handled); a client that
        cannot take it is gone and its requests are aborted."""
        frames = (client, envelope, self._encoder.encode(msg))
        if self._batch is not None:
            self._batch.append(frames)
        else:
            self._send_batch([frames])

    def _send_batch(self, batch: list[tuple[bytes, tuple[bytes, ...], bytes]]) -> None:
        """Send (client, envelope, payload) messages in order: all but the last straight through libzmq (pyzmq's
        send_multipart, and zmq.asyncio's future and event check, cost several times the send itself), the last
        through zmq.asyncio, which then re-checks the socket's edge-triggered events for the receive waiting on it.
        A client whose send fails is dropped once; its later messages in the batch are not sent."""
        # Each client's messages back to back (in their order): libzmq wakes its I/O thread once for a run of
        # messages to one peer instead of once for each message when the clients' messages interleave.
        batch.sort(key=_by_client)
        send, sock, failed = _raw_send, self._router_sync, None
        for client, envelope, payload in batch[:-1]:
            if failed is not None and client in failed:
                continue
            try:
                send(sock, client, _MORE)
                for part in envelope:
                    send(sock, part, _MORE)
                send(sock, payload, _DONTWAIT)
            except zmq.ZMQError as e:
                failed = failed or set()
                failed.add(client)
                self._send_failed(client, e)
        if batch:
            client, envelope, payload = batch[-1]
            if failed is not None and client in failed:
                return
            future = self._router.send_multipart([client, *envelope, payload], flags=zmq.DONTWAIT)
            exc = future.exception() if future.done() else None
            if exc is not None:
                self._send_failed(client, exc)

    def _send_failed(self, client: bytes, exc: BaseException) -> None:
        """A send the client could not take: it is gone, or not reading, or the send broke; either way its
        requests are aborted (never left waiting for frames that will not come) and the others go on."""
        if isinstance(exc, zmq.ZMQError) and exc.errno in (errno.EHOSTUNREACH, errno.EAGAIN):
            why = "disconnected" if exc.errno == errno.EHOSTUNREACH else "not reading"
        else:
            log.error("frontend: sending to client %s failed: %r", client.hex(), exc)
            why = f"could not be sent to ({exc!r})"
        self.requests.drop_client(client, why)

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
        for client, state in list(self.requests.clients.items()):
            if not state.local and (state.fd is None or state.fd == fd):
                some_id = next(iter(state.requests))
                self._send(client, state.envelope, Delta(id=some_id))


def _of(link: EngineLink) -> str:
    """" of replica K" for logs about replicas past the first."""
    return f" of replica {link.index}" if link.index else ""


def _raise_open_files_limit() -> None:
    """Lift the soft limit on open files to the hard one: every HTTP connection and ZMQ peer holds a descriptor,
    and a soft limit of 1024 (a common default) would refuse clients long before the machine is out of them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("frontend: open files stay limited to %d (raising it to %d failed: %s)", soft, target, exc)


# Frames a receive loop handles between two turns of the event loop. A zmq.asyncio recv of a frame already queued
# returns without yielding, so under a steady flow (a thousand streams' client frames, engine outputs every few ms on a
# starved core) one receive loop would hold the event loop — its timers, HTTP, the other loops and the heartbeat the
# supervisor's hang watch reads — for as long as frames keep coming (a 10 s stall killed a busy frontend as hung).
FRAMES_PER_TURN = 32


async def serve_frames(recv: Callable[[], Awaitable[T]], handle: Callable[[T], None],
                       per_turn: int = FRAMES_PER_TURN) -> None:
    """handle(frame) for every frame recv() gives, forever, letting the event loop turn every per_turn frames."""
    handled = 0
    while True:
        handle(await recv())
        handled += 1
        if handled == per_turn:
            handled = 0
            await asyncio.sleep(0)


def main(config: FrontendConfig, health_source: HealthSource | None = None, heartbeat: Heartbeat | None = None) -> None:
    """The frontend process: serve on uvloop until SIGTERM or SIGINT; its event loop beats `heartbeat` (the
    supervisor's hang watch, metrale/frontend_heartbeat.py) once it serves."""
    import uvloop

    _raise_open_files_limit()
    server = FrontendServer(config, health_source=health_source)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.begin_shutdown)
        if heartbeat is not None:
            heartbeat.start(loop, serving=server.bound.is_set)
        await server.run()

    try:
        uvloop.run(serve())
    except BindError as exc:
        log.error("frontend: %s", exc.strerror)
        if server._status is not None:
            server._status.send(FAILED, exc.strerror)
            server._status.close()
        raise SystemExit(EXIT_CONFIG) from None

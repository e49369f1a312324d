"""The supervisor behind `metrale serve`: starts frontend, engine core and GPU worker, watches, restarts, cleans up.

Each child is `python -m <module>` with its configuration as JSON on the command line (no pickle) and its
own session, so a terminal's Ctrl-C reaches only the supervisor, which then shuts down in order:
frontend (stop taking requests), engine core (which tells its worker to exit), worker; then every
shared-memory segment an engine core owned is swept and the run directory removed.

Restarts. A dead worker is restarted on the same ring (the engine core requeues what it was running); a dead
engine core is restarted with a fresh worker (its ring is swept; the frontend resubmits every live request);
a dead frontend is restarted on the same addresses (with --api-server-count N, each of the N frontends is a child
of its own: one that dies is restarted alone while the others serve on); a frontend alive but hung, whose event loop
has not beaten for --frontend-hang-timeout (metrale/frontend_heartbeat.py), is killed and restarted the same way. A
child that dies "in a row" — without having done any work since its start (for the worker: served no step), and
within RestartPolicy.window_s of it — waits
longer before each restart; after RestartPolicy.max_in_a_row such deaths it is not restarted again, and the
server ends (`watch` returns, `given_up` says why) with a non-zero exit, so a service manager sees the failure
instead of a supervisor running on without a child. A child that exits with EXIT_CONFIG (a port in use) is
given up on at once: restarting it would fail the same way.

Start-up is an event: the children report on a status channel in the run folder (ipc/status_channel.py),
each frontend once it is bound and every engine core is up, a child that cannot run with why. So `start()` waits
on that channel for every frontend (never probing the client port, where another server might answer) and fails
with one line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from metrale.children import Child, RestartPolicy, WorkerGroup
from metrale.config import EngineArgs, ServeConfig
from metrale.frontend_heartbeat import HEARTBEAT_ENV, FrontendHangWatch
from metrale.frontend_process import API_KEY_ENV as FRONTEND_API_KEY_ENV
from metrale.health_file import HealthFile, read_health
from metrale.ipc.admin_channel import AdminInbox
from metrale.ipc.frontend_ids import frontend_name
from metrale.ipc.messages import Health, ProcessHealth
from metrale.node_layout import layout, node_of_replica, replica_addresses, worker_argvs
from metrale.ipc.status_channel import EXIT_CONFIG, FAILED, SERVING, WORKER_HUNG, ChildStatus, StatusInbox
from metrale.worker_control import WorkerControl

log = logging.getLogger("metrale.supervisor")

WATCH_INTERVAL_S = 0.05
# Where `metrale serve --api-key` also looks, as vLLM does; the first is how the frontend child is handed it.
API_KEY_ENV = (FRONTEND_API_KEY_ENV, "VLLM_API_KEY")
NEVER = float("inf")


class StartupError(RuntimeError):
    """`metrale serve` cannot start; the message is one line naming the thing and what to do."""


def free_port(host: str) -> int:
    """A port the OS considers free right now (for --port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class Replica:
    """One engine core and its worker group (a data-parallel replica), with the addresses it talks on."""

    index: int
    engine: Child
    workers: WorkerGroup
    input_address: str  # the frontend's PUSH to this engine core
    output_address: str  # this engine core's PUSH to the frontend
    served_path: Path  # the engine core writes here the pid of each rank 0 once it has served a step
    ring_name: str = ""  # the current engine core's ticket ring (its worker ranks serve it)
    engine_pids: set[int] = field(default_factory=set)  # every engine core it ran (their segments are swept)
    hung: str | None = None  # why the engine core killed its workers, until their death is noted


class Supervisor:
    """Owns the processes of one `metrale serve`: the frontend, and per replica an engine core and its workers."""

    def __init__(
        self, config: ServeConfig, policy: RestartPolicy | None = None, clock: Callable[[], float] = time.monotonic
    ):
        # Only what the checks below need: every module imported here delays the children's start (metrale.llm's
        # engine and the chat module's Jinja are the worker's and the frontend's).
        from metrale.engine_core.pipeline import special_tokens_of
        from metrale.frontend.tokenizer import Tokenizer
        from metrale.model_facts import ModelError, generation_defaults, resolve_model, resolve_model_dir

        self.config = config
        self.policy = policy or RestartPolicy()
        self.clock = clock
        self.model_dir = resolve_model_dir(config.engine.model)
        try:
            self.facts = resolve_model(self.model_dir, config.engine.max_model_len)
            tokenizer = Tokenizer.from_dir(self.model_dir)
        except ModelError as e:
            raise StartupError(str(e)) from None
        except (OSError, ValueError) as e:
            raise StartupError(f"--model {self.model_dir}: its tokenizer cannot be loaded ({e})") from None
        self.chat_template = None
        try:  # the operator's template and generation config fail here, with one line, not per request
            if config.chat_template:
                from metrale.frontend.chat import chat_template_source

                self.chat_template = chat_template_source(config.chat_template)
            generation_defaults(self.model_dir, config.generation_config)
        except ValueError as e:  # ChatTemplateError, ModelError
            raise StartupError(str(e)) from None
        self.special_tokens = dataclasses.asdict(special_tokens_of(tokenizer))
        self.max_model_len = self.facts.max_model_len
        if config.api_server_count < 1:
            raise StartupError(f"--api-server-count {config.api_server_count}: there must be at least one frontend")
        if config.api_server_count > 1 and config.nnodes > 1:
            raise StartupError(f"--api-server-count {config.api_server_count} with --nnodes {config.nnodes}: several "
                               "frontends serve a server on one host only")
        # Frontend i takes ZMQ clients on --port + i (a ROUTER cannot share a port); with --port 0, any free ones.
        count = config.api_server_count
        self.client_ports = [free_port(config.host) for _ in range(count)] if config.port == 0 else \
            [config.port + i for i in range(count)]
        config.port = self.client_ports[0]
        if config.http_port == 0:  # every frontend, and each restart of one, binds the same port: choose it once
            config.http_port = free_port(config.host)
        if config.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("binding %s: clients from other machines can reach this server", config.host)
        try:  # before the run folder: a layout mistake leaves nothing behind
            self.layout = layout(config)
        except ValueError as e:
            raise StartupError(str(e)) from None
        self.run_dir = Path(tempfile.mkdtemp(prefix="metrale-run-"))
        config.run_dir = str(self.run_dir)
        self.env = {k: v for k, v in os.environ.items() if k not in API_KEY_ENV}  # the key goes to the frontend alone
        self.env["METRALE_SUPERVISOR_PID"] = str(os.getpid())
        if self.chat_template is not None:  # handed over as a file: a template can outgrow a command-line argument
            (self.run_dir / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
        local_ranks = max(1, len(self.layout.replicas)) * len(self.layout.ranks)
        self._threads_env = _worker_env(config.engine, local_ranks)
        self.replicas = [self._replica(k) for k in self.layout.replicas]
        # Node 0 runs the frontends; another node of a group spanning the nodes runs only its ranks of it.
        key_env = {API_KEY_ENV[0]: config.api_key} if config.api_key else {}
        self.frontends = [Child(frontend_name(i), self._frontend_argv(i),
                                env_extra={**key_env, HEARTBEAT_ENV: str(self._beat_path(i))}) for i in range(count)] \
            if config.node_rank == 0 else []
        # Each frontend's heartbeat (metrale/frontend_heartbeat.py): one silent too long is killed as hung.
        self.frontend_watches = [FrontendHangWatch(self._beat_path(i), config.frontend_hang_timeout_s)
                                 for i in range(len(self.frontends))]
        self._hung: dict[str, str] = {}  # a frontend's name -> why it was killed as hung, until its death is noted
        self.follower: WorkerGroup | None = None
        if self.layout.spans_nodes and config.node_rank > 0:
            self.follower = WorkerGroup("gpu_worker", self._follower_argvs, self._threads_env)
        self.node_store = None
        if self.layout.multi_node:
            from metrale.node_store import NodeStore

            try:
                self.node_store = NodeStore(config.master_addr, config.master_port, hosting=config.node_rank == 0)
            except Exception as e:  # noqa: BLE001 - a port in use, a master that never came
                shutil.rmtree(self.run_dir, ignore_errors=True)
                raise StartupError(f"--master-addr {config.master_addr} --master-port {config.master_port}: "
                                   f"the nodes cannot meet there ({e})") from None
        self.worker_pids: set[int] = set()  # every rank 0 started (a killed one may leave its all-reduce segment)
        self.healthy = True  # False once a child is given up on
        self.last_fault: str | None = None
        self.given_up: str | None = None  # why the server ends: a child it no longer restarts
        self._cannot_run: dict[str, str] = {}  # a child's own reason for exiting with EXIT_CONFIG
        self.endpoints: ChildStatus | None = None  # the frontend's bound addresses, once serving
        self._stop = threading.Event()
        self._stop_requested = False  # request_stop(): a plain flag, what a signal handler may set
        self._health_file = HealthFile(self.health_path, self.clock)
        self.inbox = StatusInbox(self._ipc("status"))
        # Admin requests (metrale/worker_control.py), with --enable-admin only: this host's replicas and ranks.
        self.control = WorkerControl(ranks=len(self.layout.ranks), replicas=len(self.replicas))
        self.admin = AdminInbox(self._ipc("admin")) if config.enable_admin else None

    def _replica(self, k: int) -> Replica:
        """Replica k's children (not started) and addresses; replica 0 keeps the single-engine names."""
        tag = "" if k == 0 else f"-{k}"
        inp, out = self._engine_addresses(k)
        rep = Replica(k, Child("engine_core", []), WorkerGroup("gpu_worker", lambda g: [], self._threads_env),
                      inp, out, self.run_dir / f"worker-served{tag}")
        rep.workers.argvs = lambda generation, rep=rep: self._worker_argvs(rep, generation)
        return rep

    # The first frontend and the first replica's children by their single-engine names (tests replace them with
    # stand-ins).
    @property
    def frontend(self) -> Child | None:
        return self.frontends[0] if self.frontends else None

    @frontend.setter
    def frontend(self, child: Child) -> None:
        self.frontends[0] = child

    @property
    def engine(self) -> Child:
        return self.replicas[0].engine

    @engine.setter
    def engine(self, child: Child) -> None:
        self.replicas[0].engine = child

    @property
    def worker(self) -> WorkerGroup:
        return self.replicas[0].workers

    @worker.setter
    def worker(self, child: Child | WorkerGroup) -> None:
        self.replicas[0].workers = child if isinstance(child, WorkerGroup) else WorkerGroup.of(child)

    @property
    def ring_name(self) -> str:
        return self.replicas[0].ring_name

    # ---- addresses and command lines ------------------------------------------------

    @property
    def client_address(self) -> str:
        """Frontend 0's ZMQ address (frontend i's is at client_ports[i])."""
        return f"tcp://{self.config.host}:{self.config.port}"

    @property
    def health_path(self) -> Path:
        return self.run_dir / "health.msgpack"

    @property
    def served_path(self) -> Path:
        """Replica 0's engine core writes here the pid of each (rank 0) worker once it has served a step."""
        return self.replicas[0].served_path

    def _beat_path(self, i: int) -> Path:
        """Frontend i's heartbeat counter."""
        return self.run_dir / f"frontend-beat-{i}"

    def _ipc(self, name: str) -> str:
        return f"ipc://{self.run_dir / name}"

    def _engine_addresses(self, k: int, frontend: int = 0) -> tuple[str, str]:
        """The addresses between replica k's engine core and a frontend: ipc:// in the run folder when it runs beside
        the frontends, else TCP to node 0 (metrale/node_layout.py; one frontend only)."""
        if node_of_replica(self.config, k) == 0 and self.config.node_rank == 0:
            tag = ("" if k == 0 else f"-{k}") + ("" if frontend == 0 else f".fe{frontend}")
            return self._ipc(f"engine-in{tag}"), self._ipc(f"engine-out{tag}")
        return replica_addresses(self.config, k)

    def _frontend_argv(self, i: int = 0) -> list[str]:
        """Frontend i's command line: its own ZMQ port and its own two addresses for each engine core."""
        every = [self._engine_addresses(k, i) for k in range(self.config.engine.data_parallel_size)]
        count = self.config.api_server_count
        fe = {
            "model_dir": self.model_dir,
            "engine_input_address": every[0][0],
            "engine_output_address": every[0][1],
            "replica_addresses": [list(a) for a in every[1:]],
            "client_address": f"tcp://{self.config.host}:{self.client_ports[i]}",
            "max_model_len": self.max_model_len,
            "max_frame_bytes": self.config.max_frame_bytes,
            "http_host": self.config.host,
            "http_port": self.config.http_port,
            "stream_interval": self.config.stream_interval,
            "status_address": self._ipc("status"),
            "state_path": str(self.run_dir / "frontend-state.json"),  # run-time adapters, for a restarted frontend
            "shutdown_timeout_s": self.config.shutdown_timeout_s,
            "grammar_timeout_s": self.config.grammar_timeout_s,
            "tool_call_parser": self.config.tool_call_parser,
            "admin_address": self._ipc("admin") if self.config.enable_admin else None,
            "admin_allow_remote": self.config.admin_allow_remote,
            "served_model_names": self.config.served_model_names,
            "lora_modules": list(self.config.engine.lora_modules),
            "allow_runtime_lora_updating": self.config.allow_runtime_lora_updating,
            "chat_template": str(self.run_dir / "chat_template.jinja") if self.chat_template is not None else None,
            "generation_config": self.config.generation_config,
            "log_requests": not self.config.disable_log_requests,
            "enable_force_include_usage": self.config.enable_force_include_usage,
            "enable_per_request_metrics": self.config.enable_per_request_metrics,
            "return_tokens_as_token_ids": self.config.return_tokens_as_token_ids,
            "max_logprobs": self.config.engine.max_logprobs,
            "api_server_count": count,
            "api_server_index": i,
            # Where each frontend serves its own counters to the one a /metrics scrape reaches (HTTP only).
            "api_server_sockets": [str(self.run_dir / f"api-server-{j}.sock") for j in range(count)]
            if count > 1 and self.config.http_port is not None else [],
        }
        return [sys.executable, "-m", "metrale.frontend_process", json.dumps(fe), str(self.health_path)]

    def _engine_argv(self, rep: Replica, token: str) -> list[str]:
        from metrale.engine_core.core import EngineCoreArgs
        args = EngineCoreArgs(
            serve=msgspec.structs.replace(self.config, api_key=None),  # a command line is no place for a key
            input_address=rep.input_address,
            output_address=rep.output_address,
            more_frontends=[list(self._engine_addresses(rep.index, i)) for i in range(1, self.config.api_server_count)],
            ring_token=token,
            max_model_len=self.max_model_len,
            vocab_size=self.facts.vocab_size,
            special_tokens=self.special_tokens,
            served_path=str(rep.served_path),
            status_address=self._ipc("status"),
            replica=rep.index,
            ring_ranks=self.layout.ring_ranks,
            pool_dim=self.facts.hidden_size,
        )
        return [sys.executable, "-m", "metrale.engine_core.core", "--args", msgspec.json.encode(args).decode()]

    def _worker_argvs(self, rep: Replica, generation: int) -> list[list[str]]:
        """One command line per worker rank of replica rep, for its generation-th start (a fresh rendezvous)."""
        return worker_argvs(self.config, self.layout, self.model_dir, rep.ring_name, generation)

    def _follower_argvs(self, generation: int) -> list[list[str]]:
        """Command lines of this node's ranks (of a group spanning the nodes) for node 0's generation."""
        return worker_argvs(self.config, self.layout, self.model_dir, None, generation)

    # ---- lifecycle ------------------------------------------------------------------

    def start(self, ready_timeout_s: float = 600.0) -> None:
        """Start every process and wait until a request can be served; StartupError (one line) if one cannot run.

        Another node than node 0 starts its processes and returns (node 0's frontend says when the server serves)."""
        for i in range(len(self.frontends)):
            self._start_frontend(i, self.clock())
        for rep in self.replicas:
            self._start_engine(rep)
        self._write_health()
        if self.frontends:
            self._wait_until_serving(ready_timeout_s)

    def _start_frontend(self, i: int, now: float) -> None:
        """Frontend i, its heartbeat at 0 (starting up: timed against the watch's start-up budget until it serves)."""
        self.frontend_watches[i].reset(now)
        self.frontends[i].start(self.env, now)

    def _start_engine(self, rep: Replica) -> None:
        """A fresh engine core for a replica and, on its ring, a fresh worker group."""
        token = secrets.token_hex(4)
        now = self.clock()
        rep.engine.argv = self._engine_argv(rep, token)
        rep.engine.start(self.env, now)
        rep.engine_pids.add(rep.engine.proc.pid)
        rep.ring_name = f"metrale-{rep.engine.proc.pid}-{token}"
        self._start_workers(rep, now)

    def _start_workers(self, rep: Replica, now: float) -> None:
        """A replica's worker ranks, all at once."""
        rep.workers.start(self.env, now)
        if rep.workers.ranks:
            self.worker_pids.add(rep.workers.ranks[0].pid)
        if self.layout.spans_nodes:  # the other nodes start their ranks of this generation
            self.node_store.publish_generation(rep.workers.generation)

    def _children(self) -> list[Child]:
        """Every process, the frontends first."""
        out = list(self.frontends)
        for rep in self.replicas:
            out += [rep.engine, *rep.workers.ranks]
        if self.follower is not None:
            out += self.follower.ranks
        return out

    def _wait_until_serving(self, timeout_s: float) -> None:
        """Wait for every frontend's SERVING on the status channel (a child's FAILED, or its death, ends it);
        endpoints are frontend 0's."""
        deadline = time.monotonic() + timeout_s
        serving: set[str] = set()
        while True:
            status = self.inbox.receive(WATCH_INTERVAL_S * 4)
            if status is not None:
                if status.state == FAILED:
                    raise StartupError(status.detail)
                if status.state == SERVING:
                    serving.add(status.name)
                    if status.name == self.frontends[0].name:
                        self.endpoints = status
                    if serving >= {f.name for f in self.frontends}:
                        return
                    continue
                self._note(status)
            for child in self._children():
                if not child.alive:
                    late = self.inbox.receive(0.5)  # a child that failed says why just before it exits
                    if late is not None and late.state == FAILED:
                        raise StartupError(late.detail)
                    raise StartupError(f"{child.name} {_how_it_ended(child.proc.returncode)} during start-up "
                                       "(its log above says why)")
            if self._stop_requested or self._stop.is_set():
                raise StartupError("stopped during start-up")
            if time.monotonic() > deadline:
                raise StartupError(f"the server did not become ready within {timeout_s:.0f} s")

    def watch(self) -> None:
        """Restart children that die, until stop() is called or a child is given up on (given_up says why)."""
        from metrale.node_store import NodeStoreLost

        while not self._stop_requested and not self._stop.wait(WATCH_INTERVAL_S):
            try:
                self.check_children()
                if not self.frontends and self.node_store is not None and self.node_store.shutting_down():
                    log.info("node 0 is shutting down; so is this node")
                    return
            except NodeStoreLost as e:  # only another node's supervisor talks to a store it does not host
                log.warning("%s; this node stops too", e)
                return
            if self.given_up is not None:
                return

    def request_stop(self) -> None:
        """Ask watch() (or a start-up still waiting to serve) to return: what a signal handler calls.

        It takes no lock. threading.Event.set() takes the Event's lock, and a handler runs on the main thread between
        two bytecodes, possibly inside Event.wait() with that lock held: set() would then wait forever on its own
        thread, and the supervisor would never stop nor heed another SIGTERM or Ctrl-C."""
        self._stop_requested = True

    def _note(self, status: ChildStatus) -> None:
        """An event a child reported while serving."""
        if status.state == WORKER_HUNG:
            rep = next((r for r in self.replicas if status.pid in r.engine_pids), self.replicas[0])
            rep.hung = status.detail
            log.error("gpu_worker: %s", status.detail)
        elif status.state == FAILED:
            log.error("%s (pid %d): %s", status.name, status.pid, status.detail)
            self._cannot_run[status.name] = status.detail

    def check_children(self) -> None:
        """One pass of the watch: note who died, restart whoever is due, publish health."""
        while (status := self.inbox.receive(0)) is not None:
            self._note(status)
        now = self.clock()
        if self.admin is not None:
            self.admin.serve(lambda msg: self.control.handle(msg, self._worker_pid, now))
            self.control.escalate(self._worker_alive, now)
        if self.follower is not None:
            self._follow(now)
        for rep in self.replicas:
            if self.layout.spans_nodes and rep.workers.alive and self.node_store.lost(rep.workers.generation):
                self.last_fault = f"a rank of generation {rep.workers.generation} died on another node"
                log.warning("%s; restarting the whole group", self.last_fault)
                rep.workers.kill()  # its deaths are noted below, and the group restarts as one
            if self._died(rep.engine, now, rep):
                rep.workers.stop(grace_s=2.0)  # they served the dead engine's ring; fresh ones come with the next
                rep.workers.restart_at = None
                self._sweep()
            elif not rep.workers.alive and rep.engine.alive:  # workers first: gone with their engine is not their fault
                if self._died(rep.workers, now, rep) and rep.workers.size > 1:
                    rep.workers.kill()  # the rest of a broken group waits in collectives that cannot finish
                    self._sweep()
        for frontend, watch in zip(self.frontends, self.frontend_watches):
            if frontend.alive and (why := watch.hung(now)) is not None:
                self._hung[frontend.name] = why
                frontend.kill()  # SIGKILL ends a stopped process too; _died notes it and schedules the restart
            self._died(frontend, now)
        for rep in self.replicas:
            if self._due(rep.engine, now):
                rep.engine.restarts += 1
                rep.workers.restarts += 1
                self._start_engine(rep)
                log.warning("engine core%s restarted with fresh workers (restart %d)", _of(rep), rep.engine.restarts)
            elif rep.engine.alive and self._due(rep.workers, now):
                rep.workers.restarts += 1
                self._start_workers(rep, now)
                log.warning("worker%s restarted (restart %d)", "s" + _of(rep) if rep.workers.size > 1 else _of(rep),
                            rep.workers.restarts)
        for i, frontend in enumerate(self.frontends):  # each alone: the others serve on meanwhile
            if self._due(frontend, now):
                frontend.restarts += 1
                self._start_frontend(i, now)
                log.warning("%s restarted on tcp://%s:%d (restart %d)", frontend.name, self.config.host,
                            self.client_ports[i], frontend.restarts)
        self._write_health()

    def _follow(self, now: float) -> None:
        """Another node's ranks of a group spanning the nodes: run node 0's current generation; when one of ours
        dies, say so (node 0 restarts the whole group) and wait for the next generation."""
        group, store = self.follower, self.node_store
        current = store.generation()
        if group.ranks and not group.alive and group.restart_at is None:
            self.last_fault = f"{group.name} (pid {group.pid}) {_how_it_ended(group.proc.returncode)}"
            log.warning("%s; waiting for node 0 to restart the group", self.last_fault)
            store.report_lost(group.generation)
            group.kill()
            group.restart_at = NEVER  # until node 0 starts a new generation
        if current > group.generation:
            if group.ranks:
                group.kill()
                group.restarts += 1
            group.generation = current - 1  # start() moves on to it
            group.start(self.env, now)
            log.info("node %d: ranks %s of generation %d started", self.config.node_rank, list(self.layout.ranks), current)

    def _died(self, child: Child | WorkerGroup, now: float, rep: Replica | None = None) -> bool:
        """True when child has just been found dead: record the fault and schedule (or refuse) its restart."""
        if child.proc is None or child.alive or child.restart_at is not None:
            return False
        workers = isinstance(child, WorkerGroup)
        admin = self.control.took({r.pid for r in child.ranks}) if workers else None  # an operator's kill is no crash
        worked = (now - child.started >= self.policy.window_s or admin is not None
                  or (workers and self._worker_served(rep)) or child.name in self._hung)  # a hung frontend had beaten
        child.in_a_row = 1 if worked else child.in_a_row + 1
        ended = _how_it_ended(child.proc.returncode) + (f" ({admin.describe()})" if admin is not None else "")
        delay = self.policy.delay(child.in_a_row)
        where = _of(rep) if rep is not None and len(self.replicas) > 1 else ""
        if workers and rep.hung is not None:  # the engine core killed it: say why
            after = f" (after {admin.describe()})" if admin is not None else ""
            self.last_fault, rep.hung = f"{child.name}{where} (pid {child.pid}) hung{after}: {rep.hung}", None
        elif child.name in self._hung:  # a frontend the watch killed (check_children)
            self.last_fault = f"{child.name} (pid {child.pid}) hung: {self._hung.pop(child.name)}; killed it"
        elif child.proc.returncode == EXIT_CONFIG:  # restarting it would fail the same way
            why = self._cannot_run.pop(child.name, ended)
            self.last_fault, delay = f"{child.name}{where} (pid {child.pid}) cannot run: {why}", None
        else:
            self.last_fault = f"{child.name}{where} (pid {child.pid}) {ended}"
            if delay is None:
                self.last_fault += f"; it died {child.in_a_row} times in a row and is not restarted again"
        if delay is None:
            self.healthy = False
            child.restart_at = NEVER
            self.given_up = self.last_fault
            log.error(self.last_fault)
        else:
            child.restart_at = now + delay
            log.warning("%s; restarting it in %.2f s", self.last_fault, delay)
        return True

    @staticmethod
    def _due(child: Child | WorkerGroup, now: float) -> bool:
        """Whether a dead child's restart time has come."""
        return child.restart_at is not None and now >= child.restart_at

    def _worker_pid(self, replica: int, rank: int) -> int | None:
        """The pid of a live worker rank of a replica on this host, or None (not running, being restarted)."""
        rep = next((r for r in self.replicas if r.index == replica), None)
        if rep is None or rank >= rep.workers.size or not rep.workers.ranks[rank].alive:
            return None
        return rep.workers.ranks[rank].pid

    def _worker_alive(self, pid: int) -> bool:
        """Whether pid is a live worker rank of this host."""
        return any(r.alive and r.pid == pid for rep in self.replicas for r in rep.workers.ranks)

    def _worker_served(self, rep: Replica) -> bool:
        """Whether the dead worker group had served a step (the engine core notes each rank 0 that has)."""
        try:
            return bool(rep.workers.ranks) and int(rep.served_path.read_text()) == rep.workers.ranks[0].pid
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        """Shut down in order and leave nothing behind. Idempotent.

        The frontend goes first and is given shutdown_timeout_s (plus a margin) to let live requests finish and
        to send every one left its final message, while the engine cores and the workers still run."""
        self._stop.set()
        if self.node_store is not None and self.config.node_rank == 0:
            self.node_store.announce_shutdown()
        # Every frontend drains at once (each one SIGTERM: a second would cut its drain short).
        stopping = [threading.Thread(target=f.stop, args=(self.config.shutdown_timeout_s + 5.0,), daemon=True)
                    for f in self.frontends]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()
        for rep in self.replicas:
            rep.engine.stop(grace_s=10.0)
        for rep in self.replicas:
            rep.workers.stop(grace_s=5.0)
        if self.follower is not None:
            self.follower.stop(grace_s=5.0)
        self._sweep(everything=True)
        for watch in self.frontend_watches:
            watch.close()
        self.inbox.close()
        if self.admin is not None:
            self.admin.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _sweep(self, everything: bool = False) -> None:
        """Remove the shared memory of every engine core that is gone (and of dead workers' all-reduce)."""
        from metrale.ipc.tickets import sweep_segments

        gone: set[int] = set()
        for rep in self.replicas:
            dead = {pid for pid in rep.engine_pids if everything or not (rep.engine.alive and rep.engine.pid == pid)}
            rep.engine_pids -= dead
            gone |= dead
        live = {c.pid for c in self._children() if c.alive and not everything}
        workers = self.worker_pids - live
        self.worker_pids -= workers
        for name in sweep_segments(gone | workers):
            log.info("removed %s", name)

    def health(self) -> Health:
        """Each process's pid, uptime and restarts (per replica and rank), and the last fault."""
        now = self.clock()

        def entry(c: Child, restarts: int, replica: int = 0, rank: int = 0) -> ProcessHealth:
            return ProcessHealth(name=c.name, pid=c.pid, uptime_s=now - c.started if c.alive else 0.0,
                                 restarts=restarts, alive=c.alive, replica=replica, rank=rank)

        procs = [entry(f, f.restarts) for f in self.frontends]
        for rep in self.replicas:
            procs.append(entry(rep.engine, rep.engine.restarts, rep.index))
            ranks = rep.workers.ranks or [Child(rep.workers.role, [])]
            procs += [entry(c, rep.workers.restarts, rep.index, r) for r, c in enumerate(ranks)]
        return Health(id="", healthy=self.healthy and all(p.alive for p in procs), processes=procs, last_fault=self.last_fault)

    def _write_health(self) -> None:
        """Publish health for the frontend (metrale/health_file.py: written only when it changes)."""
        self._health_file.publish(self.health())


def _of(rep: Replica) -> str:
    """" of replica K" for the logs of replicas past the first."""
    return f" of replica {rep.index}" if rep.index else ""


def _how_it_ended(code: int) -> str:
    """A process's end in words: "exited with code 3", "was killed by SIGKILL"."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _worker_env(engine: EngineArgs, ranks: int) -> dict[str, str]:
    """Each worker rank's torch threads on a CPU: --worker-threads, else default_worker_threads() shared evenly by
    the ranks that run on this node."""
    if engine.device not in (None, "cpu"):
        return {}
    return {"OMP_NUM_THREADS": str(engine.worker_threads or max(1, default_worker_threads(os.cpu_count() or 1) // ranks))}


def default_worker_threads(cores: int) -> int:
    """All cores but one for the model, so the engine core, frontend and clients keep one; but every core
    on a box of two or fewer, where they need about a third of a core (bench_serve, batch 32: 0.16 ms of CPU
    per token beside the worker's 0.89) and a spare core would halve the model (measured on 2 cores, batch 32,
    float32: serve/offline 0.79 with one worker thread, 0.92 with two)."""
    return cores if cores <= 2 else cores - 1

"""The supervisor behind `metrale serve`: starts frontend, engine core and GPU worker, watches, restarts, cleans up.

Each child is `python -m <module>` with its configuration as JSON on the command line (no pickle) and its
own session, so a terminal's Ctrl-C reaches only the supervisor, which then shuts down in order:
frontend (stop taking requests), engine core (which tells its worker to exit), worker; then every
shared-memory segment an engine core owned is swept and the run directory removed.

Restarts. A dead worker is restarted on the same ring (the engine core requeues what it was running); a dead
engine core is restarted with a fresh worker (its ring is swept; the frontend resubmits every live request);
a dead frontend is restarted on the same addresses. A child that dies "in a row" — without having done any
work since its start (for the worker: served no step), and within RestartPolicy.window_s of it — waits
longer before each restart; after RestartPolicy.max_in_a_row such deaths it is not restarted again, and the
server ends (`watch` returns, `given_up` says why) with a non-zero exit, so a service manager sees the failure
instead of a supervisor running on without a child. A child that exits with EXIT_CONFIG (a port in use) is
given up on at once: restarting it would fail the same way.

Start-up is an event: the children report on a status channel in the run folder (ipc/status_channel.py),
the frontend once it is bound and an engine core is up, a child that cannot run with why. So `start()` waits
on that channel (never probing the client port, where another server might answer) and fails with one line.
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
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import psutil

from metrale.config import EngineArgs, ServeConfig
from metrale.health_file import HealthFile, read_health
from metrale.ipc.admin_channel import AdminInbox
from metrale.ipc.messages import Health, ProcessHealth
from metrale.ipc.status_channel import EXIT_CONFIG, FAILED, SERVING, WORKER_HUNG, ChildStatus, StatusInbox
from metrale.worker_control import WorkerControl

log = logging.getLogger("metrale.supervisor")

WATCH_INTERVAL_S = 0.05
API_KEY_ENV = ("METRALE_API_KEY", "VLLM_API_KEY")  # where `metrale serve --api-key` also looks, as vLLM does
NEVER = float("inf")


class StartupError(RuntimeError):
    """`metrale serve` cannot start; the message is one line naming the thing and what to do."""


@dataclass(slots=True)
class RestartPolicy:
    """When a dead child is started again: at once, after a backoff, or never (the server is then unhealthy)."""

    window_s: float = 30.0  # a child that lived longer than this did not crash "in a row"
    max_in_a_row: int = 5  # this many deaths in a row: give up
    backoff_s: float = 0.5  # the wait before the second restart in a row; it doubles after each death
    max_backoff_s: float = 10.0

    def delay(self, in_a_row: int) -> float | None:
        """Seconds to wait before the next start after this many deaths in a row; None: do not restart."""
        if in_a_row >= self.max_in_a_row:
            return None
        if in_a_row <= 1:
            return 0.0
        return min(self.max_backoff_s, self.backoff_s * 2 ** (in_a_row - 2))


@dataclass(slots=True)
class Child:
    """One supervised process and its restart history."""

    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0  # on the supervisor's clock
    restarts: int = 0
    env_extra: dict[str, str] = field(default_factory=dict)  # on top of the supervisor's environment
    in_a_row: int = 0  # deaths without work done in between (RestartPolicy)
    restart_at: float | None = None  # set when it died: when to start it again (NEVER: given up)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def start(self, env: dict[str, str], now: float) -> None:
        """Start (or restart) the process."""
        env = {**env, **self.env_extra} if self.env_extra else env
        self.proc = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        self.started = now
        self.restart_at = None

    def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after grace_s; reaps the process and waits for what it started to end too."""
        if self.proc is None:
            return
        try:  # e.g. multiprocessing's resource tracker, which exits once its parent has
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            descendants = []
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        _, alive = psutil.wait_procs(descendants, timeout=grace_s)
        for p in alive:
            p.kill()


def free_port(host: str) -> int:
    """A port the OS considers free right now (for --port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Supervisor:
    """Owns the three processes of one `metrale serve`."""

    def __init__(
        self, config: ServeConfig, policy: RestartPolicy | None = None, clock: Callable[[], float] = time.monotonic
    ):
        from metrale.frontend.tokenizer import Tokenizer
        from metrale.llm import resolve_model_dir, special_tokens_of
        from metrale.frontend.chat import ChatTemplateError, chat_template_source
        from metrale.model_facts import ModelError, generation_defaults, resolve_model

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
        try:  # the operator's template and generation config fail here, with one line, not per request
            self.chat_template = chat_template_source(config.chat_template) if config.chat_template else None
            generation_defaults(self.model_dir, config.generation_config)
        except (ChatTemplateError, ModelError) as e:
            raise StartupError(str(e)) from None
        self.special_tokens = dataclasses.asdict(special_tokens_of(tokenizer))
        self.max_model_len = self.facts.max_model_len
        if config.port == 0:
            config.port = free_port(config.host)
        if config.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("binding %s: clients from other machines can reach this server", config.host)
        self.run_dir = Path(tempfile.mkdtemp(prefix="metrale-run-"))
        config.run_dir = str(self.run_dir)
        self.env = {k: v for k, v in os.environ.items() if k not in API_KEY_ENV}  # the key goes to the frontend alone
        self.env["METRALE_SUPERVISOR_PID"] = str(os.getpid())
        if self.chat_template is not None:  # handed over as a file: a template can outgrow a command-line argument
            (self.run_dir / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
        self.frontend = Child("frontend", self._frontend_argv(),
                              env_extra={API_KEY_ENV[0]: config.api_key} if config.api_key else {})
        self.engine = Child("engine_core", [])
        self.worker = Child("gpu_worker", [], env_extra=_worker_env(config.engine))
        self.ring_name = ""  # the current engine core's ticket ring (the worker serves it)
        self.engine_pids: set[int] = set()
        self.healthy = True  # False once a child is given up on
        self.last_fault: str | None = None
        self.given_up: str | None = None  # why the server ends: a child it no longer restarts
        self._hung: str | None = None  # why the engine core killed the worker, until its death is noted
        self._cannot_run: dict[str, str] = {}  # a child's own reason for exiting with EXIT_CONFIG
        self.endpoints: ChildStatus | None = None  # the frontend's bound addresses, once serving
        self._stop = threading.Event()
        self._health_file = HealthFile(self.health_path, self.clock)
        self.inbox = StatusInbox(self._ipc("status"))
        self.control = WorkerControl()  # admin requests (metrale/worker_control.py), with --enable-admin only
        self.admin = AdminInbox(self._ipc("admin")) if config.enable_admin else None

    # ---- addresses and command lines ------------------------------------------------

    @property
    def client_address(self) -> str:
        return f"tcp://{self.config.host}:{self.config.port}"

    @property
    def health_path(self) -> Path:
        return self.run_dir / "health.msgpack"

    @property
    def served_path(self) -> Path:
        """The engine core writes here the pid of each worker once it has served a step."""
        return self.run_dir / "worker-served"

    def _ipc(self, name: str) -> str:
        return f"ipc://{self.run_dir / name}"

    def _frontend_argv(self) -> list[str]:
        fe = {
            "model_dir": self.model_dir,
            "engine_input_address": self._ipc("engine-in"),
            "engine_output_address": self._ipc("engine-out"),
            "client_address": self.client_address,
            "max_model_len": self.max_model_len,
            "max_frame_bytes": self.config.max_frame_bytes,
            "http_host": self.config.host,
            "http_port": self.config.http_port,
            "stream_interval": self.config.stream_interval,
            "status_address": self._ipc("status"),
            "shutdown_timeout_s": self.config.shutdown_timeout_s,
            "admin_address": self._ipc("admin") if self.config.enable_admin else None,
            "admin_allow_remote": self.config.admin_allow_remote,
            "served_model_names": self.config.served_model_names,
            "chat_template": str(self.run_dir / "chat_template.jinja") if self.chat_template is not None else None,
            "generation_config": self.config.generation_config,
            "log_requests": not self.config.disable_log_requests,
        }
        return [sys.executable, "-m", "metrale.supervisor", "frontend", json.dumps(fe), str(self.health_path)]

    def _engine_argv(self, token: str) -> list[str]:
        from metrale.engine_core.core import EngineCoreArgs
        from metrale.model_facts import STATE_RECURRENT

        args = EngineCoreArgs(
            serve=msgspec.structs.replace(self.config, api_key=None),  # a command line is no place for a key
            input_address=self._ipc("engine-in"),
            output_address=self._ipc("engine-out"),
            ring_token=token,
            max_model_len=self.max_model_len,
            special_tokens=self.special_tokens,
            served_path=str(self.served_path),
            status_address=self._ipc("status"),
            logits_vocab=self.facts.vocab_size if self.facts.state_kind == STATE_RECURRENT else 0,
        )
        return [sys.executable, "-m", "metrale.engine_core.core", "--args", msgspec.json.encode(args).decode()]

    def _worker_argv(self, ring: str) -> list[str]:
        kwargs = self.config.engine.runner_kwargs(self.model_dir)
        return [sys.executable, "-m", "metrale.gpu_worker.worker", "--ring", ring, "--runner-kwargs", json.dumps(kwargs)]

    # ---- lifecycle ------------------------------------------------------------------

    def start(self, ready_timeout_s: float = 600.0) -> None:
        """Start the three and wait until a request can be served; StartupError (one line) if one cannot run."""
        self.frontend.start(self.env, self.clock())
        self._start_engine()
        self._write_health()
        self._wait_until_serving(ready_timeout_s)

    def _start_engine(self) -> None:
        """A fresh engine core and, on its ring, a fresh worker."""
        token = secrets.token_hex(4)
        now = self.clock()
        self.engine.argv = self._engine_argv(token)
        self.engine.start(self.env, now)
        self.engine_pids.add(self.engine.proc.pid)
        self.ring_name = f"metrale-{self.engine.proc.pid}-{token}"
        self.worker.argv = self._worker_argv(self.ring_name)
        self.worker.start(self.env, now)

    def _wait_until_serving(self, timeout_s: float) -> None:
        """Wait for the frontend's SERVING on the status channel (a child's FAILED, or its death, ends it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.inbox.receive(WATCH_INTERVAL_S * 4)
            if status is not None:
                if status.state == FAILED:
                    raise StartupError(status.detail)
                if status.state == SERVING:
                    self.endpoints = status
                    return
                self._note(status)
            for child in (self.frontend, self.engine, self.worker):
                if not child.alive:
                    late = self.inbox.receive(0.5)  # a child that failed says why just before it exits
                    if late is not None and late.state == FAILED:
                        raise StartupError(late.detail)
                    raise StartupError(f"{child.name} {_how_it_ended(child.proc.returncode)} during start-up "
                                       "(its log above says why)")
            if self._stop.is_set():
                raise StartupError("stopped during start-up")
            if time.monotonic() > deadline:
                raise StartupError(f"the server did not become ready within {timeout_s:.0f} s")

    def watch(self) -> None:
        """Restart children that die, until stop() is called or a child is given up on (given_up says why)."""
        while not self._stop.wait(WATCH_INTERVAL_S):
            self.check_children()
            if self.given_up is not None:
                return

    def _note(self, status: ChildStatus) -> None:
        """An event a child reported while serving."""
        if status.state == WORKER_HUNG:
            self._hung = status.detail
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
            self.admin.serve(lambda msg: self.control.handle(msg, self.worker.pid, self.worker.alive, now))
            self.control.escalate(self.worker.pid, self.worker.alive, now)
        if self._died(self.engine, now):
            self.worker.stop(grace_s=2.0)  # it served the dead engine's ring; a fresh one comes with the next
            self.worker.restart_at = None
            self._sweep()
        elif not self.worker.alive and self.engine.alive:  # worker first: a worker gone with its engine is not its fault
            self._died(self.worker, now)
        self._died(self.frontend, now)
        if self._due(self.engine, now):
            self.engine.restarts += 1
            self.worker.restarts += 1
            self._start_engine()
            log.warning("engine core restarted with a fresh worker (restart %d)", self.engine.restarts)
        elif self.engine.alive and self._due(self.worker, now):
            self.worker.restarts += 1
            self.worker.start(self.env, now)
            log.warning("worker restarted (restart %d)", self.worker.restarts)
        if self._due(self.frontend, now):
            self.frontend.restarts += 1
            self.frontend.start(self.env, now)
            log.warning("frontend restarted on %s (restart %d)", self.client_address, self.frontend.restarts)
        self._write_health()

    def _died(self, child: Child, now: float) -> bool:
        """True when child has just been found dead: record the fault and schedule (or refuse) its restart."""
        if child.proc is None or child.alive or child.restart_at is not None:
            return False
        admin = self.control.took(child.pid) if child is self.worker else None  # an operator's kill is no crash
        worked = (now - child.started >= self.policy.window_s or admin is not None
                  or (child is self.worker and self._worker_served()))
        child.in_a_row = 1 if worked else child.in_a_row + 1
        ended = _how_it_ended(child.proc.returncode) + (f" ({admin.describe()})" if admin is not None else "")
        delay = self.policy.delay(child.in_a_row)
        if child is self.worker and self._hung is not None:  # the engine core killed it: say why
            after = f" (after {admin.describe()})" if admin is not None else ""
            self.last_fault, self._hung = f"gpu_worker (pid {child.pid}) hung{after}: {self._hung}", None
        elif child.proc.returncode == EXIT_CONFIG:  # restarting it would fail the same way
            why = self._cannot_run.pop(child.name, ended)
            self.last_fault, delay = f"{child.name} (pid {child.pid}) cannot run: {why}", None
        else:
            self.last_fault = f"{child.name} (pid {child.pid}) {ended}"
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
    def _due(child: Child, now: float) -> bool:
        """Whether a dead child's restart time has come."""
        return child.restart_at is not None and now >= child.restart_at

    def _worker_served(self) -> bool:
        """Whether the dead worker had served a step (the engine core notes each worker that has)."""
        try:
            return int(self.served_path.read_text()) == self.worker.pid
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        """Shut down in order and leave nothing behind. Idempotent.

        The frontend goes first and is given shutdown_timeout_s (plus a margin) to let live requests finish and
        to send every one left its final message, while the engine core and the worker still run."""
        self._stop.set()
        self.frontend.stop(grace_s=self.config.shutdown_timeout_s + 5.0)
        self.engine.stop(grace_s=10.0)
        self.worker.stop(grace_s=5.0)
        self._sweep()
        self.inbox.close()
        if self.admin is not None:
            self.admin.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _sweep(self) -> None:
        """Remove the shared memory of every engine core that is gone."""
        from metrale.ipc.tickets import sweep_segments

        gone = {pid for pid in self.engine_pids if not (self.engine.alive and self.engine.pid == pid)}
        for name in sweep_segments(gone):
            log.info("removed %s", name)
        self.engine_pids -= gone

    def health(self) -> Health:
        """Each process's pid, uptime and restarts, and the last fault."""
        now = self.clock()
        procs = [
            ProcessHealth(
                name=c.name,
                pid=c.pid,
                uptime_s=now - c.started if c.alive else 0.0,
                restarts=c.restarts,
                alive=c.alive,
            )
            for c in (self.frontend, self.engine, self.worker)
        ]
        return Health(id="", healthy=self.healthy and all(p.alive for p in procs), processes=procs, last_fault=self.last_fault)

    def _write_health(self) -> None:
        """Publish health for the frontend (metrale/health_file.py: written only when it changes)."""
        self._health_file.publish(self.health())


def _how_it_ended(code: int) -> str:
    """A process's end in words: "exited with code 3", "was killed by SIGKILL"."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _worker_env(engine: EngineArgs) -> dict[str, str]:
    """The worker's torch threads on a CPU: --worker-threads, else default_worker_threads()."""
    if engine.device not in (None, "cpu"):
        return {}
    return {"OMP_NUM_THREADS": str(engine.worker_threads or default_worker_threads(os.cpu_count() or 1))}


def default_worker_threads(cores: int) -> int:
    """All cores but one for the model, so the engine core, frontend and clients keep one; but every core
    on a box of two or fewer, where they need about a third of a core (bench_serve, batch 32: 0.16 ms of CPU
    per token beside the worker's 0.89) and a spare core would halve the model (measured on 2 cores, batch 32,
    float32: serve/offline 0.79 with one worker thread, 0.92 with two)."""
    return cores if cores <= 2 else cores - 1


def _run_frontend(config_json: str, health_path: str) -> None:
    """The frontend child: its config from JSON, health from the supervisor's file; exits with its parent."""
    from metrale.frontend.server import FrontendConfig, main

    logging.basicConfig(level=logging.INFO, format="%(asctime)s frontend %(levelname)s %(message)s")
    config = msgspec.json.decode(config_json, type=FrontendConfig)
    config.api_key = os.environ.get(API_KEY_ENV[0]) or None
    supervisor = int(os.environ.get("METRALE_SUPERVISOR_PID", os.getppid()))

    def health() -> Health:
        try:
            return read_health(health_path)
        except (OSError, msgspec.DecodeError):
            return Health(id="", healthy=False, last_fault="the supervisor's health file is unreadable")

    def watch_parent() -> None:
        while True:
            time.sleep(0.5)  # a poll interval, not synchronisation: nothing waits on it
            if not _pid_alive(supervisor):
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch_parent, daemon=True).start()
    main(config, health_source=health)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "frontend":
        _run_frontend(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m metrale.supervisor frontend CONFIG_JSON HEALTH_PATH")

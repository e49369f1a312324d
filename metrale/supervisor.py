"""The supervisor behind `metrale serve`: starts frontend, engine core and GPU worker, watches, restarts, cleans up.

Each child is `python -m <module>` with its configuration as JSON on the command line (no pickle) and its
own session, so a terminal's Ctrl-C reaches only the supervisor, which then shuts down in order:
frontend (stop taking requests), engine core (which tells its worker to exit), worker; then every
shared-memory segment an engine core owned is swept and the run directory removed.
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
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from metrale.config import ServeConfig
from metrale.ipc.messages import Health, ProcessHealth

log = logging.getLogger("metrale.supervisor")

CRASH_WINDOW_S = 30.0  # a worker that dies again within this window backs off
MAX_CRASHES_IN_A_ROW = 5  # then the server reports itself unhealthy and stops restarting it
WATCH_INTERVAL_S = 0.05


@dataclass(slots=True)
class Child:
    """One supervised process and its restart history."""

    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    crashes: deque = field(default_factory=lambda: deque(maxlen=MAX_CRASHES_IN_A_ROW))
    restart_at: float | None = None  # backoff: when to start it again

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        self.started = time.monotonic()
        self.restart_at = None

    def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after grace_s; reaps the process."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def free_port(host: str) -> int:
    """A port the OS considers free right now (for --port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Supervisor:
    """Owns the three processes of one `metrale serve`."""

    def __init__(self, config: ServeConfig):
        from metrale.frontend.tokenizer import Tokenizer
        from metrale.llm import resolve_model_dir, special_tokens_of

        self.config = config
        self.model_dir = resolve_model_dir(config.engine.model)
        tokenizer = Tokenizer.from_dir(self.model_dir)
        self.special_tokens = dataclasses.asdict(special_tokens_of(tokenizer))
        self.max_model_len = _max_model_len(self.model_dir)
        if config.port == 0:
            config.port = free_port(config.host)
        if config.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("binding %s: clients from other machines can reach this server", config.host)
        self.run_dir = Path(tempfile.mkdtemp(prefix="metrale-run-"))
        config.run_dir = str(self.run_dir)
        self.env = {**os.environ, "METRALE_SUPERVISOR_PID": str(os.getpid())}
        self.frontend = Child("frontend", self._frontend_argv())
        self.engine = Child("engine_core", [])
        self.worker = Child("gpu_worker", [])
        self.engine_pids: set[int] = set()
        self.healthy = True
        self.last_fault: str | None = None
        self._stop = threading.Event()

    # ---- addresses and command lines ------------------------------------------------

    @property
    def client_address(self) -> str:
        return f"tcp://{self.config.host}:{self.config.port}"

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
        }
        health = str(self.run_dir / "health.msgpack")
        return [sys.executable, "-m", "metrale.supervisor", "frontend", json.dumps(fe), health]

    def _engine_argv(self, token: str) -> list[str]:
        from metrale.engine_core.core import EngineCoreArgs

        args = EngineCoreArgs(
            serve=self.config,
            input_address=self._ipc("engine-in"),
            output_address=self._ipc("engine-out"),
            ring_token=token,
            max_model_len=self.max_model_len,
            special_tokens=self.special_tokens,
        )
        return [sys.executable, "-m", "metrale.engine_core.core", "--args", msgspec.json.encode(args).decode()]

    def _worker_argv(self, ring: str) -> list[str]:
        e = self.config.engine
        kwargs = {
            "model_dir": self.model_dir,
            "dtype": e.dtype,
            "device": e.device,
            "num_kv_blocks": e.num_kv_blocks,
            "kv_cache_memory": e.kv_cache_memory,
            "block_size": e.block_size,
            "max_num_seqs": e.max_num_seqs,
            "show_progress": e.show_progress,
        }
        return [sys.executable, "-m", "metrale.gpu_worker.worker", "--ring", ring, "--runner-kwargs", json.dumps(kwargs)]

    # ---- lifecycle ------------------------------------------------------------------

    def start(self, ready_timeout_s: float = 600.0) -> None:
        """Start the three and wait until a request can be served; RuntimeError if a child dies first."""
        self.frontend.start(self.env)
        self._start_engine()
        self._write_health()
        self._wait_until_serving(ready_timeout_s)

    def _start_engine(self) -> None:
        """A fresh engine core and, on its ring, a fresh worker."""
        token = secrets.token_hex(4)
        self.engine.argv = self._engine_argv(token)
        self.engine.start(self.env)
        self.engine_pids.add(self.engine.proc.pid)
        self.worker.argv = self._worker_argv(f"metrale-{self.engine.proc.pid}-{token}")
        self.worker.start(self.env)

    def _wait_until_serving(self, timeout_s: float) -> None:
        """Ask the frontend for stats until the engine core answers through it."""
        from metrale.frontend.client import Client

        deadline = time.monotonic() + timeout_s
        with Client(self.config.host, self.config.port, timeout=1.0) as client:
            while True:
                for child in (self.frontend, self.engine, self.worker):
                    if not child.alive:
                        raise RuntimeError(f"{child.name} exited during startup (code {child.proc.returncode})")
                try:
                    client.stats()
                    return
                except Exception as e:  # not up yet: the frontend or engine is still loading
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the server did not become ready within {timeout_s:.0f} s: {e}") from e

    def watch(self) -> None:
        """Restart children that die, until stop() is called."""
        while not self._stop.wait(WATCH_INTERVAL_S):
            self.check_children()

    def check_children(self) -> None:
        """One pass of the watch: restart what died (with backoff for a crashing worker)."""
        now = time.monotonic()
        if not self.engine.alive:
            self._record_fault(self.engine, now)
            log.warning("engine core died; restarting it with a fresh worker")
            self.worker.stop(grace_s=2.0)
            self._sweep()
            self.engine.restarts += 1
            self.worker.restarts += 1
            self._start_engine()
        elif not self.worker.alive:
            if self.worker.restart_at is None:
                self._record_fault(self.worker, now)
                if len(self.worker.crashes) == MAX_CRASHES_IN_A_ROW and now - self.worker.crashes[0] < CRASH_WINDOW_S * MAX_CRASHES_IN_A_ROW:
                    self.healthy = False
                    log.error("the worker crashed %d times in a row; not restarting it", MAX_CRASHES_IN_A_ROW)
                    self.worker.restart_at = float("inf")
                else:
                    recent = len([t for t in self.worker.crashes if now - t < CRASH_WINDOW_S])
                    delay = 0.0 if recent <= 1 else min(5.0, 0.25 * 2 ** (recent - 2))
                    self.worker.restart_at = now + delay
            if now >= self.worker.restart_at:
                self.worker.restarts += 1
                self.worker.start(self.env)
                log.warning("worker restarted (restart %d)", self.worker.restarts)
        if not self.frontend.alive:
            self._record_fault(self.frontend, now)
            self.frontend.restarts += 1
            self.frontend.start(self.env)
            log.warning("frontend restarted on %s", self.client_address)
        self._write_health()

    def _record_fault(self, child: Child, now: float) -> None:
        code = child.proc.returncode if child.proc is not None else None
        self.last_fault = f"{child.name} (pid {child.proc.pid if child.proc else '?'}) exited with code {code}"
        child.crashes.append(now)
        log.warning(self.last_fault)

    def stop(self) -> None:
        """Shut down in order and leave nothing behind. Idempotent."""
        self._stop.set()
        self.frontend.stop(grace_s=5.0)
        self.engine.stop(grace_s=10.0)
        self.worker.stop(grace_s=5.0)
        self._sweep()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _sweep(self) -> None:
        """Remove the shared memory of every engine core that is gone."""
        from metrale.ipc.tickets import sweep_segments

        gone = {pid for pid in self.engine_pids if not (self.engine.alive and self.engine.proc.pid == pid)}
        for name in sweep_segments(gone):
            log.info("removed %s", name)

    def health(self) -> Health:
        now = time.monotonic()
        procs = [
            ProcessHealth(
                name=c.name,
                pid=c.proc.pid if c.proc else 0,
                uptime_s=now - c.started if c.alive else 0.0,
                restarts=c.restarts,
                alive=c.alive,
            )
            for c in (self.frontend, self.engine, self.worker)
        ]
        return Health(id="", healthy=self.healthy and all(p.alive for p in procs), processes=procs, last_fault=self.last_fault)

    def _write_health(self) -> None:
        """Publish health for the frontend (atomic replace; the frontend reads it on a Health query)."""
        path = self.run_dir / "health.msgpack"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.msgpack.encode(self.health()))
        os.replace(tmp, path)


def _max_model_len(model_dir: str) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings", 2048))


def _run_frontend(config_json: str, health_path: str) -> None:
    """The frontend child: its config from JSON, health from the supervisor's file; exits with its parent."""
    from metrale.frontend.server import FrontendConfig, main

    logging.basicConfig(level=logging.INFO, format="%(asctime)s frontend %(levelname)s %(message)s")
    config = msgspec.json.decode(config_json, type=FrontendConfig)
    supervisor = int(os.environ.get("METRALE_SUPERVISOR_PID", os.getppid()))

    def health() -> Health:
        try:
            return msgspec.msgpack.decode(Path(health_path).read_bytes(), type=Health)
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

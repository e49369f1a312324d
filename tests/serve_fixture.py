"""Start `metrale serve` as a user would, and stop it (and check it left nothing) on every path."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil

from metrale.frontend.client import Client


def offline_tokens(model_dir, prompts, params) -> list[list[int]]:
    """What the offline engine gives for these requests, with no fault: the tokens a server's streams must equal."""
    from metrale import LLM

    with LLM(str(model_dir), show_progress=False) as llm:
        return [r.token_ids for r in llm.generate(prompts, params)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_entries(pids: set[int]) -> list[str]:
    """/dev/shm entries named for one of these owner pids."""
    return [n for n in os.listdir("/dev/shm") if n.startswith("metrale-") and int(n.split("-")[1].split(".")[0]) in pids]


class Server:
    """A running `metrale serve`: its port, its supervisor process and what it logged."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: str, api_key: str | None = None):
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.api_key = api_key
        self.seen_pids: set[int] = set()

    def client(self, timeout: float = 60.0) -> Client:
        return Client("127.0.0.1", self.port, timeout=timeout, api_key=self.api_key)

    def children(self) -> dict[str, int]:
        """name -> pid of the supervisor's live children (frontend, engine core, worker)."""
        with self.client(timeout=10) as c:
            health = c.health()
        pids = {p.name: p.pid for p in health.processes}
        self.seen_pids.update(pids.values())
        return pids

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def running_server(model_dir, *args: str, ready_timeout: float = 180.0, api_key: str | None = None,
                   port: int | None = None):
    """Yield a Server; on exit SIGTERM it, and fail if a process or a segment outlived it. With api_key, the
    server gets it in its environment (METRALE_API_KEY) and Server.client() sends it. port: its --port (default: a
    free one)."""
    port = port or free_port()
    log = tempfile.NamedTemporaryFile(prefix="metrale-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "metrale.cli", "serve", "--model", str(model_dir), "--port", str(port), *args]
    env = {k: v for k, v in os.environ.items() if k not in ("METRALE_API_KEY", "VLLM_API_KEY")}
    if api_key is not None:
        env["METRALE_API_KEY"] = api_key
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    server = Server(proc, port, log.name, api_key)
    try:
        _wait_ready(server, ready_timeout)
        server.children()
        yield server
    finally:
        leftovers = _stop(server)
        log.close()
        text = server.log()
        os.unlink(log.name)
        assert not leftovers, f"left behind after shutdown: {leftovers}\n{text[-3000:]}"


@contextlib.contextmanager
def http_server(model_dir, *args: str, **kw):
    """running_server with the OpenAI HTTP API on a free port too: Server.http is its base URL."""
    port = free_port()
    with running_server(model_dir, "--http-port", str(port), *args, **kw) as server:
        server.http = f"http://127.0.0.1:{port}"
        yield server


def openai_client(server: Server, timeout: float = 60.0):
    """The official openai client on a server's HTTP API (no retries, so a failure shows)."""
    import openai

    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def _wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"metrale serve exited with {server.proc.returncode}:\n{server.log()[-3000:]}")
        if "metrale serving" in server.log():
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"metrale serve not ready in {timeout} s:\n{server.log()[-3000:]}")
        time.sleep(0.1)  # polling a log file the server writes; no event to wait on across processes


def _stop(server: Server) -> list[str]:
    """SIGTERM the supervisor, wait, then kill and report anything it left."""
    try:
        tree = {p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        tree = set()
    tree |= server.seen_pids
    left = []
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(60)
    except subprocess.TimeoutExpired:  # say so: what it did not stop is listed next
        left.append(f"the supervisor (pid {server.proc.pid}) was still running 60 s after SIGTERM (killed)")
        server.proc.kill()
        server.proc.wait()
    for pid in tree:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"process {pid} {p.cmdline()[:4]}")
                p.kill()
        except psutil.NoSuchProcess:
            pass
    for name in shm_entries(tree | {server.proc.pid}):
        left.append(f"/dev/shm/{name}")
        os.unlink(f"/dev/shm/{name}")
    return left

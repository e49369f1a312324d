"""The edges a new user hits first, through a real `metrale serve`: start-up, mistakes on the command line, ports
already taken, shutdown with streams live, and a request that grows past the checkpoint's base context."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from metrale import SamplingParams
from metrale.frontend.client import AsyncClient, Client, RequestError, ServerUnreachable

from serve_fixture import free_port, running_server, shm_entries

pytestmark = pytest.mark.slow


def serve(*args: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
    """Run `metrale serve ARGS` to its end (it is expected to fail at start-up)."""
    return subprocess.run([sys.executable, "-m", "metrale.cli", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def metrale_segments() -> set[str]:
    """metrale's /dev/shm entries whose owner process is gone (leftovers; other processes' live ones ignored)."""
    from metrale.ipc.segments import owner_pid_of

    def gone(name: str) -> bool:
        pid = owner_pid_of(name)
        return pid is not None and not os.path.exists(f"/proc/{pid}")

    return {n for n in os.listdir("/dev/shm") if n.startswith("metrale-") and gone(n)}


def lasting_leftovers(before: set[str], timeout: float = 10.0) -> set[str]:
    """Leftovers beyond `before` that outlive timeout: a process another test killed leaves its segments until its
    supervisor removes them, a moment later; a server's own leak stays."""
    deadline = time.monotonic() + timeout
    while (new := metrale_segments() - before) and time.monotonic() < deadline:
        time.sleep(0.05)  # other processes' cleanup: no event crosses the process boundary
    return new


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The one line `metrale serve` ends with on a start-up mistake (no traceback)."""
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("metrale serve: error: "), result.stderr[-2000:]
    return last


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


# ---- start-up ------------------------------------------------------------------------------------


def test_start_up_is_an_event_and_says_what_it_does(model_dir):
    """Nobody probes the client port while the engine loads (no rejection logged), and the log says what
    the start did: the model loaded, the KV cache chosen."""
    with running_server(model_dir) as s:
        log = s.log()
    assert "rejected" not in log, "the supervisor no longer probes the client port"
    assert "ready in" in log and "KV cache of" in log


@pytest.mark.parametrize("which", ["zmq", "http"])
def test_a_port_in_use_is_one_line_exit_2_and_leaves_nothing(model_dir, which):
    before = metrale_segments()
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        # --port 0: the ZMQ port any free one, so no other process can take it between a probe and the bind
        args = ["--port", str(port)] if which == "zmq" else ["--port", "0", "--http-port", str(port)]
        result = serve("--model", str(model_dir), *args)
    finally:
        taken.close()
    line = one_error_line(result)
    assert f"port {port}" in line and "cannot be bound" in line
    assert "metrale serving" not in result.stdout, "never a false 'serving'"
    assert not lasting_leftovers(before), "no shared-memory segment left behind"


def test_a_server_on_the_zmq_port_is_not_mistaken_for_ours(model_dir):
    """Another metrale server answers on the port: the new one fails (it never reports serving via the other)."""
    with running_server(model_dir) as other:
        result = serve("--model", str(model_dir), "--port", str(other.port))
        line = one_error_line(result)
        assert f"port {other.port}" in line
        with other.client() as c:  # the running one is unharmed
            assert c.complete("hi", params=SamplingParams(max_tokens=2, ignore_eos=True)).finish_reason == "length"


@pytest.mark.parametrize("args,says", [
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such file or directory"),
    (["--device", "cuda"], "--device cuda: CUDA is not available"),
    (["--max-model-len", "100000"], "max_model_len 100000 is longer than"),
])
def test_usual_mistakes_are_one_line_and_exit_2(model_dir, args, says):
    if "--model" not in args:
        args = ["--model", str(model_dir), *args]
    if "--device" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    assert says in one_error_line(serve(*args))


@pytest.mark.parametrize("args,says", [
    (["--nnodes", "2", "--node-rank", "5"], "--node-rank 5 is not one of --nnodes 2"),
    (["--nnodes", "2", "--data-parallel-size", "3"], "2 nodes need --data-parallel-size a multiple of 2"),
])
def test_a_layout_mistake_is_one_line_and_leaves_no_run_folder(model_dir, tmp_path, args, says):
    """The supervisor's run folder (sockets, health file) is made only once the layout holds."""
    result = subprocess.run([sys.executable, "-m", "metrale.cli", "serve", "--model", str(model_dir), *args],
                            capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    assert says in one_error_line(result)
    assert not list(tmp_path.glob("metrale-run-*")), "no run folder left behind"


def test_a_cpu_kernel_class_the_cpu_lacks_is_one_line(model_dir, monkeypatch):
    """METRALE_CPU_ISA naming an unknown class, or one this CPU cannot run, fails at start-up naming it."""
    from metrale import cpu_isa

    monkeypatch.setenv("METRALE_CPU_ISA", "avx1024")
    result = serve("--model", str(model_dir))
    assert one_error_line(result) == ("metrale serve: error: METRALE_CPU_ISA must be auto or one of "
                                      f"{', '.join(cpu_isa.CLASSES)} (got 'avx1024')")
    assert "frontend" not in result.stderr, "named before any process starts"
    lacking = [c for c in cpu_isa.CLASSES if c not in cpu_isa.supported()]
    if lacking:  # on a CPU that has every class there is none to ask for
        monkeypatch.setenv("METRALE_CPU_ISA", lacking[-1])
        assert f"METRALE_CPU_ISA={lacking[-1]}, but this CPU lacks" in one_error_line(serve("--model", str(model_dir)))


def test_a_folder_that_is_not_a_model_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    assert "no config.json" in one_error_line(serve("--model", str(tmp_path)))


def test_clients_fail_fast_where_nothing_listens():
    port = free_port()
    with pytest.raises(ServerUnreachable, match=f"no metrale server at tcp://127.0.0.1:{port}"):
        with Client(port=port, timeout=60) as c:
            c.complete("hi")

    async def go():
        async with AsyncClient(port=port, timeout=60) as c:
            await c.stats()

    with pytest.raises(ServerUnreachable):
        asyncio.run(go())
    result = subprocess.run([sys.executable, "-m", "metrale.cli", "generate", "--port", str(port), "hi"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr and "nothing is listening" in result.stderr


# ---- shutdown ------------------------------------------------------------------------------------


def _sse_lines(url: str, body: dict, out: list[str], first: threading.Event) -> None:
    """Read an SSE stream to its end, line by line."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line:
                out.append(line)
                first.set()


def test_sigterm_gives_every_live_stream_a_final_message(tiny_model_dir):
    """Ctrl-C / SIGTERM with a ZMQ stream and an HTTP stream live: the ZMQ one ends with Error "shutdown", the
    HTTP one with an error event and then [DONE]; the server exits 0 and leaves nothing."""
    http_port = free_port()
    long = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)  # still running at the signal
    with running_server(tiny_model_dir("llama", max_position_embeddings=4096), "--http-port", str(http_port)) as s:
        lines: list[str] = []
        sse_started = threading.Event()
        reader = threading.Thread(target=_sse_lines, daemon=True, args=(
            f"http://127.0.0.1:{http_port}/v1/completions",
            {"prompt": "x", "max_tokens": 3000, "stream": True, "ignore_eos": True}, lines, sse_started))
        reader.start()
        with s.client(timeout=60) as c:
            stream = c.generate("once upon a time", params=long)
            next(stream)
            assert sse_started.wait(60)
            s.proc.send_signal(signal.SIGTERM)
            with pytest.raises(RequestError) as err:
                for _ in stream:
                    pass
        assert err.value.code == "shutdown"
        reader.join(60)
        assert lines[-1] == "data: [DONE]"
        event = json.loads(lines[-2][len("data: "):])
        assert event["error"]["code"] == "shutting_down"
        assert s.proc.wait(60) == 0


def test_shutdown_timeout_lets_live_requests_finish_and_refuses_new_ones(model_dir):
    with running_server(model_dir, "--shutdown-timeout", "60") as s:
        with s.client(timeout=60) as c:
            stream = c.generate("a", params=SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
            got = list(next(stream).token_ids)
            s.proc.send_signal(signal.SIGTERM)
            while c.health().ready:  # the supervisor passes the signal on to the frontend
                time.sleep(0.02)  # polling the server's health: no event crosses the processes
            with pytest.raises(RequestError) as refused:
                c.complete("b", params=SamplingParams(max_tokens=2))
            for delta in stream:
                got += delta.token_ids
                last = delta
        assert refused.value.code == "shutdown"
        assert last.finish_reason == "length" and len(got) == 200, "the live request finished"
        assert s.proc.wait(60) == 0


# ---- a request past the checkpoint's base context ----------------------------------------------------


def test_a_sequence_past_max_position_embeddings_under_rope_scaling_serves(tiny_model_dir):
    """Linear rope scaling (factor 2) stretches a 64-position checkpoint to 128: a request growing past 64 is
    served to its end by the same engine core (the ring, the engine and the worker agree on max_model_len)."""
    scaled = tiny_model_dir("llama", max_position_embeddings=64, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with running_server(scaled) as s:
        engine = s.children()["engine_core"]
        with s.client(timeout=60) as c:
            assert c.model_info().max_model_len == 128
            out = c.complete(token_ids=list(range(3, 53)), params=SamplingParams(max_tokens=70, temperature=0.0,
                                                                                  ignore_eos=True))
        assert out.finish_reason == "length" and len(out.token_ids) == 70
        assert s.children()["engine_core"] == engine, "the engine core never died"
        assert not shm_entries(set())

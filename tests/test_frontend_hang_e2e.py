"""A frontend SIGSTOPped under clients, end to end: nothing continues it; the supervisor's hang watch
(--frontend-hang-timeout, metrale/frontend_heartbeat.py) finds its heartbeat silent, kills it and restarts it on the
same ports. ZMQ clients re-attach to their requests: every stream equals the fault-free run, no token twice. An HTTP
stream is cut (no [DONE]) and a retry under its request id re-attaches to the request that ran on."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import random
import signal
import uuid

import psutil
import pytest

from serve_fixture import http_server
from test_faults_e2e import N, _run_clients_with_fault, expected, model_dir, one_request_works, wait_idle  # noqa: F401
from test_faults_e2e import wait_recovered
from test_frontend_restart_e2e import MAX_TOKENS, _sse
from test_http_api import http as http_call

pytestmark = pytest.mark.slow

HANG_TIMEOUT_S = "3"  # short, so the test is; the watch's beat comes 4 times a second


@pytest.fixture
def server(model_dir):  # noqa: F811
    """A server of its own per test: a frontend restarted by the watch ~1 s after its start was, in this sequence, not
    seen to beat again (its counter stayed 0, so a second stop went unnoticed); open, see the report of issue 38."""
    with http_server(model_dir, "--frontend-hang-timeout", HANG_TIMEOUT_S) as s:
        yield s


@contextlib.contextmanager
def stopped_frontend(server):
    """Yield a function that SIGSTOPs the live frontend (and returns its pid); on the way out, a frontend the test
    stopped that still exists (the watch failed) is killed, so nothing the test did outlives it."""
    stopped: list[int] = []

    def stop() -> int:
        pid = server.children()["frontend"]
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        return pid

    try:
        yield stop
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def replaced(server, pid: int) -> dict[str, int]:
    """wait_recovered, with the server's log in the failure (whether the watch fired, the restart failed, ...)."""
    try:
        return wait_recovered(server, "frontend", pid)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{server.log()[-4000:]}") from None


def assert_killed_as_hung(server, pid: int) -> None:
    """The stopped frontend was killed (never continued) and the supervisor said why, once."""
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    lines = [line for line in server.log().splitlines() if f"frontend (pid {pid}) hung: its event loop" in line]
    assert len(lines) == 1, server.log()[-3000:]


def test_a_stopped_frontend_under_zmq_streams_is_replaced_and_loses_nothing(server, expected):  # noqa: F811
    """SIGSTOP the frontend while three async clients and a sync one stream 32 requests: the watch kills it, the
    supervisor restarts it, the clients re-attach, and every stream equals the fault-free run."""
    old = server.children()
    stop_after = random.Random(os.getpid()).randint(64, 700)  # generated tokens, of 32 * 48
    under_way = lambda seen: sum(seen) >= stop_after and all(n >= 1 for n in seen)  # noqa: E731
    with stopped_frontend(server) as stop:
        got = asyncio.run(_run_clients_with_fault(server.port, under_way, stop))
        assert [g[2] for g in got] == [None] * N, f"no client sees an error (stopped after {stop_after} tokens)"
        assert [g[0] for g in got] == expected, f"stopped after {stop_after} tokens"
        assert all(g[1] == "length" for g in got)
        new = replaced(server, old["frontend"])
        assert new["engine_core"] == old["engine_core"], "the engine core ran on"
        assert_killed_as_hung(server, old["frontend"])
    one_request_works(server)
    wait_idle(server)


def test_a_stopped_frontend_cuts_an_http_stream_cleanly_and_a_retry_reattaches(server, model_dir):  # noqa: F811
    """An SSE stream whose frontend is stopped ends without [DONE] once the watch kills it; the retry under the same
    X-Request-Id answers the whole output of the request that ran on (unseeded sampling: a fresh start differs)."""
    rid = uuid.uuid4().hex
    body = {"model": model_dir.name, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "temperature": 1.0,
            "ignore_eos": True, "stream": True}
    text, done, pid = [], False, None
    with stopped_frontend(server) as stop:
        try:
            for chunk in _sse(server, body, {"X-Request-Id": rid}):
                if chunk is None:
                    done = True
                    break
                text.append(chunk["choices"][0]["text"])
                if len(text) == 8:
                    pid = stop()
        except (http.client.HTTPException, OSError) as e:  # the connection reset by the kill
            assert pid is not None, f"the stream broke before the stop: {e}"
        assert pid is not None and not done, "the stream was cut, after some text"
        replaced(server, pid)
        assert_killed_as_hung(server, pid)
    status, whole = http_call("POST", server.http + "/v1/completions", {**body, "stream": False, "request_id": rid})
    assert status == 200, whole
    assert whole["choices"][0]["text"].startswith("".join(text)), "re-attached to the request that ran on"
    assert whole["usage"]["completion_tokens"] == MAX_TOKENS
    wait_idle(server)

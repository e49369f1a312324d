"""Tensor parallel through `metrale serve --tensor-parallel-size 2`: the tokens of one worker, and the fault story.

One server for the module (each start costs seconds here). Its 32 streams, greedy and seeded, equal the offline
engine's with one rank; SIGKILL of rank 1 mid-stream takes the group down, the supervisor restarts both ranks
and every stream completes unchanged; SIGSTOP of rank 1 stalls rank 0 in its collective, which the engine
core's hang watch catches like a hung single worker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from metrale.frontend.client import RequestError

from serve_fixture import offline_tokens, running_server, shm_entries
from test_faults_e2e import N, PROMPTS, _run_with_fault, params_for, wait_idle


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def expected(model_dir):
    """The offline engine's tokens with one rank and no fault."""
    return offline_tokens(model_dir, PROMPTS, [params_for(i) for i in range(N)])


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir, "--tensor-parallel-size", "2", "--worker-hang-timeout", "3") as s:
        yield s


def ranks(server) -> dict[int, int]:
    """rank -> pid of the worker group's live ranks, from the server's health."""
    with server.client(timeout=10) as c:
        health = c.health()
    out = {p.rank: p.pid for p in health.processes if p.name == "gpu_worker" and p.alive}
    server.seen_pids.update(p.pid for p in health.processes)
    return out


def wait_group_replaced(server, old: dict[int, int], timeout: float = 90.0) -> dict[int, int]:
    """Wait until both ranks run with new pids and the server is healthy; return them."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            new = ranks(server)
            with server.client(timeout=2) as c:
                healthy = c.health().healthy
            if len(new) == 2 and not set(new.values()) & set(old.values()) and healthy:
                return new
        except (TimeoutError, RequestError):
            pass
        assert time.monotonic() < deadline, f"the worker group was not replaced in {timeout} s"
        time.sleep(0.05)  # polling the supervisor's health; no event to wait on across processes


def test_two_ranks_serve_the_tokens_of_one(server, expected):
    """32 concurrent streams on a group of two ranks: token for token the single-rank offline engine's."""
    got = asyncio.run(_run_with_fault(server.port, lambda seen: True, lambda: None))
    assert [g[2] for g in got] == [None] * N
    assert [g[0] for g in got] == expected
    pids = ranks(server)
    assert sorted(pids) == [0, 1]
    out = subprocess.run([sys.executable, "-m", "metrale.cli", "status", "--port", str(server.port)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert f"pid {pids[1]}" in out and "rank 1" in out, out


def test_sigkill_of_rank_1_under_32_streams_loses_nothing(server, expected):
    """SIGKILL rank 1 mid-stream: the group goes down (rank 0 too), both ranks restart, and all 32 streams
    complete identical to a fault-free run."""
    old = ranks(server)
    with server.client() as c:
        restarts = next(p.restarts for p in c.health().processes if p.name == "gpu_worker")
    kill = lambda: os.kill(old[1], signal.SIGKILL)  # noqa: E731
    got = asyncio.run(_run_with_fault(server.port, lambda seen: sum(seen) >= 300, kill))
    assert [g[2] for g in got] == [None] * N, "no client sees an error"
    assert [g[0] for g in got] == expected
    new = wait_group_replaced(server, old)
    with server.client() as c:
        health = c.health()
    assert f"gpu_worker rank 1 (pid {old[1]}) was killed by SIGKILL" in health.last_fault
    assert all(p.restarts == restarts + 1 for p in health.processes if p.name == "gpu_worker")
    engine = next(p.pid for p in health.processes if p.name == "engine_core")
    assert sorted(shm_entries({engine, *old.values(), *new.values()})) == sorted(shm_entries({engine})), \
        "no all-reduce segment left by the dead group"
    wait_idle(server)


def test_a_stopped_rank_is_caught_as_a_hung_group(server, expected):
    """SIGSTOP rank 1 under 16 streams: rank 0 waits in its all-reduce, the engine core's hang watch kills the
    group, the supervisor restarts it, and every stream completes unchanged."""
    old = ranks(server)
    stop = lambda: os.kill(old[1], signal.SIGSTOP)  # noqa: E731
    got = asyncio.run(_run_with_fault(server.port, lambda seen: sum(seen) >= 100, stop, range(16)))
    assert [g[2] for g in got] == [None] * 16
    assert [g[0] for g in got] == expected[:16]
    wait_group_replaced(server, old)
    with server.client() as c:
        health = c.health()
    assert "hung" in health.last_fault and "no progress" in health.last_fault and str(old[1]) in health.last_fault
    wait_idle(server)

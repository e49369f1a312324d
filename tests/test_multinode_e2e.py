"""Two "nodes" on loopback: `metrale serve --nnodes 2 --node-rank 0` and `--node-rank 1` meeting at a master port.

Tensor parallel across the nodes (rank 1 on node 1 gets its plans from rank 0 over gloo) and data parallel
across them (replica 1's engine core on node 1 reaches node 0's frontend over TCP) both serve the offline engine's
tokens; a rank killed on node 1 restarts the whole group on both nodes with nothing lost; node 1 stops when
node 0 does, and neither leaves a process or a segment behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest


from serve_fixture import free_port, offline_tokens, running_server, shm_entries
from test_faults_e2e import PROMPTS, _run_with_fault, params_for, wait_idle

STREAMS = 8


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def expected(model_dir):
    return offline_tokens(model_dir, PROMPTS[:STREAMS], [params_for(i) for i in range(STREAMS)])


def _tree(proc: subprocess.Popen) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def worker_pids(proc: subprocess.Popen) -> list[int]:
    """The worker ranks a node's supervisor runs now."""
    out = []
    for pid in _tree(proc):
        try:
            if "metrale.gpu_worker.worker" in " ".join(psutil.Process(pid).cmdline()):
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


@contextlib.contextmanager
def two_nodes(model_dir, *args: str):
    """Yield (node 0's Server, node 1's supervisor process); on exit node 0 is stopped, node 1 must follow."""
    master = str(free_port())
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", master, *args]
    log = tempfile.NamedTemporaryFile(prefix="metrale-node1-", suffix=".log", delete=False)
    node1 = subprocess.Popen([sys.executable, "-m", "metrale.cli", "serve", "--model", str(model_dir), *common,
                              "--node-rank", "1"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    seen: set[int] = set()
    try:
        with running_server(model_dir, *common, "--node-rank", "0") as server:
            seen |= _tree(node1)
            yield server, node1, seen
        assert node1.wait(60) == 0, "node 1 stops when node 0 does"
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
        log.close()
        text = open(log.name, errors="replace").read()
        os.unlink(log.name)
        left = [pid for pid in seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        segments = shm_entries(seen | {node1.pid})
        for name in segments:
            os.unlink(f"/dev/shm/{name}")
        assert not left and not segments, f"node 1 left {left} {segments}\n{text[-3000:]}"


def test_tensor_parallel_across_two_nodes_and_a_rank_killed_on_node_1(model_dir, expected):
    """TP=2 with one rank per node, SIGKILL of node 1's rank mid-stream: the group restarts on both nodes (a fresh
    generation at node 0's store) and every stream completes with the offline engine's tokens."""
    with two_nodes(model_dir, "--tensor-parallel-size", "2") as (server, node1, seen):
        (remote,) = worker_pids(node1)
        local = server.children()["gpu_worker"]
        kill = lambda: os.kill(remote, signal.SIGKILL)  # noqa: E731
        got = asyncio.run(_run_with_fault(server.port, lambda seen: sum(seen) >= 60, kill, range(STREAMS)))
        assert [g[2] for g in got] == [None] * STREAMS
        assert [g[0] for g in got] == expected
        assert server.children()["gpu_worker"] != local, "node 0's rank restarted with the group"
        deadline = time.monotonic() + 60
        while worker_pids(node1) in ([], [remote]):
            assert time.monotonic() < deadline, "node 1 did not start its rank of the new generation"
            time.sleep(0.05)  # polling node 1's process table; no event crosses the nodes
        seen |= _tree(node1)
        wait_idle(server)


def test_data_parallel_across_two_nodes(model_dir, expected):
    """DP=2 with one replica per node: the offline tokens, and replica 1 (on node 1) served some of them."""
    with two_nodes(model_dir, "--data-parallel-size", "2") as (server, node1, seen):
        got = asyncio.run(_run_with_fault(server.port, lambda seen: True, lambda: None, range(STREAMS)))
        assert [g[0] for g in got] == expected and [g[2] for g in got] == [None] * STREAMS
        with server.client() as c:
            replicas = c.stats().replicas
        assert len(replicas) == 2 and all(r.generated_tokens > 0 for r in replicas)
        seen |= _tree(node1)

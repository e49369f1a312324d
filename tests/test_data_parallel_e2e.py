"""Data parallel through `metrale serve --data-parallel-size 2`: two engine cores behind one frontend.

One server for the module. Its streams equal the offline engine's whichever replica runs them; a shared-prefix
workload keeps each prefix on one replica (the prefix-cache hit rate is at least a single engine's); and a
replica that dies has its requests moved to the other at once, which never stops serving.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.frontend.client import AsyncClient

from serve_fixture import offline_tokens, running_server
from test_faults_e2e import N, PROMPTS, _run_with_fault, params_for, wait_idle


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def expected(model_dir):
    """The offline engine's tokens with no fault."""
    return offline_tokens(model_dir, PROMPTS, [params_for(i) for i in range(N)])


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir, "--data-parallel-size", "2", "--http-port", "0") as s:
        yield s


def processes(server) -> dict[tuple[str, int], tuple[int, int]]:
    """(name, replica) -> (pid, restarts) of the server's processes (rank 0 of each worker group)."""
    with server.client(timeout=10) as c:
        health = c.health()
    server.seen_pids.update(p.pid for p in health.processes)
    return {(p.name, p.replica): (p.pid, p.restarts) for p in health.processes if p.rank == 0}


def replica_stats(server):
    with server.client(timeout=10) as c:
        return c.stats().replicas


def test_two_replicas_serve_the_offline_tokens_and_share_the_work(server, expected):
    """32 streams over two replicas: the offline engine's tokens; both replicas ran some; `metrale status` and the
    stats report each replica."""
    before = [r.generated_tokens for r in replica_stats(server)]
    got = asyncio.run(_run_with_fault(server.port, lambda seen: True, lambda: None))
    assert [g[2] for g in got] == [None] * N
    assert [g[0] for g in got] == expected
    after = [r.generated_tokens for r in replica_stats(server)]
    assert len(after) == 2 and all(a > b for a, b in zip(after, before)), f"each replica served: {before} -> {after}"
    out = subprocess.run([sys.executable, "-m", "metrale.cli", "status", "--port", str(server.port)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "engine_core" in out and "replica 1" in out and out.count("tokens generated") == 3, out
    http = re.search(r"HTTP on (http://\S+)", server.log()).group(1)
    with urllib.request.urlopen(f"{http}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    for line in ('metrale_replica_generated_tokens{replica="0"}', 'metrale_replica_generated_tokens{replica="1"}',
                 'metrale_process_up{process="gpu_worker",replica="1"} 1.0'):
        assert line in metrics, line


def _shared_prefix_workload(groups: int = 4, per_group: int = 8, prefix_len: int = 64):
    """Prompts of `groups` distinct 64-token prefixes, each with its own suffix: first one of each group (which
    caches its prefix), then the rest together, group after group (so that balancing alone would split each
    group over both replicas)."""
    rng = np.random.default_rng(11)
    prefixes = [rng.integers(16, 500, size=prefix_len).tolist() for _ in range(groups)]
    prompts = [[p + rng.integers(16, 500, size=5 + j).tolist() for j in range(per_group)] for p in prefixes]
    return [g[0] for g in prompts], [q for g in prompts for q in g[1:]]


SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_shared_prefixes_stay_on_one_replica(server, model_dir):
    """A shared-prefix workload: its prefix-cache hit rate over both replicas is at least one engine's."""
    warm, rest = _shared_prefix_workload()
    with LLM(str(model_dir), show_progress=False) as llm:
        for prompt in warm:  # one by one: each caches its prefix before the next arrives
            llm.generate([prompt], SHORT)
        llm.generate(rest, SHORT)
        single = llm.engine.pool.stats.hit_rate

    def totals():
        with server.client(timeout=10) as c:
            s = c.stats()
        return s.prefix_cache_hit_tokens, s.prefix_cache_queried_tokens

    hits0, queried0 = totals()

    async def run():
        async with AsyncClient("127.0.0.1", server.port, timeout=60) as client:
            for prompt in warm:
                await client.complete(token_ids=prompt, params=SHORT)
            await asyncio.gather(*(client.complete(token_ids=p, params=SHORT) for p in rest))

    asyncio.run(run())
    hits1, queried1 = totals()
    dp2 = (hits1 - hits0) / (queried1 - queried0)
    print(f"prefix-cache hit rate: DP=2 {dp2:.3f}, one engine {single:.3f}")
    assert dp2 >= single - 1e-9, f"DP=2 hit rate {dp2:.3f} below one engine's {single:.3f}"


def test_sigkill_of_a_replica_under_32_streams_moves_its_requests(server, expected):
    """SIGKILL replica 0's engine core mid-stream: its requests move to replica 1 at once and continue from their
    tokens (32/32 identical); replica 1 is never restarted; the restarted replica 0 has nothing left to run."""
    old = processes(server)
    with server.client() as c:
        assert c.stats().replicas[0].running == 0
    kill = lambda: os.kill(old[("engine_core", 0)][0], signal.SIGKILL)  # noqa: E731
    got = asyncio.run(_run_with_fault(server.port, lambda seen: sum(seen) >= 200, kill))
    assert [g[2] for g in got] == [None] * N, "no client sees an error"
    assert [g[0] for g in got] == expected
    deadline = time.monotonic() + 90
    while True:  # replica 0 comes back on its own
        new = processes(server)
        with server.client(timeout=10) as c:
            ready = c.health().replicas_ready
        if new[("engine_core", 0)][0] != old[("engine_core", 0)][0] and ready == [True, True]:
            break
        assert time.monotonic() < deadline, "replica 0 was not restarted"
        time.sleep(0.05)  # polling the supervisor's health; no event to wait on across processes
    assert new[("engine_core", 1)] == old[("engine_core", 1)], "replica 1's engine core never restarted"
    assert new[("gpu_worker", 1)] == old[("gpu_worker", 1)], "replica 1's worker never restarted"
    assert replica_stats(server)[0].generated_tokens == 0, "every moved request finished on replica 1"
    wait_idle(server)


def test_a_replica_whose_worker_dies_hands_its_requests_over(server, expected):
    """SIGKILL replica 1's worker: its engine core lives and says so (WorkerLost); its requests move to replica 0
    at once; all 16 streams are unchanged."""
    old = processes(server)
    at_kill = []

    def kill() -> None:
        at_kill.append(replica_stats(server)[1])
        os.kill(old[("gpu_worker", 1)][0], signal.SIGKILL)

    got = asyncio.run(_run_with_fault(server.port, lambda seen: sum(seen) >= 100, kill, range(16)))
    assert [g[2] for g in got] == [None] * 16
    assert [g[0] for g in got] == expected[:16]
    new = processes(server)
    assert new[("engine_core", 1)] == old[("engine_core", 1)], "its engine core lived on"
    assert at_kill[0].running > 0, "replica 1 was running requests when its worker died"
    wait_idle(server)
    after = replica_stats(server)[1]
    assert after.prefix_cache_queried_tokens == at_kill[0].prefix_cache_queried_tokens, \
        "replica 1 never ran its requests again: they had moved to replica 0"


DIGITS = r"[0-9]{24,40}"


def structured_params(i: int) -> SamplingParams:
    """A regex grammar, greedy and seeded; the grammar ends each request (a stop) well within max_tokens."""
    from metrale.ipc.sampling import StructuredOutputs

    so = StructuredOutputs(regex=DIGITS)
    if i % 2:
        return SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=so)
    return SamplingParams(max_tokens=64, temperature=0.9, seed=8000 + i, structured_outputs=so)


def test_structured_requests_move_with_their_grammar(server, model_dir):
    """SIGKILL replica 0's engine core under 16 grammar streams: they move to replica 1 with their grammar and
    tokens so far and end as the offline engine ends them, in the grammar; once replica 0 is back (a fresh engine
    core, which must be sent the grammar vocabulary again) 16 more grammar streams are unchanged too."""
    indices = range(16)
    with LLM(str(model_dir), show_progress=False) as llm:
        want = [r.token_ids for r in llm.generate([PROMPTS[i] for i in indices], [structured_params(i) for i in indices])]
    old = processes(server)
    kill = lambda: os.kill(old[("engine_core", 0)][0], signal.SIGKILL)  # noqa: E731
    got = asyncio.run(_run_with_fault(server.port, lambda seen: sum(seen) >= 60, kill, indices, structured_params))
    assert [g[2] for g in got] == [None] * 16, "no client sees an error"
    assert [g[0] for g in got] == want
    assert all(g[1] == "stop" for g in got)
    deadline = time.monotonic() + 90
    while True:  # replica 0 comes back on its own
        with server.client(timeout=10) as c:
            ready = c.health().replicas_ready
        if processes(server)[("engine_core", 0)][0] != old[("engine_core", 0)][0] and ready == [True, True]:
            break
        assert time.monotonic() < deadline, "replica 0 was not restarted"
        time.sleep(0.05)  # polling the supervisor's health; no event to wait on across processes
    again = asyncio.run(_run_with_fault(server.port, lambda seen: True, lambda: None, indices, structured_params))
    assert [g[2] for g in again] == [None] * 16 and [g[0] for g in again] == want
    assert replica_stats(server)[0].generated_tokens > 0, "the fresh replica 0 ran grammar requests"
    wait_idle(server)


def test_frontend_sigkill_over_two_replicas_loses_nothing(server, expected):
    """SIGKILL the frontend while clients stream 32 requests over two replicas: each Resume finds the replica that
    holds its request (the new frontend asks each in turn), and every stream equals the fault-free run."""
    from test_faults_e2e import _run_clients_with_fault, wait_recovered

    old = processes(server)[("frontend", 0)][0]
    under_way = lambda seen: all(n >= 2 for n in seen)  # noqa: E731
    got = asyncio.run(_run_clients_with_fault(server.port, under_way, lambda: os.kill(old, signal.SIGKILL)))
    assert [g[2] for g in got] == [None] * N
    assert [g[0] for g in got] == expected
    wait_recovered(server, "frontend", old)
    wait_idle(server)

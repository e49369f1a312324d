"""Faults end to end: SIGKILL the worker, the engine core, the frontend or a client of a real `metrale serve`.

Streams of greedy and seeded requests are compared with the offline engine (metrale.LLM) on the same requests:
a fault the server recovers from changes no token. The restart policy itself (backoff, giving up) is tested
on Supervisor.check_children with short-lived stand-in children and an injected clock.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from metrale import SamplingParams
from metrale.config import EngineArgs, ServeConfig
from metrale.frontend.client import AsyncClient, Client, RequestError
from metrale.supervisor import Child, RestartPolicy, Supervisor
from metrale.testing.fake_device import FakeClock

from serve_fixture import offline_tokens, running_server, shm_entries

N = 32
PROMPTS = [f"def g{i}(y):\n    return y - {i} * " for i in range(N)]
MAX_TOKENS = 48


def params_for(i: int, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    """Half greedy, half seeded sampling."""
    if i % 2:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=7000 + i, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def expected(model_dir):
    """What the offline engine gives for the same requests, with no fault."""
    return offline_tokens(model_dir, PROMPTS, [params_for(i) for i in range(N)])


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir) as s:
        yield s


# ---- helpers ---------------------------------------------------------------------------


async def _run_with_fault(port: int, when, fault, indices=range(N), params=params_for, timeout: float = 120.0,
                          api_key: str | None = None):
    """Stream the requests at once; call fault() as soon as when(seen) holds (seen: tokens per request so far).

    Returns (token ids, finish reason, error) per request: a RequestError or a timeout is returned, not raised."""
    seen = [0] * N
    under_way = asyncio.Event()

    async def one(client: AsyncClient, i: int):
        ids, finish = [], None
        try:
            async for d in client.generate(PROMPTS[i], params=params(i)):
                ids += d.token_ids
                seen[i] += len(d.token_ids)
                finish = d.finish_reason or finish
                if when(seen):
                    under_way.set()
        except (RequestError, TimeoutError) as e:
            return ids, finish, e
        return ids, finish, None

    async with AsyncClient("127.0.0.1", port, timeout=timeout, api_key=api_key) as client:
        tasks = [asyncio.ensure_future(one(client, i)) for i in indices]
        await asyncio.wait_for(under_way.wait(), 60)
        fault()
        return await asyncio.gather(*tasks)


def wait_recovered(server, replaced: str, old_pid: int, timeout: float = 60.0) -> dict[str, int]:
    """Wait until the `replaced` process has a new pid and every process is up; return the pids."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with server.client(timeout=2) as c:
                health = c.health()
            pids = {p.name: p.pid for p in health.processes}
            server.seen_pids.update(pids.values())
            if pids[replaced] != old_pid and all(p.alive for p in health.processes):
                return pids
        except (TimeoutError, RequestError):
            pass  # the frontend itself may be restarting
        assert time.monotonic() < deadline, f"{replaced} was not replaced in {timeout} s"
        time.sleep(0.05)  # polling the supervisor's health; there is no event to wait on across processes


def wait_idle(server, timeout: float = 10.0):
    """Wait until the engine runs nothing and holds no KV block; return its stats."""
    deadline = time.monotonic() + timeout
    with server.client(timeout=10) as c:
        while True:
            stats = c.stats()
            if stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0:
                return stats
            assert time.monotonic() < deadline, f"the engine is not idle: {stats}"
            time.sleep(0.02)  # polling the engine's counters: aborts and retirements are asynchronous


def one_request_works(server) -> None:
    """A fresh request completes normally."""
    with server.client(timeout=60) as c:
        out = c.complete(PROMPTS[1], params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def supervisor_children(server) -> list[psutil.Process]:
    """The supervisor's direct children (the three it runs, and nothing else)."""
    return psutil.Process(server.proc.pid).children()


# ---- worker and engine-core death ---------------------------------------------------------


def test_engine_core_sigkill_under_32_streams_loses_nothing(server, expected):
    """SIGKILL the engine core mid-stream: a fresh engine and worker take over; every stream completes unchanged."""
    old = server.children()
    kill_after = random.Random(os.getpid()).randint(100, 900)  # generated tokens, of 32 * 48

    kill = lambda: os.kill(old["engine_core"], signal.SIGKILL)  # noqa: E731
    got = asyncio.run(_run_with_fault(server.port, lambda seen: sum(seen) >= kill_after, kill))
    assert [g[2] for g in got] == [None] * N, f"no client sees an error (killed after {kill_after} tokens)"
    assert [g[0] for g in got] == expected, f"killed after {kill_after} tokens"
    assert all(g[1] == "length" for g in got)
    new = wait_recovered(server, "engine_core", old["engine_core"])
    assert new["gpu_worker"] != old["gpu_worker"], "a fresh worker comes with the fresh engine core"
    assert shm_entries({old["engine_core"]}) == [], "the dead engine's ring was swept"
    with server.client() as c:
        health = c.health()
    assert "engine_core" in health.last_fault and health.healthy
    wait_idle(server)


def _handles(server, pids: dict[str, int], survivors=("frontend", "engine_core")) -> dict[str, tuple[int, int]]:
    """(open descriptors, threads) of the supervisor and the survivors of a fault (by child name)."""
    procs = {"supervisor": server.proc.pid, **{name: pids[name] for name in survivors}}
    return {name: (psutil.Process(pid).num_fds(), psutil.Process(pid).num_threads()) for name, pid in procs.items()}


def _no_more_handles(server, pids: dict[str, int], baseline: dict[str, tuple[int, int]], timeout: float = 10.0):
    """Wait until no survivor holds more descriptors or threads than baseline (a client's connection is closed
    by the server asynchronously); assert it within timeout."""
    survivors = [name for name in baseline if name != "supervisor"]
    grew = lambda: any(a > b for name, now in _handles(server, pids, survivors).items()  # noqa: E731
                       for a, b in zip(now, baseline[name]))
    deadline = time.monotonic() + timeout
    while grew():
        assert time.monotonic() < deadline, f"handles grew: {_handles(server, pids, survivors)} (was {baseline})"
        time.sleep(0.05)  # polling other processes' counts: no event crosses the boundary


def test_repeated_worker_kills_leak_nothing(server, expected):
    """Five worker kills in a row, each after the server recovered: no leaked segment, process, KV block, descriptor
    or thread (the survivors' counts after the first recovery are the baseline: that one may open what stays)."""
    before = server.children()
    shm_before = sorted(shm_entries({before["engine_core"]}))
    with server.client() as c:
        restarts = {p.name: p.restarts for p in c.health().processes}
    pids = before
    handles = None
    for k in range(5):
        i = 2 * k + 1  # greedy and seeded in turn
        worker = pids["gpu_worker"]

        kill = lambda worker=worker: os.kill(worker, signal.SIGKILL)  # noqa: E731
        (ids, finish, error), = asyncio.run(_run_with_fault(server.port, lambda seen, i=i: seen[i] >= 8, kill, indices=[i]))
        assert error is None and finish == "length" and ids == expected[i], f"kill {k}"
        pids = wait_recovered(server, "gpu_worker", worker)
        stats = wait_idle(server)
        assert stats.kv_blocks_free + stats.kv_blocks_cached == stats.kv_blocks_total
        assert len(supervisor_children(server)) == 3, "no process left over"
        assert sorted(shm_entries({pids["engine_core"]})) == shm_before, "no segment left over"
        if handles is None:
            handles = _handles(server, pids)
        else:
            _no_more_handles(server, pids, handles)
    with server.client() as c:
        health = c.health()
    after = {p.name: p.restarts for p in health.processes}
    assert after["gpu_worker"] == restarts["gpu_worker"] + 5
    assert after["engine_core"] == restarts["engine_core"] and pids["engine_core"] == before["engine_core"]
    assert health.healthy, "kills spaced by recovery are not a crash loop"


def test_status_command_shows_restarts_and_the_last_fault(server):
    """`metrale status` prints each process's pid, uptime and restarts, and the last fault."""
    old = server.children()
    with server.client() as c:
        restarts = {p.name: p.restarts for p in c.health().processes}
    os.kill(old["gpu_worker"], signal.SIGKILL)
    new = wait_recovered(server, "gpu_worker", old["gpu_worker"])
    out = subprocess.run(
        [sys.executable, "-m", "metrale.cli", "status", "--port", str(server.port)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    for name, pid in new.items():
        line = next(line for line in out.splitlines() if line.split()[:1] == [name])
        assert f"pid {pid}" in line and "up " in line
        assert f"restarts {restarts[name] + (name == 'gpu_worker')}" in line
    assert f"last fault: gpu_worker (pid {old['gpu_worker']}) was killed by SIGKILL" in out


def test_client_killed_mid_stream_has_its_request_aborted(server):
    """SIGKILL a client process mid-stream: the server aborts its request and frees its blocks."""
    script = (
        "import sys\n"
        "from metrale.frontend.client import Client\n"
        "from metrale import SamplingParams\n"
        f"with Client('127.0.0.1', {server.port}) as c:\n"
        "    for d in c.generate('once upon a time', params=SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)):\n"
        "        print(len(d.token_ids), flush=True)\n"
    )
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(5):  # a few deltas: the request runs
            assert client.stdout.readline(), "the client's stream ended early"
        with server.client() as c:
            assert c.stats().running == 1
        client.kill()
        client.wait(10)
        killed = time.monotonic()
        wait_idle(server, timeout=5.0)
        assert time.monotonic() - killed < 2.0, "aborted within a short bound"
    finally:
        client.kill()
        client.wait(10)
        client.stdout.close()


async def _run_clients_with_fault(port: int, when, fault, clients: int = 3, sync_share: int = 4) -> list:
    """_run_with_fault over several clients at once: `clients` AsyncClients share the first N - sync_share requests,
    and a sync Client streams the rest from a thread. Returns (token ids, finish reason, error) per request."""
    seen = [0] * N
    under_way = threading.Event()

    def note(i: int, d) -> None:
        seen[i] += len(d.token_ids)
        if when(seen):
            under_way.set()

    async def one(client: AsyncClient, i: int):
        ids, finish = [], None
        try:
            async for d in client.generate(PROMPTS[i], params=params_for(i)):
                ids += d.token_ids
                finish = d.finish_reason or finish
                note(i, d)
        except (RequestError, TimeoutError) as e:
            return ids, finish, e
        return ids, finish, None

    def sync_streams(indices) -> list:
        got = [None] * len(indices)
        with Client("127.0.0.1", port, timeout=120.0) as client:
            streams = [client.generate(PROMPTS[i], params=params_for(i)) for i in indices]
            for k, (i, stream) in enumerate(zip(indices, streams)):
                ids, finish, error = [], None, None
                try:
                    for d in stream:
                        ids += d.token_ids
                        finish = d.finish_reason or finish
                        note(i, d)
                except (RequestError, TimeoutError) as e:
                    error = e
                got[k] = (ids, finish, error)
        return got

    loop = asyncio.get_running_loop()
    async_part = N - sync_share
    sync_task = loop.run_in_executor(None, sync_streams, list(range(async_part, N)))
    async_clients = [AsyncClient("127.0.0.1", port, timeout=120.0) for _ in range(clients)]
    try:
        tasks = [asyncio.ensure_future(one(async_clients[i % clients], i)) for i in range(async_part)]
        assert await loop.run_in_executor(None, under_way.wait, 60), "the streams did not get under way"
        fault()
        return [*await asyncio.gather(*tasks), *await sync_task]
    finally:
        for c in async_clients:
            await c.close()


def test_frontend_sigkill_under_streaming_clients_loses_nothing(server, expected):
    """SIGKILL the frontend while three async clients and a sync one stream 32 requests: the supervisor restarts it
    on the same port, each client reconnects and re-attaches its requests where their streams were, and every stream
    equals the fault-free run (no token twice, none lost); the engine core ends idle."""
    old = server.children()
    kill_after = random.Random(os.getpid()).randint(64, 700)  # generated tokens, of 32 * 48
    under_way = lambda seen: sum(seen) >= kill_after and all(n >= 1 for n in seen)  # noqa: E731

    kill = lambda: os.kill(old["frontend"], signal.SIGKILL)  # noqa: E731
    got = asyncio.run(_run_clients_with_fault(server.port, under_way, kill))
    assert [g[2] for g in got] == [None] * N, f"no client sees an error (killed after {kill_after} tokens)"
    assert [g[0] for g in got] == expected, f"killed after {kill_after} tokens"
    assert all(g[1] == "length" for g in got)
    new = wait_recovered(server, "frontend", old["frontend"])
    assert new["engine_core"] == old["engine_core"], "the engine core ran on"
    one_request_works(server)
    wait_idle(server)


@pytest.mark.parametrize("victim", ["frontend", "engine_core"])
def test_repeated_kills_of_a_process_leave_its_survivors_no_descriptor_or_thread(model_dir, victim):
    """Four SIGKILLs of the frontend (or the engine core), each after recovery and a request: the supervisor and
    the process that lived through them hold no more descriptors or threads than after the first recovery. (A
    server of its own: four quick deaths are four of the five in a row after which the supervisor gives up.)"""
    survivors = [name for name in ("frontend", "engine_core") if name != victim]
    with running_server(model_dir) as server:
        pids = server.children()
        handles = None
        for _ in range(4):
            old = pids[victim]
            os.kill(old, signal.SIGKILL)
            pids = wait_recovered(server, victim, old)
            one_request_works(server)
            wait_idle(server)
            if handles is None:
                handles = _handles(server, pids, survivors)
            else:
                _no_more_handles(server, pids, handles)


def test_a_resume_of_a_request_the_server_does_not_hold(server, expected):
    """docs/protocol.md §5.6, from the document alone: a resume with offset > 0 of a request nobody holds is error
    resume_lost; with offset 0 it runs, as a generate would."""
    import msgspec
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    try:
        base = {"type": "resume", "session": "s-" + os.urandom(8).hex(), "prompt": PROMPTS[1], "sampling": sampling}
        sock.send(msgspec.msgpack.encode({**base, "id": "lost", "offset": 3}))
        reply = msgspec.msgpack.decode(sock.recv())
        assert (reply["type"], reply["id"], reply.get("code")) == ("error", "lost", "resume_lost"), reply
        sock.send(msgspec.msgpack.encode({**base, "id": "fresh", "offset": 0}))
        ids = []
        while (reply := msgspec.msgpack.decode(sock.recv())).get("finish_reason") is None:
            ids += reply.get("token_ids", [])
        assert ids + reply.get("token_ids", []) == expected[1]
    finally:
        sock.close(linger=0)
        ctx.term()


def test_fail_mode_gives_each_inflight_request_one_worker_fault(model_dir, expected):
    """--on-worker-fault fail: every in-flight request ends with one worker_fault error; new ones then succeed."""
    with running_server(model_dir, "--on-worker-fault", "fail") as s:
        old = s.children()
        long = lambda i: params_for(i, max_tokens=400)  # noqa: E731

        kill = lambda: os.kill(old["gpu_worker"], signal.SIGKILL)  # noqa: E731
        every_stream_under_way = lambda seen: all(n >= 2 for n in seen[:8])  # noqa: E731
        got = asyncio.run(_run_with_fault(s.port, every_stream_under_way, kill, range(8), long))
        for ids, finish, error in got:
            assert isinstance(error, RequestError) and error.code == "worker_fault", error
            assert "worker died" in error.message and finish is None
        wait_recovered(s, "gpu_worker", old["gpu_worker"])
        wait_idle(s)
        with s.client() as c:
            out = c.complete(PROMPTS[1], params=params_for(1))
        assert out.token_ids == expected[1] and out.finish_reason == "length"


# ---- the restart policy, on stand-in children -----------------------------------------------


@pytest.fixture
def supervisor(model_dir):
    """A Supervisor whose children are stand-ins: frontend and engine sleep, the worker exits at once."""
    clock = FakeClock(now=1000.0)
    config = ServeConfig(engine=EngineArgs(model=str(model_dir)), port=0)
    sup = Supervisor(config, policy=RestartPolicy(window_s=30.0, max_in_a_row=4, backoff_s=0.5), clock=clock)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    sup.frontend = Child("frontend", sleeper)
    sup.engine = Child("engine_core", sleeper)
    sup.worker = Child("gpu_worker", ["sh", "-c", "exit 3"])
    try:
        for child in (sup.frontend, sup.engine, sup.worker):
            child.start(sup.env, clock())
        yield sup, clock
    finally:
        sup.stop()


def _worker_dies(sup) -> None:
    """Wait for the stand-in worker to exit (it does at once), then run one pass of the watch."""
    sup.worker.proc.wait(10)
    sup.check_children()


def test_a_crash_looping_worker_backs_off_then_the_server_reports_unhealthy(supervisor):
    sup, clock = supervisor
    _worker_dies(sup)
    assert sup.worker.restarts == 1 and sup.worker.restart_at is None, "the first death: restarted at once"
    for in_a_row, backoff in ((2, 0.5), (3, 1.0)):
        _worker_dies(sup)
        assert sup.worker.in_a_row == in_a_row
        assert sup.worker.restart_at == pytest.approx(clock.now + backoff)
        restarts = sup.worker.restarts
        clock.now += backoff / 2
        sup.check_children()
        assert sup.worker.restarts == restarts, "not before its backoff"
        clock.now += backoff / 2
        sup.check_children()
        assert sup.worker.restarts == restarts + 1
    _worker_dies(sup)  # the fourth in a row: given up
    health = sup.health()
    assert not health.healthy and not sup.healthy
    assert "gpu_worker" in health.last_fault and "not restarted again" in health.last_fault
    assert sup.given_up == health.last_fault, "the server ends (watch returns): a service manager sees it"
    restarts = sup.worker.restarts
    clock.now += 3600
    sup.check_children()
    assert sup.worker.restarts == restarts, "no more restarts: it does not loop"
    assert sup.engine.alive and sup.frontend.alive and sup.engine.restarts == 0


def test_a_worker_that_ran_for_a_while_is_restarted_at_once(supervisor):
    sup, clock = supervisor
    for _ in range(6):  # more than max_in_a_row deaths, each after a long life: never a crash loop
        clock.now += 31.0
        _worker_dies(sup)
        assert sup.worker.in_a_row == 1 and sup.worker.restart_at is None
    assert sup.worker.restarts == 6 and sup.healthy
    assert sup.health().last_fault.startswith("gpu_worker")


def test_health_file_tracks_restarts_and_the_last_fault(supervisor):
    import msgspec

    from metrale.ipc.messages import Health

    sup, _ = supervisor
    _worker_dies(sup)
    health = msgspec.msgpack.decode(sup.health_path.read_bytes(), type=Health)
    worker = next(p for p in health.processes if p.name == "gpu_worker")
    assert worker.restarts == 1 and worker.pid == sup.worker.pid
    assert health.last_fault.startswith("gpu_worker") and "exited with code 3" in health.last_fault


# ---- a worker that lives but makes no progress -------------------------------------------------


def test_a_hung_worker_is_killed_and_restarted_and_16_streams_lose_nothing(server, expected):
    """SIGSTOP the worker under 16 streams: /health reports the stall, the engine core sees no progress past its
    adaptive deadline, kills the worker as hung, the supervisor restarts it, and every stream is unchanged."""
    old = server.children()
    stalls: list[float] = []

    def watch_health() -> None:
        """While the worker is stopped, /health's progress figure grows (the engine reports nothing)."""
        deadline = time.monotonic() + 30
        with server.client(timeout=5) as c:
            while time.monotonic() < deadline:
                health = c.health()
                if health.progress_s >= 1.0:
                    stalls.append(health.progress_s)
                    return
                time.sleep(0.05)  # polling the server's health figure; no event tells a stall

    def stop_worker() -> None:
        os.kill(old["gpu_worker"], signal.SIGSTOP)
        watcher = __import__("threading").Thread(target=watch_health, daemon=True)
        watcher.start()
        stop_worker.watcher = watcher

    got = asyncio.run(_run_with_fault(server.port, lambda seen: sum(seen) >= 100, stop_worker, range(16)))
    stop_worker.watcher.join(30)
    assert [g[2] for g in got] == [None] * 16, "no client sees an error"
    assert [g[0] for g in got] == expected[:16]
    assert stalls, "/health reported the stall while the worker was stopped"
    wait_recovered(server, "gpu_worker", old["gpu_worker"])
    with server.client() as c:
        health = c.health()
    assert "hung" in health.last_fault and "no progress" in health.last_fault  # (a later worker's, on a starved box)
    assert not psutil.pid_exists(old["gpu_worker"]) or psutil.Process(old["gpu_worker"]).status() == psutil.STATUS_ZOMBIE
    assert health.healthy and health.progress_s < 1.0
    wait_idle(server)


def test_a_worker_stopped_in_a_long_prefill_is_killed_at_the_timeout_plus_the_steps_expected_time(server):
    """The hang watch has measured this server's steps (a few requests); the worker is SIGSTOPped, then a
    400-token prompt arrives: its prefill is the step in flight, and its deadline is --worker-hang-timeout plus
    twice that prefill's expected time (the kill message names them), not 20 x the slowest per-token rate x 400.
    The request then completes on a new worker, equal to the same request on a healthy one."""
    import re

    wait_idle(server)
    with server.client(timeout=60) as c:
        for n in (8, 40, 90, 20, 150, 60):  # prefill and decode steps for the fit (and past a new worker's warm-up)
            c.complete(token_ids=[11 + i % 50 for i in range(n)],
                       params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    wait_idle(server)  # nothing in flight (a finished request's step launched ahead is settled): the prefill is next
    old = server.children()
    prompt = [7 + (i * 13) % 200 for i in range(400)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    os.kill(old["gpu_worker"], signal.SIGSTOP)
    with server.client(timeout=120) as c:
        stalled = c.complete(token_ids=prompt, params=params)
    pids = wait_recovered(server, "gpu_worker", old["gpu_worker"])
    with server.client(timeout=60) as c:
        health = c.health()
        healthy = c.complete(token_ids=prompt, params=params)
    assert stalled.finish_reason == "length" and stalled.token_ids == healthy.token_ids
    fault = health.last_fault
    assert "hung" in fault and "a step of 400 prefill tokens and 0 decode positions" in fault, fault
    expected, allowed = (float(x) for x in re.search(r"expected to take ([\d.]+) s; allowed ([\d.]+) s", fault).groups())
    assert allowed == pytest.approx(10.0 + 2 * expected, abs=0.06), "the timeout plus the step's expected time"
    assert pids["gpu_worker"] != old["gpu_worker"]
    wait_idle(server)


def test_a_child_that_cannot_run_as_configured_is_given_up_at_once(supervisor):
    """A frontend that exits with EXIT_CONFIG (its port was taken when it restarted) is not restarted: the
    server ends, with the frontend's own reason."""
    from metrale.ipc.status_channel import EXIT_CONFIG, FAILED, StatusSender

    sup, _ = supervisor
    sender = StatusSender(sup.inbox.address, "frontend")
    sender.send(FAILED, "port 7410 (tcp://127.0.0.1:7410, the ZMQ client address) cannot be bound")
    sender.close()
    sup.frontend.stop(grace_s=1.0)
    sup.frontend = Child("frontend", ["sh", "-c", f"exit {EXIT_CONFIG}"])
    sup.frontend.start(sup.env, sup.clock())
    sup.frontend.proc.wait(10)
    sup.watch()  # returns by itself: the server ends
    assert sup.frontend.restarts == 0
    assert sup.given_up is not None and "cannot be bound" in sup.given_up

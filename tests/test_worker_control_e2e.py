"""`metrale worker kill / restart` against `metrale serve --enable-admin --api-key`: under 32 live streams a KILLed
worker and a STOPped one (found by the hung-worker detection) change no token of any stream; the restart's cost
shows in `metrale status`; admin requests are refused when off, from afar, with a wrong key, or for a worker that
does not exist. The commands run in-process (click's runner) so a kill lands while the streams run."""

from __future__ import annotations

import asyncio
import time

import pytest
from click.testing import CliRunner

from metrale.cli import main
from metrale.frontend.admin_access import admin_refusal
from metrale.frontend.client import AsyncClient, Client, RequestError

from serve_fixture import running_server
from test_faults_e2e import N, _run_with_fault, expected, model_dir, one_request_works, wait_idle, wait_recovered  # noqa: F401 - fixtures
from test_frontend_server import WAIT_S, running_stack

KEY = "sk-admin-test"


@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811 - the fixture imported above
    with running_server(model_dir, "--enable-admin", "--worker-hang-timeout", "2", api_key=KEY) as s:
        yield s


def cli(server, *args: str, key: str = KEY):
    """Run one `metrale` command against the server; click's Result."""
    return CliRunner().invoke(main, [*args, "--port", str(server.port), "--api-key", key])


@pytest.mark.parametrize("sig", ["KILL", "STOP"])
def test_worker_kill_under_32_streams_changes_no_token(server, expected, sig):  # noqa: F811
    old = server.children()
    with server.client() as c:
        recoveries = c.stats().worker_recoveries
    done = []

    def kill() -> None:
        done.append(cli(server, "worker", "kill", "--signal", sig))

    got = asyncio.run(_run_with_fault(server.port, lambda seen: sum(seen) >= 2 * N, kill, api_key=KEY))
    assert done[0].exit_code == 0, done[0].output
    assert f"pid {old['gpu_worker']}" in done[0].output
    assert [g[2] for g in got] == [None] * N, "no client sees an error"
    assert [g[0] for g in got] == expected, "every stream equals the fault-free run"
    wait_recovered(server, "gpu_worker", old["gpu_worker"])
    with server.client() as c:
        health, stats = c.health(), c.stats()
    assert stats.worker_recoveries == recoveries + 1
    cost = stats.last_worker_recovery
    assert cost.requests > 0, "the kill landed while requests ran"
    assert cost.resumed_s is not None and cost.resumed_s >= cost.ready_s > 0
    if sig == "STOP":
        assert "hung (after metrale worker kill --signal STOP)" in health.last_fault
        assert cost.resumed_s > 2.0, "a hang costs at least --worker-hang-timeout"
    else:
        assert "killed by SIGKILL (metrale worker kill --signal KILL)" in health.last_fault
    assert health.healthy, "an operator's kill is not a crash"
    wait_idle(server)


def wait_replaced(server, pid: int, timeout: float = 60.0):
    """The engine core's record of replacing worker pid, once the new worker is ready."""
    deadline = time.monotonic() + timeout
    with server.client() as c:
        while True:
            r = c.stats().last_worker_recovery
            if r is not None and f"pid {pid})" in r.cause and r.ready_s is not None:
                return r
            assert time.monotonic() < deadline, f"worker {pid} was not replaced: {r}"
            time.sleep(0.05)  # polling the engine's counters: the replacement happens in other processes


def test_an_idle_worker_restart_is_noticed_at_once_and_status_shows_it(server):
    old = server.children()
    out = cli(server, "worker", "restart")
    assert out.exit_code == 0 and f"pid {old['gpu_worker']}" in out.output, out.output
    wait_recovered(server, "gpu_worker", old["gpu_worker"])
    record = wait_replaced(server, old["gpu_worker"])
    assert record.requests == 0 and record.resumed_s is None, "nothing ran: nothing resumed"
    status = cli(server, "status")
    assert status.exit_code == 0, status.output
    assert "killed by SIGTERM (metrale worker restart)" in status.output
    line = next(line for line in status.output.splitlines() if line.startswith("last worker restart: "))
    assert f"pid {old['gpu_worker']})" in line and "new worker ready after" in line and "no request was running" in line
    one_request_works(server)


@pytest.mark.parametrize("args, words", [
    (("--rank", "1"), "rank 1: this server runs 1 worker rank per replica (rank 0 only)"),
    (("--replica", "2"), "replica 2: this server runs 1 replica (replica 0 only)"),
])
def test_a_worker_that_does_not_exist_is_refused(server, args, words):
    old = server.children()
    out = cli(server, "worker", "kill", *args)
    assert out.exit_code == 1 and "bad_request" in out.output and words in out.output
    assert server.children()["gpu_worker"] == old["gpu_worker"]


def test_admin_needs_the_key(server):
    out = cli(server, "worker", "kill", key="sk-wrong")
    assert out.exit_code == 1 and "unauthorized" in out.output


def test_admin_is_refused_when_off(tiny_model_dir):
    async def restart(endpoint: str):
        async with AsyncClient(address=endpoint, timeout=WAIT_S) as c:
            await c.restart_worker()

    with running_stack(tiny_model_dir("llama")) as s:
        with Client(address=s.endpoint, timeout=WAIT_S) as c:
            with pytest.raises(RequestError) as err:
                c.kill_worker("KILL")
        with pytest.raises(RequestError) as async_err:
            asyncio.run(restart(s.endpoint))
    assert err.value.code == "admin_disabled" and "--enable-admin" in err.value.message
    assert async_err.value.code == "admin_disabled"


def test_admin_is_loopback_only_unless_allowed():
    tcp = "tcp://0.0.0.0:7410"
    assert admin_refusal(True, False, "127.0.0.1", tcp) is None
    assert admin_refusal(True, False, "::1", tcp) is None
    assert "--admin-allow-remote" in admin_refusal(True, False, "10.1.2.3", tcp)
    assert "--admin-allow-remote" in admin_refusal(True, False, None, tcp)
    assert admin_refusal(True, True, "10.1.2.3", tcp) is None
    assert admin_refusal(True, False, None, "ipc:///tmp/x") is None
    assert "--enable-admin" in admin_refusal(False, True, "127.0.0.1", tcp)

"""The supervisor's health file: written when what it says changes (or once a second), read with fresh uptimes."""

from __future__ import annotations

import os
import signal

import msgspec
import pytest

from metrale.config import EngineArgs, ServeConfig
from metrale.ipc.messages import Health, ProcessHealth
from metrale.health_file import REFRESH_S as HEALTH_REFRESH_S
from metrale.health_file import read_health
from metrale.supervisor import Child, Supervisor
from metrale.testing.fake_device import FakeClock


@pytest.fixture
def supervisor(tiny_model_dir):
    """A Supervisor whose three children are `sleep` stand-ins."""
    clock = FakeClock(now=1000.0)
    sup = Supervisor(ServeConfig(engine=EngineArgs(model=str(tiny_model_dir("llama"))), port=0), clock=clock)
    try:
        for name in ("frontend", "engine", "worker"):
            child = Child(getattr(sup, name).name, ["sleep", "60"])
            setattr(sup, name, child)
            child.start(sup.env, clock())
        yield sup, clock
    finally:
        sup.stop()


def written(sup) -> tuple[int, int]:
    """The health file's identity: each write replaces it with a new inode."""
    st = os.stat(sup.health_path)
    return st.st_ino, st.st_mtime_ns


def test_health_file_is_rewritten_only_when_it_changes_or_once_a_second(supervisor):
    sup, clock = supervisor
    sup.check_children()
    first = written(sup)
    for _ in range(5):  # passes of the watch within a second, nothing happening: no write
        clock.now += HEALTH_REFRESH_S / 10
        sup.check_children()
        assert written(sup) == first
    clock.now += HEALTH_REFRESH_S  # a second on: refreshed
    sup.check_children()
    second = written(sup)
    assert second != first
    os.kill(sup.worker.pid, signal.SIGKILL)  # a death: published at the next pass
    sup.worker.proc.wait(10)
    sup.check_children()
    assert written(sup) != second
    health = msgspec.msgpack.decode(sup.health_path.read_bytes(), type=Health)
    worker = next(p for p in health.processes if p.name == "gpu_worker")
    assert worker.restarts == 1 and worker.pid == sup.worker.pid and worker.alive
    assert health.last_fault.startswith("gpu_worker") and "SIGKILL" in health.last_fault


def test_read_health_adds_the_file_age_to_live_uptimes(tmp_path):
    path = tmp_path / "health.msgpack"
    health = Health(
        id="",
        healthy=True,
        processes=[
            ProcessHealth(name="frontend", pid=10, uptime_s=5.0, restarts=0, alive=True),
            ProcessHealth(name="gpu_worker", pid=11, uptime_s=0.0, restarts=2, alive=False),
        ],
    )
    path.write_bytes(msgspec.msgpack.encode(health))
    written_at = os.stat(path).st_mtime
    os.utime(path, (written_at - 30.0, written_at - 30.0))  # as if written 30 s ago
    got = read_health(path)
    assert 35.0 <= got.processes[0].uptime_s < 40.0
    assert got.processes[1].uptime_s == 0.0  # a dead process has no uptime
    assert (got.healthy, [p.pid for p in got.processes]) == (True, [10, 11])


def test_a_stop_signal_arriving_inside_the_watch_loop_s_wait_still_stops_it(supervisor):
    """A signal handler runs on the main thread between two bytecodes, possibly inside threading.Event.wait() with
    the Event's lock held: `metrale serve`'s SIGTERM / Ctrl-C handler must take no lock (Event.set() would wait on
    its own thread forever, and the server would never stop). Here the handler runs while the test holds that lock."""
    import faulthandler

    sup, _ = supervisor
    previous = signal.signal(signal.SIGUSR1, lambda *_: sup.request_stop())  # what cli.serve installs for SIGTERM
    faulthandler.dump_traceback_later(20, exit=True)  # a handler that blocks deadlocks this thread: fail, not hang
    try:
        with sup._stop._cond:  # the lock Event.wait() holds
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(1000):  # the handler runs at a bytecode boundary, here, with the lock held
                if sup._stop_requested:
                    break
        assert sup._stop_requested
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGUSR1, previous)
    sup.watch()  # returns at once: the flag is set


def test_stopping_a_child_goes_on_when_a_descendant_ends_while_it_is_killed(monkeypatch):
    """A descendant that ends between the grace wait and its SIGKILL does not stop the others being killed."""
    import psutil

    killed = []

    class Ended:
        def kill(self):
            raise psutil.NoSuchProcess(1)

    class Alive:
        def kill(self):
            killed.append(True)

    child = Child("stand-in", ["sleep", "60"])
    child.start(dict(os.environ), 0.0)
    monkeypatch.setattr(psutil, "wait_procs", lambda procs, timeout: ([], [Ended(), Alive()]))
    child.stop(5.0)
    assert killed == [True] and child.proc.poll() is not None

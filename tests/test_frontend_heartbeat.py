"""The frontend hang watch (metrale/frontend_heartbeat.py) on its own and in Supervisor.check_children, with stand-in
frontends and an injected clock: a frontend whose heartbeat stops for longer than --frontend-hang-timeout is killed
and restarted through the restart path, one still starting up (no beat yet) is not, and with several frontends only
the silent one is. (A real frontend SIGSTOPped under streams: tests/test_frontend_hang_e2e.py.)"""

from __future__ import annotations

import asyncio
import sys

import pytest

from metrale.config import EngineArgs, ServeConfig
from metrale.frontend_heartbeat import FrontendHangWatch, Heartbeat
from metrale.settings import DEFAULTS
from metrale.supervisor import Child, RestartPolicy, Supervisor
from metrale.testing.fake_device import FakeClock

TIMEOUT_S = 5.0


def test_a_watch_times_silence_from_the_last_beat_and_not_start_up(tmp_path):
    clock = FakeClock(now=100.0)
    watch = FrontendHangWatch(tmp_path / "beat", TIMEOUT_S)
    watch.reset(clock())
    beat = Heartbeat(tmp_path / "beat")
    clock.advance(watch.startup_s)
    assert watch.hung(clock()) is None, "no beat yet: start-up, timed against its own budget"
    beat.beat()
    assert watch.silent_s(clock()) == 0.0
    clock.advance(TIMEOUT_S)
    beat.beat()
    assert watch.silent_s(clock()) == 0.0, "a beat restarts the count"
    clock.advance(TIMEOUT_S)
    assert watch.hung(clock()) is None, "silent for exactly the timeout: not yet"
    clock.advance(0.5)
    assert "has not beaten for 5.5 s" in watch.hung(clock())
    watch.reset(clock())
    clock.advance(3 * TIMEOUT_S)
    assert watch.hung(clock()) is None, "a restarted frontend starts up again"
    clock.advance(watch.startup_s)
    assert "has not started serving" in watch.hung(clock()), "one stopped before its first beat is caught too"
    watch.close()


def test_the_event_loop_beats_once_serving(tmp_path):
    """Heartbeat.start: the loop's own callback beats, and only while serving() holds."""
    beat = Heartbeat(tmp_path / "beat", interval_s=0.0)
    serving = asyncio.Event()
    seen: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        beat.start(loop, serving=serving.is_set)
        for _ in range(5):
            await asyncio.sleep(0)
        seen.append(beat.count)
        serving.set()
        while beat.count < 3:
            await asyncio.sleep(0)

    asyncio.run(main())
    assert seen == [0] and beat.count >= 3
    assert FrontendHangWatch(tmp_path / "x").timeout_s == DEFAULTS.frontend_hang_timeout_s


@pytest.fixture
def supervisor(tiny_model_dir):
    """A Supervisor of two stand-in frontends (sleepers that never beat by themselves: the test beats for them)."""
    clock = FakeClock(now=1000.0)
    config = ServeConfig(engine=EngineArgs(model=str(tiny_model_dir("llama"))), port=0, api_server_count=2,
                         frontend_hang_timeout_s=TIMEOUT_S)
    sup = Supervisor(config, policy=RestartPolicy(window_s=30.0), clock=clock)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    for i in range(2):
        sup.frontends[i].argv = sleeper
    sup.engine = Child("engine_core", sleeper)
    sup.worker = Child("gpu_worker", sleeper)
    try:
        for i in range(2):
            sup._start_frontend(i, clock())
        for child in (sup.engine, sup.worker):
            child.start(sup.env, clock())
        yield sup, clock, [Heartbeat(sup._beat_path(i)) for i in range(2)]
    finally:
        sup.stop()


def test_a_silent_frontend_is_killed_and_restarted_and_the_others_serve_on(supervisor, caplog):
    sup, clock, beats = supervisor
    first, second = sup.frontends
    clock.advance(10 * TIMEOUT_S)
    sup.check_children()
    assert first.alive and second.alive and first.restarts == second.restarts == 0, "starting up: not timed"
    for _ in range(4):  # both serve and beat
        for b in beats:
            b.beat()
        clock.advance(TIMEOUT_S / 2)
        sup.check_children()
    assert first.restarts == second.restarts == 0
    stopped_pid = second.pid
    for _ in range(2):  # frontend 1 falls silent (its last beat was read 2.5 s ago); frontend 0 beats on
        beats[0].beat()
        clock.advance(TIMEOUT_S / 2)
        sup.check_children()
    with caplog.at_level("WARNING", logger="metrale.supervisor"):
        beats[0].beat()
        clock.advance(TIMEOUT_S / 2)  # frontend 1 silent for 7.5 s: killed, and restarted at once
        sup.check_children()
    assert second.restarts == 1 and second.alive and second.pid != stopped_pid
    assert first.restarts == 0 and first.alive, "the other frontend serves on"
    fault = sup.health().last_fault
    assert fault.startswith(f"frontend 1 (pid {stopped_pid}) hung: its event loop has not beaten for 7.5 s")
    assert sum(fault in r.getMessage() for r in caplog.records) == 1, "one line says what happened"
    clock.advance(10 * TIMEOUT_S)
    beats[0].beat()
    sup.check_children()
    assert second.restarts == 1, "the restarted frontend starts up: not timed before its first beat"


def test_a_frontend_receive_loop_under_a_flood_of_frames_lets_the_heartbeat_beat(tmp_path):
    """A zmq.asyncio recv of a queued frame never yields: serve_frames (the frontend's client and engine loops) must
    let the event loop turn while frames keep coming, or a busy frontend's heartbeat stalls and the watch kills it.
    (Fails with per_turn past the flood: the beat count does not move while the frames are drained.)"""
    import zmq
    import zmq.asyncio

    from metrale.frontend.server import serve_frames

    frames, seen = 5000, []
    beat = Heartbeat(tmp_path / "beat", interval_s=0.0)

    class Drained(Exception):
        pass

    def handle(frame) -> None:
        seen.append(beat.count)
        if len(seen) == frames:
            raise Drained

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        try:
            for s in (pull, push):
                s.set_hwm(0)
            pull.bind("inproc://flood")
            push.connect("inproc://flood")
            for _ in range(frames):
                await push.send(b"x")
            while not pull.poll(0):  # the frames are queued before the loop starts to drain them
                await asyncio.sleep(0)
            beat.start(asyncio.get_running_loop())
            with pytest.raises(Drained):
                await serve_frames(pull.recv, handle)
        finally:
            pull.close(0)
            push.close(0)
            ctx.term()

    asyncio.run(main())
    assert seen[-1] - seen[0] >= frames // 64, "the loop turned (and beat) while the queued frames were handled"

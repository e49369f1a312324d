"""`metrale top`, headless: a snapshot rendered to text shows every figure; the sampler's rates and fault list."""

from __future__ import annotations

import io
import os

from rich.console import Console

from metrale.ipc.messages import EngineStats, FrontendStats, Health, ProcessHealth, Stats
from metrale.top.snapshot import ProcessRow, Sampler, Snapshot
from metrale.top.view import render


def text_of(renderable) -> str:
    console = Console(file=io.StringIO(), width=120, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_a_frame_shows_processes_queues_kv_rates_latencies_and_faults():
    snap = Snapshot(
        "127.0.0.1:7410", 0.0, healthy=True,
        processes=[ProcessRow("frontend", 4242, True, 75.0, 0, 12.5, 300 * 2**20),
                   ProcessRow("worker", 4343, False, 3.0, 2)],
        stats=EngineStats(running=3, waiting=5, swapped=1, kv_blocks_total=64, kv_blocks_used=12,
                          kv_blocks_cached=7, generated_tokens=999, steps=321),
        frontend=FrontendStats(window_s=60.0, ttft_samples=4, itl_samples=40, ttft_p50_s=0.0123, ttft_p99_s=0.25,
                               itl_p50_s=0.004, itl_p99_s=0.0456),
        tokens_in_per_s=88.0, tokens_out_per_s=432.5, worker_idle=0.25,
        faults=[(0.0, "worker exited with -9; restarted")])
    out = text_of(render(snap))
    for expected in ("4242", "4343", "DOWN", "1m15s", "300", "12", "running", "3", "waiting", "5", "swapped",
                     "12 / 64", "KV blocks cached", "7", "88.0", "432.5", "25 %", "12.3", "250.0", "4.0", "45.6",
                     "last 60 s", "worker exited with -9; restarted", "healthy"):
        assert expected in out, (expected, out)
    assert "UNHEALTHY" not in out


def test_a_frame_without_counters_says_why():
    out = text_of(render(Snapshot("h:1", 0.0, error="no engine counters: busy")))
    assert "UNHEALTHY" in out and "no engine counters: busy" in out and "faults: none" in out


class FakeClient:
    """health() / server_stats() answers given by the test, one per call."""

    def __init__(self, frames):
        self.frames = list(frames)

    def health(self):
        return self.frames[0][0]

    def server_stats(self):
        return self.frames.pop(0)[1]


def frame(generated, prompt, busy, idle, fault=None, restarts=0):
    health = Health(id="", healthy=True, last_fault=fault,
                    processes=[ProcessHealth(name="me", pid=os.getpid(), uptime_s=1.0, restarts=restarts, alive=True)])
    return health, Stats(id="", stats=EngineStats(generated_tokens=generated, worker_busy_s=busy, worker_idle_s=idle),
                         frontend=FrontendStats(prompt_tokens=prompt))


def test_the_sampler_turns_counters_into_rates_and_keeps_distinct_faults():
    now = [10.0]
    client = FakeClient([frame(100, 40, 1.0, 1.0), frame(300, 140, 2.5, 1.5, fault="worker died"),
                         frame(350, 140, 3.0, 2.0, fault="worker died"), frame(5, 0, 0.0, 0.0, fault="core died")])
    sampler = Sampler(client, "127.0.0.1", 1, clock=lambda: now[0])
    first = sampler.sample()
    assert first.tokens_out_per_s is None and first.worker_idle is None  # nothing to compare with yet
    assert first.processes[0].rss_bytes > 0 and first.processes[0].cpu_percent is None
    now[0] += 2.0
    second = sampler.sample()
    assert second.tokens_out_per_s == 100.0 and second.tokens_in_per_s == 50.0
    assert second.worker_idle == 0.25
    assert second.processes[0].cpu_percent is not None
    now[0] += 1.0
    third = sampler.sample()
    assert third.tokens_out_per_s == 50.0 and third.tokens_in_per_s == 0.0 and third.worker_idle == 0.5
    assert [f for _, f in third.faults] == ["worker died"]  # the same fault reported twice is one entry
    now[0] += 1.0
    fourth = sampler.sample()  # an engine core restarted: its counters went back, so no rate this frame
    assert fourth.tokens_out_per_s is None
    assert [f for _, f in fourth.faults] == ["worker died", "core died"]

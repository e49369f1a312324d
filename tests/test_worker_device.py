"""WorkerDevice ↔ worker process: steps in order, step failures, a dead worker, restarts, shutdown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from metrale.engine_core.hang_watch import NS, HangWatch, StepWork
from metrale.engine_core.worker_device import WorkerDevice
from metrale.ipc.plan import DeviceError, DeviceLost, StepPlan
from metrale.ipc.tickets import SEGMENT_PREFIX, RingGeometry, sweep_segments

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)  # fake_runner, as the worker subprocess imports it

from fake_runner import AHEAD_FACTORY, BROKEN_FACTORY, FACTORY, FAIL_TOKEN, HANG_TOKEN, HOLD_TOKEN  # noqa: E402

from shm_guard import no_segment_left_behind  # noqa: E402,F401 - an autouse fixture

GEOMETRY = RingGeometry(num_slots=3, max_tokens=64, max_rows=8, max_blocks_per_row=4, max_ban_ids=2)
WORKER_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")]))}


@pytest.fixture
def device():
    """A WorkerDevice with a fake-runner worker process, stopped (killed if need be) on every path."""
    dev = WorkerDevice.spawn(GEOMETRY, factory=FACTORY, env=WORKER_ENV, ready_timeout_s=30)
    try:
        yield dev
    finally:
        dev.close()
        assert dev.process.poll() is not None


def decode_plan(ids: list[int]) -> StepPlan:
    """One decode row per id (the fake runner echoes each row's input id)."""
    r = len(ids)
    i32 = lambda values: np.asarray(values, dtype=np.int32)  # noqa: E731
    return StepPlan(
        input_ids=i32(ids),
        positions=i32(np.full(r, 10)),
        slot_mapping=np.arange(r, dtype=np.int64),
        query_start=i32(np.arange(r + 1)),
        seq_lens=i32(np.full(r, 11)),
        block_tables=i32(np.arange(r * 2).reshape(r, 2)),
        sample=np.ones(r, dtype=bool),
        feed_from_row=i32(np.full(r, -1)),
        temperature=np.zeros(r, dtype=np.float32),
        top_k=i32(np.zeros(r)),
        top_p=np.ones(r, dtype=np.float32),
        min_p=np.zeros(r, dtype=np.float32),
        repetition_penalty=np.ones(r, dtype=np.float32),
        presence_penalty=np.zeros(r, dtype=np.float32),
        frequency_penalty=np.zeros(r, dtype=np.float32),
        seeds=np.zeros(r, dtype=np.int64),
        mask_kind=np.zeros(r, dtype=np.uint8),
        force_token=i32(np.zeros(r)),
        ban_ids=i32(np.full((r, 1), -1)),
        num_logprobs=i32(np.full(r, -1)),
        hist_tokens=i32([]),
        hist_start=i32(np.zeros(r + 1)),
        hist_prompt_len=i32(np.zeros(r)),
    )


def test_ready_worker_reports_its_model(device):
    info = device.model()
    assert info.name == "fake" and info.vocab_size == 1000 and info.eos_token_ids == (2,)
    assert device.pid == device.process.pid


def test_steps_run_in_launch_order_across_ring_wrap_around(device):
    ordinal = 0
    for i in range(4 * GEOMETRY.num_slots):  # one at a time
        ordinal += 1
        result = device.await_result(device.launch(decode_plan([i, 100 + i])))
        assert result.tokens.tolist() == [i, 100 + i] and result.logprobs.tolist() == [ordinal] * 2
    for i in range(0, 12, 2):  # two in flight, as the pipelined lane runs them
        first = device.launch(decode_plan([i]))
        second = device.launch(decode_plan([i + 1]))
        a, b = device.await_result(first), device.await_result(second)
        assert (a.tokens[0], b.tokens[0]) == (i, i + 1)
        assert (a.logprobs[0], b.logprobs[0]) == (ordinal + 1, ordinal + 2)
        ordinal += 2


def test_a_launching_worker_starts_the_next_ticket_before_its_last_result_lands():
    # A held step's result lands only once a later step is launched: the worker must launch ticket t+1 while t
    # is still in flight (as the GPU worker does while t's tokens copy back), and still publish in order.
    dev = WorkerDevice.spawn(GEOMETRY, factory=AHEAD_FACTORY, env=WORKER_ENV, ready_timeout_s=30)
    try:
        launched = 0
        for i in range(2 * GEOMETRY.num_slots):
            first = dev.launch(decode_plan([HOLD_TOKEN, i]))
            second = dev.launch(decode_plan([i, 0]))
            a, b = dev.await_result(first), dev.await_result(second)
            launched += 2
            assert a.tokens.tolist() == [HOLD_TOKEN, i] and b.tokens.tolist() == [i, 0]
            assert a.logprobs[0] == launched  # t's result was written after t+1 was launched
        first = dev.launch(decode_plan([HOLD_TOKEN, 1]))
        second = dev.launch(decode_plan([FAIL_TOKEN, 2]))  # a step launched ahead that fails is its own error
        assert dev.await_result(first).tokens.tolist() == [HOLD_TOKEN, 1]
        with pytest.raises(DeviceError, match="injected failure"):
            dev.await_result(second)
        assert dev.await_result(dev.launch(decode_plan([7]))).tokens.tolist() == [7]
    finally:
        dev.close()
        assert dev.process.poll() is not None


def test_results_are_copies_that_outlive_the_slot(device):
    kept = device.await_result(device.launch(decode_plan([5, 6])))
    for i in range(GEOMETRY.num_slots):
        device.await_result(device.launch(decode_plan([70 + i, 80 + i])))
    assert kept.tokens.tolist() == [5, 6] and kept.tokens.flags.owndata


def test_a_failed_step_raises_for_its_ticket_and_the_next_step_succeeds(device):
    with pytest.raises(DeviceError, match="injected failure"):
        device.await_result(device.launch(decode_plan([FAIL_TOKEN, 1])))
    assert device.await_result(device.launch(decode_plan([9]))).tokens.tolist() == [9]


def test_launch_with_every_slot_in_flight_is_refused(device):
    tickets = [device.launch(decode_plan([i])) for i in range(GEOMETRY.num_slots)]
    with pytest.raises(RuntimeError, match="in flight"):
        device.launch(decode_plan([99]))
    assert [device.await_result(t).tokens[0] for t in tickets] == list(range(GEOMETRY.num_slots))
    assert device.await_result(device.launch(decode_plan([99]))).tokens[0] == 99


def test_an_oversized_plan_is_refused_and_nothing_is_launched(device):
    with pytest.raises(ValueError, match="rows"):
        device.launch(decode_plan(list(range(GEOMETRY.max_rows + 1))))
    assert device.await_result(device.launch(decode_plan([3]))).tokens[0] == 3


def test_a_killed_worker_fails_the_step_in_flight_within_200_ms(device):
    device.await_result(device.launch(decode_plan([1])))
    ticket = device.launch(decode_plan([HANG_TOKEN]))
    t0 = time.monotonic()
    os.kill(device.pid, signal.SIGKILL)
    with pytest.raises(DeviceError, match="worker"):
        device.await_result(ticket)
    assert time.monotonic() - t0 < 0.2
    with pytest.raises(DeviceError):  # and a step launched after its death fails too, at once
        device.await_result(device.launch(decode_plan([2])))


def test_a_respawned_worker_serves_the_same_ring(device):
    ring = device.ring_name
    stale = device.launch(decode_plan([HANG_TOKEN]))
    device.process.kill()
    info = device.respawn(ready_timeout_s=30)
    assert info.name == "fake" and device.ring_name == ring
    with pytest.raises(DeviceError, match="abandoned"):
        device.await_result(stale)
    assert device.await_result(device.launch(decode_plan([4, 5]))).tokens.tolist() == [4, 5]


def test_a_worker_the_supervisor_started_attaches_by_ring_name():
    dev = WorkerDevice(GEOMETRY, token="sup1")
    procs = []
    try:
        assert dev.ring_name == f"{SEGMENT_PREFIX}{os.getpid()}-sup1"
        for attempt in range(2):  # the first start, then a restart after the worker dies
            argv = [sys.executable, "-m", "metrale.gpu_worker.worker", "--ring", dev.ring_name, "--factory", FACTORY]
            procs.append(subprocess.Popen(argv, env={**os.environ, **WORKER_ENV}))
            dev.wait_ready(timeout_s=30, pid=procs[-1].pid)
            assert dev.pid == procs[-1].pid
            assert dev.await_result(dev.launch(decode_plan([attempt]))).tokens.tolist() == [attempt]
            procs[-1].kill()
            procs[-1].wait()
            with pytest.raises(DeviceError):
                dev.await_result(dev.launch(decode_plan([7])))
    finally:
        dev.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_a_connection_that_closes_before_ready_is_skipped():
    dev = WorkerDevice(GEOMETRY)
    proc = None
    try:
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.connect(dev.bell_path)  # a worker that died while loading its model
        stale.close()
        argv = [sys.executable, "-m", "metrale.gpu_worker.worker", "--ring", dev.ring_name, "--factory", FACTORY]
        proc = subprocess.Popen(argv, env={**os.environ, **WORKER_ENV})
        assert dev.wait_ready(timeout_s=30).name == "fake"
        assert dev.pid == proc.pid
    finally:
        dev.close()
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_a_runner_that_fails_to_build_is_reported_at_once():
    t0 = time.monotonic()
    with pytest.raises(DeviceError, match="weights missing"):
        WorkerDevice.spawn(GEOMETRY, factory=BROKEN_FACTORY, env=WORKER_ENV, ready_timeout_s=30)
    assert time.monotonic() - t0 < 10


def test_close_shuts_the_worker_down_cleanly(device):
    device.await_result(device.launch(decode_plan([1])))
    ticket = device.launch(decode_plan([2]))
    device.close()
    assert device.process.wait(timeout=5) == 0
    with pytest.raises(DeviceError, match="closed"):
        device.await_result(ticket)


def test_worker_stats_count_steps_and_idle_time(device):
    before = device.worker_stats()
    for i in range(20):
        device.await_result(device.launch(decode_plan([i])))
    stats = device.worker_stats()
    interval = stats.since(before)
    assert stats.worker_pid == device.pid and interval.steps == 20
    assert 0.0 < interval.idle_fraction <= 1.0 and 0.0 < stats.idle_fraction <= 1.0
    assert interval.busy_ns > 0


def test_the_worker_exits_when_its_engine_dies():
    engine_code = (
        "import sys, threading\n"
        "from metrale.engine_core.worker_device import WorkerDevice\n"
        "from metrale.ipc.tickets import RingGeometry\n"
        f"d = WorkerDevice.spawn(RingGeometry(num_slots=2, max_tokens=8, max_rows=2), factory={FACTORY!r},"
        f" env={WORKER_ENV!r}, ready_timeout_s=30)\n"
        "print(d.pid, flush=True)\n"
        "threading.Event().wait()\n"
    )
    engine = subprocess.Popen([sys.executable, "-c", engine_code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    worker = None
    try:
        worker = psutil.Process(int(engine.stdout.readline()))
        engine.kill()
        engine.wait()
        worker.wait(timeout=5)  # psutil.TimeoutExpired fails the test
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
        if worker is not None and worker.is_running():
            worker.kill()
        engine.stdout.close()
        sweep_segments([engine.pid])  # the killed engine could not unlink its ring


def test_a_resample_is_picked_again_by_the_worker_from_the_logits_it_kept(device):
    """A RepickOnly repair goes through the worker: a RESAMPLE ticket names a settled step, carries its rows' masks
    now, and the worker's runner picks again from that step's kept logits (the one before it too, while kept, even
    with a step launched behind them); a step no longer kept, or one that failed, is a DeviceError; the ring goes on."""
    first = device.launch(decode_plan([5, 6, 7]))
    device.await_result(first)
    second = device.launch(decode_plan([8]))  # launched ahead: in flight while first is picked again
    banned = decode_plan([5, 6, 7])
    banned.ban_ids = np.array([[-1, -1], [6, -1], [-1, -1]], dtype=np.int32)  # row 1's pick is banned now
    again = device.resample(first, banned)
    assert again.tokens.tolist() == [5, 0, 7] and again.logprobs.tolist() == [1, 1, 1]  # first's logits, not second's
    device.await_result(second)
    third = device.launch(decode_plan([9, 10]))
    assert device.resample(second, decode_plan([8])).tokens.tolist() == [8]
    with pytest.raises(DeviceError, match="KeyError"):
        device.resample(first, decode_plan([5, 6, 7]))  # two steps on: the runner keeps only the last two
    assert device.await_result(third).tokens.tolist() == [9, 10]
    failed = device.launch(decode_plan([FAIL_TOKEN]))
    with pytest.raises(DeviceError):
        device.await_result(failed)
    with pytest.raises(DeviceError, match="no logits"):
        device.resample(failed, decode_plan([1]))
    assert device.await_result(device.launch(decode_plan([4]))).tokens.tolist() == [4]


# ---- the hang deadline of a ticket follows its work -------------------------------------------------


def prefill_plan(ids: list[int]) -> StepPlan:
    """One row that runs every id (a prompt chunk from position 0)."""
    n = len(ids)
    plan = decode_plan([ids[0]])
    plan.input_ids = np.asarray(ids, dtype=np.int32)
    plan.positions = np.arange(n, dtype=np.int32)
    plan.slot_mapping = np.arange(n, dtype=np.int64)
    plan.query_start = np.array([0, n], dtype=np.int32)
    plan.seq_lens = np.array([n], dtype=np.int32)
    return plan


def fitted_watch(floor_s: float) -> HangWatch:
    """A watch that has measured this model: 3 ms a forward, 0.1 ms a decode row, 20 µs a prefill token."""
    watch = HangWatch(floor_s=floor_s, margin=2.0, warmup=0, refit_every=1)
    for rows in (1, 4, 8, 1, 4, 8):
        watch.record(int((0.003 + 0.0001 * rows) * NS), StepWork(decode_positions=rows))
    for tokens in (16, 48):
        watch.record(int((0.003 + 0.00002 * tokens) * NS), StepWork(prefill_tokens=tokens))
    return watch


def test_a_prefill_tickets_deadline_is_the_timeout_plus_its_expected_time(device):
    """The deadline comes from the plan's own work: prefill tokens at prefill speed, decode rows at decode speed."""
    device.hang = fitted_watch(floor_s=5.0)
    prefill = device.launch(prefill_plan(list(range(1, 61))))
    rows = device.launch(decode_plan([1, 2, 3, 4]))
    expected_prefill, expected_rows = 0.003 + 60 * 0.00002, 0.003 + 4 * 0.0001
    assert device.deadline_ns(prefill.slot, 0) == pytest.approx((5.0 + 2 * expected_prefill) * NS, rel=1e-6)
    assert device.deadline_ns(rows.slot, 0) == pytest.approx((5.0 + 2 * expected_rows) * NS, rel=1e-6)
    assert device.await_result(prefill).tokens.tolist() == [60]
    assert device.await_result(rows).tokens.tolist() == [1, 2, 3, 4]


def test_a_worker_stuck_in_a_prefill_is_killed_as_hung_past_its_deadline(device):
    device.hang = fitted_watch(floor_s=0.2)
    killed: list[str] = []
    device.on_hang = killed.append
    ticket = device.launch(prefill_plan([HANG_TOKEN, *range(1, 60)]))
    with pytest.raises(DeviceLost, match="killed as hung") as lost:
        device.await_result(ticket)
    assert "60 prefill tokens and 0 decode positions, expected to take 0.004 s" in str(lost.value)
    assert killed and device.process.wait(10) == -signal.SIGKILL

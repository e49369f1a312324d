"""The shared-memory ticket ring: layout round trips, zero-copy views, limits, and segment hygiene."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from metrale.ipc import ticket_layout
from metrale.ipc.doorbell import BellListener, bell_path
from metrale.ipc.plan import StepKind, StepPlan, StepResult, check_ticket
from metrale.ipc.tickets import (
    SEGMENT_PREFIX,
    SHM_DIR,
    RingGeometry,
    TicketRing,
    owner_pid_of,
    sweep_orphans,
    sweep_segments,
)

from shm_guard import no_segment_left_behind  # noqa: E402,F401 - an autouse fixture

GEOMETRY = RingGeometry(
    num_slots=3, max_tokens=64, max_rows=8, max_blocks_per_row=6, max_ban_ids=3, max_hist_tokens=40, max_logprobs=5,
    error_msg_bytes=64, max_bitmask_words=4, max_pool_dim=12,
)  # fmt: skip


@pytest.fixture
def ring():
    """A fresh ring owned by this process, closed (and unlinked) on every path."""
    r = TicketRing.create(GEOMETRY)
    try:
        yield r
    finally:
        r.close()


# name -> (dtype, length kind) of every StepPlan field, as the ring lays them out.
PLAN_FIELDS = {name: (dtype, kind) for name, dtype, kind in ticket_layout.PLAN_FIELDS}


def random_plan(
    rng: np.random.Generator, t: int, r: int, b: int, k: int, h: int, so: int = 3, si: int = 2, state: bool = True
) -> StepPlan:
    """A plan of the given counts whose every array holds random values of its dtype (a random number of grammar
    rows; state: with state slots)."""
    g = int(rng.integers(0, r + 1))
    shapes = {
        "T": (t,), "R": (r,), "R1": (r + 1,), "RB": (r, b), "RK": (r, k), "H": (h,), "SO": (so, 2), "SI": (si, 2),
        "GW": (g, 4 if g else 0), "S": (r if state else 0,), "BI": (int(rng.integers(0, 3 * r + 1)),),
        "PI": (int(rng.integers(0, 3 * r + 1)),),
    }
    arrays = {}
    for name, (dtype, kind) in PLAN_FIELDS.items():
        shape = shapes[kind]
        if dtype == np.bool_:
            arrays[name] = rng.random(shape) < 0.5
        elif np.issubdtype(dtype, np.floating):
            arrays[name] = rng.standard_normal(shape).astype(dtype)
        else:
            info = np.iinfo(dtype)
            arrays[name] = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return StepPlan(**arrays)


def assert_plans_equal(a: StepPlan, b: StepPlan) -> None:
    """Every field equal bit for bit, same dtype and shape."""
    for f in dataclasses.fields(StepPlan):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert x.dtype == y.dtype and x.shape == y.shape, f.name
        assert x.tobytes() == y.tobytes(), f.name


def test_plan_round_trip_is_bit_exact_for_random_shapes(ring):
    rng = np.random.default_rng(7)
    for i in range(60):
        counts = (
            int(rng.integers(0, 65)),
            int(rng.integers(0, 9)),
            int(rng.integers(0, 7)),
            int(rng.integers(0, 4)),
            int(rng.integers(0, 41)),
        )
        plan = random_plan(rng, *counts, state=bool(i % 2))
        slot = i % ring.num_slots
        ring.write_plan(slot, plan)
        ring.publish_plan(slot, i + 1)
        assert ring.plan_seq(slot) == i + 1
        assert_plans_equal(ring.read_plan(slot), plan)


def test_logit_bias_round_trips_and_its_capacity_is_300_ids_a_row(ring):
    """A plan's logit_bias (CSR: bias_start per row, ids and values) comes back as written; a plan with more entries
    than MAX_LOGIT_BIAS per row of the ring is refused before anything is written."""
    from metrale.ipc.sampling import MAX_LOGIT_BIAS

    plan = random_plan(np.random.default_rng(21), 3, 3, 1, 1, 0)
    plan.bias_start = np.array([0, 2, 2, 5], np.int32)  # row 1 unbiased
    plan.bias_ids = np.array([7, 3, 0, 11, 5], np.int32)
    plan.bias_values = np.array([100.0, -100.0, 0.5, -2.25, 3.0], np.float32)
    ring.write_plan(0, plan)
    back = ring.read_plan(0)
    assert back.bias_start.tolist() == [0, 2, 2, 5] and back.bias_ids.tolist() == [7, 3, 0, 11, 5]
    assert back.bias_values.tolist() == [100.0, -100.0, 0.5, -2.25, 3.0]
    assert_plans_equal(back, plan)
    unbiased = dataclasses.replace(plan, bias_start=None, bias_ids=np.zeros(0, np.int32),
                                   bias_values=np.zeros(0, np.float32))
    ring.write_plan(1, unbiased)
    assert ring.read_plan(1).bias_start.tolist() == [0, 0, 0, 0] and len(ring.read_plan(1).bias_ids) == 0
    n = GEOMETRY.max_rows * MAX_LOGIT_BIAS + 1
    over = dataclasses.replace(plan, bias_ids=np.zeros(n, np.int32), bias_values=np.zeros(n, np.float32))
    with pytest.raises(ValueError, match="logit_bias entries"):
        ring.write_plan(2, over)


def test_result_round_trip_is_bit_exact_with_and_without_logprobs(ring):
    rng = np.random.default_rng(8)
    for i in range(30):
        r, n = int(rng.integers(0, 9)), int(rng.integers(0, 6))
        result = StepResult(tokens=rng.integers(-1, 50000, size=r, dtype=np.int32))
        if i % 3:
            result.logprobs = rng.standard_normal(r).astype(np.float32)
        if i % 2:
            result.top_ids = rng.integers(0, 50000, size=(r, n), dtype=np.int32)
            result.top_logprobs = rng.standard_normal((r, n)).astype(np.float32)
        if i % 4 == 1:  # prompt logprobs: P positions, N alternatives each (none: N = 0)
            p, pn = int(rng.integers(0, 40)), int(rng.integers(0, 6))
            result.prompt_logprobs = rng.standard_normal(p).astype(np.float32)
            if pn:
                result.prompt_top_ids = rng.integers(0, 50000, size=(p, pn), dtype=np.int32)
                result.prompt_top_logprobs = rng.standard_normal((p, pn)).astype(np.float32)
        if i % 5 == 2:  # pooled vectors: Q rows of D
            q, d = int(rng.integers(0, GEOMETRY.max_rows + 1)), int(rng.integers(1, GEOMETRY.max_pool_dim + 1))
            result.pooled = rng.standard_normal((q, d)).astype(np.float32)
        slot = i % ring.num_slots
        ring.write_result(slot, result, exec_ns=1234)
        ring.publish_result(slot, i + 1)
        assert ring.result_seq(slot) == i + 1 and ring.result_error(slot) is None
        for copy in (False, True):
            back = ring.read_result(slot, copy=copy)
            for name in ("tokens", "logprobs", "top_ids", "top_logprobs", "prompt_logprobs", "prompt_top_ids",
                         "prompt_top_logprobs", "pooled"):
                x, y = getattr(back, name), getattr(result, name)
                assert (x is None) == (y is None), name
                if y is not None:
                    assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
            assert back.timings["worker_execute_s"] == pytest.approx(1.234e-6)


def test_a_lora_ticket_carries_its_slot_and_path_and_leaves_the_plan_alone(ring):
    plan = random_plan(np.random.default_rng(3), 5, 3, 2, 1, 4)
    ring.write_plan(1, plan)
    ring.write_lora_request(1, 2, "/adapters/é-1")
    assert ring.plan_kind(1) == StepKind.LORA and ring.lora_request(1) == (2, "/adapters/é-1")
    ring.write_lora_request(1, 0, "")
    assert ring.lora_request(1) == (0, "")
    with pytest.raises(ValueError, match="path of"):
        ring.write_lora_request(2, 0, "x" * GEOMETRY.error_msg_bytes)


def test_pooled_vectors_wider_than_the_ring_are_refused(ring):
    result = StepResult(tokens=np.full(2, -1, np.int32), pooled=np.zeros((2, GEOMETRY.max_pool_dim + 1), np.float32))
    with pytest.raises(ValueError, match="pooled vectors"):
        ring.write_result(0, result)


def test_error_result_carries_a_truncated_message(ring):
    ring.write_error(1, "boom: " + "é" * 100)
    ring.publish_result(1, 5)
    message = ring.result_error(1)
    assert message.startswith("boom: é") and len(message.encode()) <= GEOMETRY.error_msg_bytes


def test_read_plan_views_are_the_shared_memory_itself(ring):
    rng = np.random.default_rng(9)
    ring.write_plan(0, random_plan(rng, 5, 2, 3, 1, 4))
    other = TicketRing.attach(ring.name)  # a second mapping of the same segment, as the worker has
    try:
        view = other.read_plan(0)
        assert not view.input_ids.flags.owndata and view.block_tables.flags.c_contiguous
        view.input_ids[0] = 4242
        view.block_tables[1, 2] = -17
        seen = ring.read_plan(0)
        assert seen.input_ids[0] == 4242 and seen.block_tables[1, 2] == -17
        ring.write_result(2, StepResult(tokens=np.array([1, 2, 3], dtype=np.int32)))
        tokens = other.read_result(2).tokens
        ring.write_result(2, StepResult(tokens=np.array([7, 8, 9], dtype=np.int32)))
        assert tokens.tolist() == [7, 8, 9]  # a view: it sees the slot change
        del view, seen, tokens
    finally:
        other.close()


@pytest.mark.parametrize(
    "counts, what",
    [
        ((65, 1, 1, 1, 0), "tokens"),
        ((1, 9, 1, 1, 0), "rows"),
        ((1, 1, 7, 1, 0), "blocks per row"),
        ((1, 1, 1, 4, 0), "banned ids"),
        ((1, 1, 1, 1, 41), "history tokens"),
    ],
)
def test_oversized_plan_is_rejected_before_anything_is_written(ring, counts, what):
    rng = np.random.default_rng(10)
    kept = random_plan(rng, 3, 1, 1, 1, 2)
    ring.write_plan(0, kept)
    with pytest.raises(ValueError, match=what):
        ring.write_plan(0, random_plan(rng, *counts))
    assert_plans_equal(ring.read_plan(0), kept)


def test_inconsistent_plan_is_rejected(ring):
    plan = random_plan(np.random.default_rng(11), 4, 2, 2, 1, 0)
    plan.positions = plan.positions[:3]
    with pytest.raises(ValueError, match="positions"):
        ring.write_plan(0, plan)


def test_oversized_result_is_rejected(ring):
    with pytest.raises(ValueError, match="rows"):
        ring.write_result(0, StepResult(tokens=np.zeros(9, dtype=np.int32)))
    wide = np.zeros((2, 6), dtype=np.int32)
    with pytest.raises(ValueError, match="top logprobs"):
        ring.write_result(0, StepResult(np.zeros(2, np.int32), top_ids=wide, top_logprobs=wide.astype(np.float32)))


def test_segment_is_private_and_named_for_its_owner(ring):
    path = os.path.join(SHM_DIR, ring.name)
    assert ring.name.startswith(SEGMENT_PREFIX) and owner_pid_of(ring.name) == os.getpid()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    listener = BellListener(bell_path(ring.name))
    try:
        assert stat.S_IMODE(os.stat(listener.path).st_mode) == 0o600
    finally:
        listener.close()
    assert not os.path.exists(listener.path)


def test_close_and_context_manager_unlink_the_segment():
    with TicketRing.create(GEOMETRY) as r:
        path = os.path.join(SHM_DIR, r.name)
        assert os.path.exists(path)
    assert not os.path.exists(path)
    r.close()  # idempotent


def test_close_while_a_view_is_held_still_unlinks():
    r = TicketRing.create(GEOMETRY)
    held = r.read_plan(0)
    r.close()
    assert not os.path.exists(os.path.join(SHM_DIR, r.name))
    del held


def run_python(code: str) -> subprocess.CompletedProcess:
    """Run a snippet in a fresh interpreter; its stdout and stderr are captured."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)


def test_owner_exit_unlinks_the_segment():
    done = run_python(
        "from metrale.ipc.tickets import RingGeometry, TicketRing\n"
        "r = TicketRing.create(RingGeometry(num_slots=2, max_tokens=8, max_rows=2))\n"
        "print(r.name)\n"
    )
    assert done.returncode == 0, done.stderr
    assert not os.path.exists(os.path.join(SHM_DIR, done.stdout.strip()))


def test_attached_process_exit_does_not_unlink_the_segment(ring):
    done = run_python(
        "import sys\n"
        "from metrale.ipc.tickets import TicketRing\n"
        f"r = TicketRing.attach({ring.name!r})\n"
        "assert r.geometry.max_tokens == 64\n"
        "r.publish_plan(1, 99)\n"
    )  # exits without close(): neither exit nor resource_tracker may unlink
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr and "Traceback" not in done.stderr
    assert os.path.exists(os.path.join(SHM_DIR, ring.name))
    assert ring.plan_seq(1) == 99


def test_attach_rejects_a_foreign_segment():
    from multiprocessing.shared_memory import SharedMemory

    shm = SharedMemory(name=f"{SEGMENT_PREFIX}{os.getpid()}-foreign", create=True, size=8192)
    try:
        with pytest.raises(ValueError, match="not a metrale ticket ring"):
            TicketRing.attach(shm.name.lstrip("/"))
    finally:
        shm.close()
        shm.unlink()


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sweep_orphans_removes_what_a_dead_owner_left():
    pid = dead_pid()
    leftovers = [os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{pid}-{suffix}") for suffix in ("aa11", "aa11.bell")]
    for path in leftovers:
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        with TicketRing.create(GEOMETRY) as live:
            removed = sweep_orphans()
            assert {os.path.basename(p) for p in leftovers} <= set(removed)
            assert live.name not in removed and os.path.exists(os.path.join(SHM_DIR, live.name))
        assert not any(os.path.exists(p) for p in leftovers)
    finally:
        for path in leftovers:
            if os.path.exists(path):
                os.unlink(path)


def test_sweep_segments_removes_a_named_owners_segments():
    pid = dead_pid()
    path = os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{pid}-bb22")
    with open(path, "wb"):
        pass
    try:
        with TicketRing.create(GEOMETRY) as live:
            assert sweep_segments([pid]) == [os.path.basename(path)]
            assert os.path.exists(os.path.join(SHM_DIR, live.name))
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_a_resample_ticket_carries_its_plan_and_the_step_it_picks_again():
    """A RESAMPLE ticket is a plan (the rows' sampling arrays) naming the settled step whose kept logits it samples
    again; its plan comes back bit for bit; one that does not fit is refused, nothing written."""
    rng = np.random.default_rng(3)
    plan = random_plan(rng, 5, 5, 2, 1, 0)
    with TicketRing.create(GEOMETRY) as ring:
        ring.write_resample(2, plan, of_seq=41)
        ring.publish_plan(2, 42)
        assert ring.plan_kind(2) == StepKind.RESAMPLE and ring.resample_of(2) == 41
        assert_plans_equal(ring.read_plan(2), plan)
        with pytest.raises(ValueError, match="holds at most"):
            ring.write_resample(1, random_plan(rng, GEOMETRY.max_rows + 1, GEOMETRY.max_rows + 1, 2, 1, 0), of_seq=40)
        assert ring.plan_kind(1) == StepKind.STEP
    with pytest.raises(ValueError, match="cannot be launched"):
        check_ticket(StepKind.RESAMPLE, 1, 1)  # only through Device.resample, which names the step


def test_a_plan_with_grammar_rows_drafts_and_state_slots_round_trips_and_the_header_keeps_the_geometry():
    """Version 5 carries both the grammar bitmask / drafts and the state slots: a plan with all of them comes
    back bit for bit through a second mapping, which reads max_bitmask_words and max_burst back."""
    geometry = dataclasses.replace(GEOMETRY, max_burst=3)
    rng = np.random.default_rng(12)
    plan = random_plan(rng, 6, 4, 2, 1, 3)
    plan.grammar_bitmask = rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int32)
    plan.num_drafts = np.array([0, 2, 1, 0], dtype=np.int32)
    plan.state_slots = np.array([3, 0, 2, 1], dtype=np.int32)
    with TicketRing.create(geometry) as ring:
        ring.write_plan(1, plan, StepKind.BURST, steps=3)
        other = TicketRing.attach(ring.name)
        try:
            assert other.geometry == geometry and ticket_layout.VERSION == 13
            assert other.plan_kind(1) == StepKind.BURST and other.plan_steps(1) == 3
            assert_plans_equal(other.read_plan(1), plan)
            ring.write_resample(2, random_plan(rng, 2, 2, 1, 1, 0), of_seq=7)  # another slot's ticket leaves it alone
            assert_plans_equal(other.read_plan(1), plan)
        finally:
            other.close()


def test_control_block_fields_are_distinct_and_in_the_engine_half():
    """The engine-written counts (grammar rows and words, steps, state slots, a RESAMPLE ticket's step) never
    share an int64, and all sit before the worker-written half."""
    engine = [getattr(ticket_layout, n) for n in ("C_PLAN_SEQ", "C_T", "C_R", "C_B", "C_K", "C_H", "C_SO", "C_SI",
                                                   "C_G", "C_W", "C_STEPS", "C_S", "C_RESAMPLE_OF", "C_BI",
                                                   "C_KIND", "C_LORA_SLOT")]
    assert len(set(engine)) == len(engine) and max(engine) < ticket_layout.C_RESULT_SEQ
    assert ticket_layout.C_RESULT_SEQ * 8 == 128 and ticket_layout.CTRL_BYTES == 384  # the worker's line between
    assert 256 <= ticket_layout.C_PI * 8 < ticket_layout.CTRL_BYTES  # the engine's third line
    assert ticket_layout.N_GEOMETRY == len(dataclasses.fields(RingGeometry))
    assert ticket_layout.H_GEOMETRY + ticket_layout.N_GEOMETRY <= ticket_layout.H_WORKER


def test_a_bitmask_wider_than_the_ring_or_state_slots_not_one_per_row_are_rejected(ring):
    rng = np.random.default_rng(13)
    wide = random_plan(rng, 2, 2, 1, 1, 0)
    wide.grammar_bitmask = np.zeros((1, GEOMETRY.max_bitmask_words + 1), dtype=np.int32)
    with pytest.raises(ValueError, match="grammar bitmask"):
        ring.write_plan(0, wide)
    short = random_plan(rng, 2, 2, 1, 1, 0)
    short.state_slots = np.zeros(1, dtype=np.int32)
    with pytest.raises(ValueError, match="state slots"):
        ring.write_plan(0, short)

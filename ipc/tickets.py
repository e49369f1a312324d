"""The ticket ring: step plans and results handed between processes through one shared-memory segment.

The engine core creates the ring; the GPU worker attaches to it. Ticket seq k lives in slot
k % num_slots. The engine writes a plan's arrays and counts into the slot, then publishes the plan's
sequence number; the worker reads the seq first, then the arrays (zero-copy views), runs the step,
writes the result and publishes the result's seq. Nothing is pickled: every field has a fixed dtype
and a fixed-capacity region sized by RingGeometry (the layout is ticket_layout.py's; naming, releasing
and sweeping segments is segments.py's).

Memory ordering: every sequence number and count is an aligned int64 written by one plain store.
On x86-64 (TSO) stores become visible in program order and loads are not reordered with other loads,
so "payload, then seq" on one side and "seq, then payload" on the other is enough without fences.
On weakly ordered CPUs (aarch64) the spin path is not safe; WorkerDevice and the worker turn the
spin off there (see SPIN_IS_SAFE) and rely on the doorbell, whose syscalls order memory.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
import weakref
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from .plan import StepKind, StepPlan, StepResult, check_ticket
from .segments import (
    SEGMENT_PREFIX,
    SHM_DIR,
    attach_untracked,
    owner_pid_of,
    release,
    segment_name,
    sweep_orphans,
    sweep_segments,
)
from .ticket_layout import (
    C_B,
    C_BI,
    C_PI,
    C_ERR_LEN,
    C_EXEC_NS,
    C_G,
    C_H,
    C_K,
    C_KIND,
    C_RESAMPLE_OF,
    C_LORA_SLOT,
    C_PLAN_SEQ,
    C_R,
    C_RES_FLAGS,
    C_RES_N,
    C_RES_P,
    C_RES_PN,
    C_RES_Q,
    C_RES_QD,
    C_RES_R,
    C_RES_STEPS,
    C_RESULT_SEQ,
    C_S,
    C_SI,
    C_SO,
    C_STATUS,
    C_STEPS,
    C_T,
    C_W,
    H_GEOMETRY,
    H_MAGIC,
    H_OWNER_PID,
    H_SLOT_BYTES,
    H_VERSION,
    H_WORKER,
    HAS_LOGPROBS,
    HAS_POOLED,
    HAS_PROMPT,
    HAS_TOP,
    HEADER_BYTES,
    MAGIC,
    N_GEOMETRY,
    PLAN_FIELDS,
    PLAN_NAMES,
    RESULT_FIELDS,
    TEXT_FIELDS,
    STATUS_ERROR,
    STATUS_OK,
    VERSION,
    RingGeometry,
    check_geometry,
    plan_counts,
    region_lengths,
    region_offsets,
    regions,
    pooled_counts,
    prompt_counts,
    result_counts,
)

# What importers take from here: the ring, and the layout and segment names it is used with.
__all__ = [
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "SPIN_IS_SAFE",
    "STATUS_ERROR",
    "STATUS_OK",
    "RingGeometry",
    "TicketRing",
    "WorkerStats",
    "owner_pid_of",
    "segment_name",
    "sweep_orphans",
    "sweep_segments",
]

_sched_yield = getattr(os, "sched_yield", lambda: None)
SPIN_IS_SAFE = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """The worker's own clock of a run: time waiting for plans vs time executing them."""

    worker_pid: int
    started_ns: int  # time.monotonic_ns() when the worker began serving (0: not yet)
    now_ns: int
    idle_ns: int  # waiting for a plan (spin + doorbell), the wait in progress included
    busy_ns: int  # reading plans, executing, writing results
    steps: int

    @property
    def wall_ns(self) -> int:
        """Wall time the figures cover (0 before the worker began serving)."""
        return self.now_ns - self.started_ns if self.started_ns else 0

    @property
    def idle_fraction(self) -> float:
        """Share of the worker's wall time spent waiting for the engine core."""
        return self.idle_ns / self.wall_ns if self.wall_ns > 0 else 0.0

    def since(self, earlier: WorkerStats) -> WorkerStats:
        """The figures of the interval between an earlier snapshot and this one."""
        return WorkerStats(
            worker_pid=self.worker_pid,
            started_ns=earlier.now_ns,
            now_ns=self.now_ns,
            idle_ns=self.idle_ns - earlier.idle_ns,
            busy_ns=self.busy_ns - earlier.busy_ns,
            steps=self.steps - earlier.steps,
        )


class TicketRing:
    """A ring of ticket slots in one shared-memory segment; create() owns it, attach() borrows it."""

    def __init__(self, shm: SharedMemory, name: str, owner: bool) -> None:
        """Map the layout onto an open segment (use create() or attach())."""
        self.name = name
        self.owner = owner
        self._shm = shm
        base = np.frombuffer(shm.buf, dtype=np.uint8)
        self._q = base.view(np.int64)  # header + control blocks as int64s (aligned)
        if int(self._q[H_MAGIC]) != MAGIC or int(self._q[H_VERSION]) != VERSION:
            raise ValueError(f"{name}: not a metrale ticket ring of version {VERSION}")
        self.geometry = RingGeometry(*(int(v) for v in self._q[H_GEOMETRY : H_GEOMETRY + N_GEOMETRY]))
        self.num_slots = self.geometry.num_slots
        slot_bytes = int(self._q[H_SLOT_BYTES])
        self._ctrl = [(HEADER_BYTES + s * slot_bytes) // 8 for s in range(self.num_slots)]
        offsets = region_offsets(self.geometry)
        slot_at = [HEADER_BYTES + s * slot_bytes for s in range(self.num_slots)]
        self._plan_regions = [regions(base, at, offsets, self.geometry, PLAN_FIELDS) for at in slot_at]
        self._result_regions = [regions(base, at, offsets, self.geometry, RESULT_FIELDS) for at in slot_at]
        self._text_regions = [regions(base, at, offsets, self.geometry, TEXT_FIELDS)[0] for at in slot_at]
        self._plan_cache: list[tuple[tuple | None, list[np.ndarray] | None]] = [(None, None)] * self.num_slots
        # The header and control blocks as int64s read and written one at a time: the hot spin reads
        # a seq through this memoryview, several times cheaper than numpy scalar indexing.
        self._seqs = shm.buf.cast("q")
        self._finalizer = weakref.finalize(self, release, shm, self._seqs, owner)

    # ---- lifetime -----------------------------------------------------------------------

    @classmethod
    def create(cls, geometry: RingGeometry, token: str | None = None) -> TicketRing:
        """Create a fresh ring owned by this process (mode 0600, unlinked on close/exit/GC)."""
        check_geometry(geometry)
        offsets = region_offsets(geometry)
        slot_bytes = offsets["_end"]
        name = segment_name(os.getpid(), token)
        size = HEADER_BYTES + geometry.num_slots * slot_bytes
        shm = SharedMemory(name=name, create=True, size=size)
        try:
            os.fchmod(shm._fd, 0o600)  # the default already, but umask-independent and explicit
            q = np.frombuffer(shm.buf, dtype=np.int64, count=HEADER_BYTES // 8)
            q[H_MAGIC], q[H_VERSION], q[H_OWNER_PID], q[H_SLOT_BYTES] = MAGIC, VERSION, os.getpid(), slot_bytes
            q[H_GEOMETRY : H_GEOMETRY + N_GEOMETRY] = dataclasses.astuple(geometry)
            del q
            return cls(shm, name, owner=True)
        except BaseException:
            release(shm, None, True)
            raise

    @classmethod
    def attach(cls, name: str) -> TicketRing:
        """Attach to a ring another process created; this side never unlinks it."""
        shm = attach_untracked(name)
        try:
            return cls(shm, name, owner=False)
        except BaseException:
            release(shm, None, False)
            raise

    def close(self) -> None:
        """Unmap the ring; the owner also unlinks the segment. Idempotent."""
        self._plan_regions = self._result_regions = self._text_regions = self._plan_cache = []
        self._q = None
        self._finalizer()

    def __enter__(self) -> TicketRing:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- plans (engine writes, worker reads) ----------------------------------------------

    def write_plan(self, slot: int, plan: StepPlan, kind: StepKind = StepKind.STEP, steps: int = 1) -> None:
        """Copy a plan, its kind and its counts into a slot; ValueError (nothing written) if it does not fit.

        A BURST runs `steps` decode steps (ModelRunner.execute_burst); every other kind one. Values are cast to
        the slot's dtypes (the StepPlan ones) as numpy assignment does."""
        check_ticket(kind, steps, self.geometry.max_burst)
        counts = plan_counts(plan, self.geometry)
        for name, view in zip(PLAN_NAMES, self._plan_views(slot, counts)):
            view[...] = getattr(plan, name)
        c = self._ctrl[slot]
        self._q[c + C_T : c + C_STEPS + 1] = (*counts[:9], steps)
        self._q[c + C_S], self._q[c + C_BI], self._q[c + C_PI], self._q[c + C_KIND] = *counts[9:12], kind

    def publish_plan(self, slot: int, seq: int) -> None:
        """Make the plan written in a slot visible as ticket seq (after write_plan)."""
        self._seqs[self._ctrl[slot] + C_PLAN_SEQ] = seq

    def plan_kind(self, slot: int) -> StepKind:
        """What the slot's ticket asks for (RESAMPLE: see write_resample; LORA: see write_lora_request)."""
        return StepKind(self._seqs[self._ctrl[slot] + C_KIND])

    def plan_steps(self, slot: int) -> int:
        """How many steps the slot's plan asks for (1, or a BURST's)."""
        return self._seqs[self._ctrl[slot] + C_STEPS]

    def write_resample(self, slot: int, plan: StepPlan, of_seq: int) -> None:
        """Make the slot a RESAMPLE ticket: pick again for the sampling rows of the settled step of ticket of_seq,
        from the logits the worker kept, under plan's sampling arrays (publish it like a plan); ValueError
        (nothing written) if the plan does not fit."""
        self.write_plan(slot, plan)
        c = self._ctrl[slot]
        self._seqs[c + C_RESAMPLE_OF] = of_seq
        self._seqs[c + C_KIND] = StepKind.RESAMPLE

    def write_lora_request(self, slot: int, lora_slot: int, path: str) -> None:
        """Make the slot a LoRA ticket: load the adapter at path into lora_slot ("" empties it); publish it like a
        plan. ValueError (nothing written) for a path longer than the text region."""
        raw = path.encode("utf-8")
        text = self._text_regions[slot]
        if len(raw) >= len(text):
            raise ValueError(f"a LoRA adapter path of {len(raw)} bytes; the ticket ring holds {len(text) - 1}")
        text[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        text[len(raw)] = 0
        c = self._ctrl[slot]
        self._seqs[c + C_LORA_SLOT] = lora_slot
        self._seqs[c + C_KIND] = StepKind.LORA

    def lora_request(self, slot: int) -> tuple[int, str]:
        """A LoRA ticket's (adapter slot, path) ("" to empty the slot)."""
        text = self._text_regions[slot]
        end = int(np.argmax(text == 0))
        return self._seqs[self._ctrl[slot] + C_LORA_SLOT], text[:end].tobytes().decode("utf-8")

    def resample_of(self, slot: int) -> int:
        """The seq of the step whose kept logits a RESAMPLE ticket samples again."""
        return self._seqs[self._ctrl[slot] + C_RESAMPLE_OF]

    def plan_seq(self, slot: int) -> int:
        """The seq of the latest plan published in a slot (0: none yet)."""
        return self._seqs[self._ctrl[slot] + C_PLAN_SEQ]

    def read_plan(self, slot: int) -> StepPlan:
        """The slot's plan as zero-copy views, valid until the engine reuses the slot (do not keep them)."""
        c = self._ctrl[slot]
        q = self._seqs
        counts = (q[c + C_T], q[c + C_R], q[c + C_B], q[c + C_K], q[c + C_H], q[c + C_SO], q[c + C_SI], q[c + C_G],
                  q[c + C_W], q[c + C_S], q[c + C_BI], q[c + C_PI])
        return StepPlan(*self._plan_views(slot, counts))

    def _plan_views(self, slot: int, counts: tuple[int, ...]) -> list[np.ndarray]:
        """Views of a slot's plan regions for these counts, in field order; cached while counts repeat."""
        cached_counts, cached = self._plan_cache[slot]
        if cached_counts == counts:
            return cached
        lengths = region_lengths(*counts)
        r, b, k, so, si, g, w = counts[1], counts[2], counts[3], counts[5], counts[6], counts[7], counts[8]
        views = [region[: lengths[kind]] for (_, _, kind), region in zip(PLAN_FIELDS, self._plan_regions[slot])]
        views[5] = views[5].reshape(r, b)  # block_tables
        views[18] = views[18].reshape(r, k)  # ban_ids
        views[23] = views[23].reshape(so, 2)  # swap_out
        views[24] = views[24].reshape(si, 2)  # swap_in
        views[25] = views[25].reshape(g, w)  # grammar_bitmask
        self._plan_cache[slot] = (counts, views)
        return views

    def spin_for_plan(self, slot: int, seq: int, until_ns: int) -> bool:
        """Spin until plan seq is published in slot (True) or time.monotonic_ns() reaches until_ns."""
        return self._spin(self._ctrl[slot] + C_PLAN_SEQ, seq, until_ns)

    # ---- results (worker writes, engine reads) ---------------------------------------------

    def write_result(self, slot: int, result: StepResult, exec_ns: int = 0) -> None:
        """Copy a step's result into a slot; ValueError (nothing written) if it does not fit."""
        self.write_results(slot, [result], exec_ns)

    def write_results(self, slot: int, results: list[StepResult], exec_ns: int = 0) -> None:
        """Copy a burst's results (one per step, step after step) into a slot; ValueError (nothing
        written) if they do not fit."""
        r, n, flags = result_counts(results, self.geometry)
        p, pn = prompt_counts(results[0], self.geometry)
        pq, pd = pooled_counts(results[0], self.geometry)
        tokens, logprobs, top_ids, top_logprobs, _, prompt_lp, prompt_ids, prompt_top, pooled = self._result_regions[slot]
        for k, result in enumerate(results):
            np.copyto(tokens[k * r : (k + 1) * r], result.tokens, casting="same_kind")
            if flags & HAS_LOGPROBS:
                np.copyto(logprobs[k * r : (k + 1) * r], result.logprobs, casting="same_kind")
            if flags & HAS_TOP:
                at = k * r * n
                np.copyto(top_ids[at : at + r * n], result.top_ids.reshape(-1), casting="same_kind")
                np.copyto(top_logprobs[at : at + r * n], result.top_logprobs.reshape(-1), casting="same_kind")
        if results[0].prompt_logprobs is not None:
            flags |= HAS_PROMPT
            np.copyto(prompt_lp[:p], results[0].prompt_logprobs, casting="same_kind")
            if pn:
                np.copyto(prompt_ids[: p * pn], results[0].prompt_top_ids.reshape(-1), casting="same_kind")
                np.copyto(prompt_top[: p * pn], results[0].prompt_top_logprobs.reshape(-1), casting="same_kind")
        if results[0].pooled is not None:
            flags |= HAS_POOLED
            np.copyto(pooled[: pq * pd], results[0].pooled.reshape(-1), casting="same_kind")
        c = self._ctrl[slot]
        self._q[c + C_STATUS : c + C_RES_STEPS + 1] = (STATUS_OK, r, n, flags, 0, exec_ns, len(results))
        self._q[c + C_RES_P], self._q[c + C_RES_PN] = p, pn
        self._q[c + C_RES_Q], self._q[c + C_RES_QD] = pq, pd

    def write_error(self, slot: int, message: str, exec_ns: int = 0) -> None:
        """Record that a slot's step failed, with a message (truncated to error_msg_bytes)."""
        raw = message.encode("utf-8", "replace")[: self.geometry.error_msg_bytes]
        error = self._result_regions[slot][4]
        error[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        c = self._ctrl[slot]
        self._q[c + C_STATUS : c + C_RES_STEPS + 1] = (STATUS_ERROR, 0, 0, 0, len(raw), exec_ns, 0)

    def publish_result(self, slot: int, seq: int) -> None:
        """Make the result (or error) written in a slot visible as the answer to ticket seq."""
        self._seqs[self._ctrl[slot] + C_RESULT_SEQ] = seq

    def result_seq(self, slot: int) -> int:
        """The seq of the latest result published in a slot (0: none yet)."""
        return self._seqs[self._ctrl[slot] + C_RESULT_SEQ]

    def result_error(self, slot: int) -> str | None:
        """The error message of the slot's published result; None if the step succeeded."""
        c = self._ctrl[slot]
        if self._seqs[c + C_STATUS] == STATUS_OK:
            return None
        raw = self._result_regions[slot][4][: self._seqs[c + C_ERR_LEN]].tobytes()
        return raw.decode("utf-8", "replace")

    def read_result(self, slot: int, copy: bool = False, step: int = 0) -> StepResult:
        """The slot's result (of a burst's step `step`): zero-copy views valid until the slot is reused,
        or copies (copy=True)."""
        c = self._ctrl[slot]
        q = self._seqs
        r, n, flags = q[c + C_RES_R], q[c + C_RES_N], q[c + C_RES_FLAGS]
        tokens, logprobs, top_ids, top_logprobs, _, prompt_lp, prompt_ids, prompt_top, pooled = self._result_regions[slot]
        at, at_n = step * r, step * r * n
        result = StepResult(tokens=tokens[at : at + r], timings={"worker_execute_s": q[c + C_EXEC_NS] * 1e-9})
        if flags & HAS_LOGPROBS:
            result.logprobs = logprobs[at : at + r]
        if flags & HAS_TOP:
            result.top_ids = top_ids[at_n : at_n + r * n].reshape(r, n)
            result.top_logprobs = top_logprobs[at_n : at_n + r * n].reshape(r, n)
        if step == 0 and flags & HAS_PROMPT:
            p, pn = q[c + C_RES_P], q[c + C_RES_PN]
            result.prompt_logprobs = prompt_lp[:p]
            if pn:
                result.prompt_top_ids = prompt_ids[: p * pn].reshape(p, pn)
                result.prompt_top_logprobs = prompt_top[: p * pn].reshape(p, pn)
        if step == 0 and flags & HAS_POOLED:
            pq, pd = q[c + C_RES_Q], q[c + C_RES_QD]
            result.pooled = pooled[: pq * pd].reshape(pq, pd)
        if copy:
            result.tokens = result.tokens.copy()
            for name in ("logprobs", "top_ids", "top_logprobs", "prompt_logprobs", "prompt_top_ids", "prompt_top_logprobs",
                         "pooled"):
                if getattr(result, name) is not None:
                    setattr(result, name, getattr(result, name).copy())
        return result

    def read_results(self, slot: int) -> list[StepResult]:
        """Copies of every step's result in the slot (one, or a burst's)."""
        steps = self._seqs[self._ctrl[slot] + C_RES_STEPS]
        return [self.read_result(slot, copy=True, step=k) for k in range(steps)]

    def spin_for_result(self, slot: int, seq: int, until_ns: int) -> bool:
        """Spin until result seq is published in slot (True) or time.monotonic_ns() reaches until_ns."""
        return self._spin(self._ctrl[slot] + C_RESULT_SEQ, seq, until_ns)

    def _spin(self, index: int, seq: int, until_ns: int) -> bool:
        """Busy-wait for the int64 at index to equal seq, yielding the core every turn.

        The yield is what makes spinning safe on a 2-core host: when the peer (or anything else)
        is runnable on this core it runs at once instead of waiting out the spin; when nothing is,
        sched_yield returns in well under a microsecond."""
        q = self._seqs
        while q[index] != seq:
            if time.monotonic_ns() >= until_ns:
                return False
            _sched_yield()
        return True

    # ---- worker statistics (worker writes, anyone reads) ------------------------------------

    def store_worker_stats(
        self, pid: int, started_ns: int, idle_ns: int, busy_ns: int, steps: int, waiting_since_ns: int
    ) -> None:
        """Publish the worker's counters in the header (called by the worker).

        waiting_since_ns (0: not waiting) is written first: a wait that ends is no longer "in progress"
        before its time is added to idle_ns, so a reader between the two writes can count a wait short,
        never twice.
        """
        q = self._seqs
        q[H_WORKER + 5] = waiting_since_ns
        q[H_WORKER], q[H_WORKER + 1], q[H_WORKER + 2] = pid, started_ns, idle_ns
        q[H_WORKER + 3], q[H_WORKER + 4] = busy_ns, steps

    def worker_stats(self) -> WorkerStats:
        """A snapshot of the worker's counters, the wait in progress counted as idle."""
        q = self._seqs
        for _ in range(100):  # the worker updates the fields one by one: read until two reads agree
            waiting_since, idle_done = int(q[H_WORKER + 5]), int(q[H_WORKER + 2])
            now = time.monotonic_ns()
            if waiting_since == q[H_WORKER + 5] and idle_done == q[H_WORKER + 2]:
                break
        idle = idle_done + (now - waiting_since if waiting_since else 0)
        idle = max(0, min(idle, now - int(q[H_WORKER + 1])))  # never more than the wall time
        return WorkerStats(
            worker_pid=q[H_WORKER],
            started_ns=q[H_WORKER + 1],
            now_ns=now,
            idle_ns=idle,
            busy_ns=q[H_WORKER + 3],
            steps=q[H_WORKER + 4],
        )

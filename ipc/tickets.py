"""The ticket ring: a fixed layout of step plans and results in one shared-memory segment.

The engine core creates the ring; the GPU worker attaches to it. Ticket seq k lives in slot
k % num_slots. The engine writes a plan's arrays and counts into the slot, then publishes the plan's
sequence number; the worker reads the seq first, then the arrays (zero-copy views), runs the step,
writes the result and publishes the result's seq. Nothing is pickled: every field has a fixed dtype
and a fixed-capacity region sized by RingGeometry.

Memory ordering: every sequence number and count is an aligned int64 written by one plain store.
On x86-64 (TSO) stores become visible in program order and loads are not reordered with other loads,
so "payload, then seq" on one side and "seq, then payload" on the other is enough without fences.
On weakly ordered CPUs (aarch64) the spin path is not safe; WorkerDevice and the worker turn the
spin off there (see SPIN_IS_SAFE) and rely on the doorbell, whose syscalls order memory.

Segment names are "metrale-<owner pid>-<token>" with mode 0600, so a supervisor can sweep what a dead
owner left in /dev/shm (sweep_orphans) and nobody else can read the plans.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import secrets
import sys
import time
import weakref
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import psutil

from .plan import StepPlan, StepResult

SEGMENT_PREFIX = "metrale-"
SHM_DIR = "/dev/shm"
MAGIC = 0x474E52454C52544D  # b"MTRLERNG" little-endian
VERSION = 2
_sched_yield = getattr(os, "sched_yield", lambda: None)
SPIN_IS_SAFE = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")

STATUS_OK = 0
STATUS_ERROR = 1

_ALIGN = 64
_HEADER_BYTES = 4096
_CTRL_BYTES = 256  # two 128-byte halves: engine-written and worker-written (no false sharing)

# Header int64 indices.
_H_MAGIC, _H_VERSION, _H_OWNER_PID, _H_SLOT_BYTES = 0, 1, 2, 3
_H_GEOMETRY = 4  # the nine RingGeometry fields, in order
_H_WORKER = 16  # worker_pid, started_ns, idle_ns, busy_ns, steps, waiting_since_ns (worker-written)
# Control block int64 indices (relative to the slot's first int64).
_C_PLAN_SEQ, _C_T, _C_R, _C_B, _C_K, _C_H, _C_SO, _C_SI = 0, 1, 2, 3, 4, 5, 6, 7
_C_RESULT_SEQ, _C_STATUS, _C_RES_R, _C_RES_N, _C_RES_FLAGS, _C_ERR_LEN, _C_EXEC_NS = range(16, 23)
_HAS_LOGPROBS, _HAS_TOP = 1, 2

# Every StepPlan field: (name, dtype, length kind). Kinds: T tokens, R rows, R1 rows + 1,
# RB rows × block-table width, RK rows × ban width, H history tokens, SO / SI swap pairs × 2.
_PLAN_FIELDS = (
    ("input_ids", np.int32, "T"),
    ("positions", np.int32, "T"),
    ("slot_mapping", np.int64, "T"),
    ("query_start", np.int32, "R1"),
    ("seq_lens", np.int32, "R"),
    ("block_tables", np.int32, "RB"),
    ("sample", np.bool_, "R"),
    ("feed_from_row", np.int32, "R"),
    ("temperature", np.float32, "R"),
    ("top_k", np.int32, "R"),
    ("top_p", np.float32, "R"),
    ("min_p", np.float32, "R"),
    ("repetition_penalty", np.float32, "R"),
    ("presence_penalty", np.float32, "R"),
    ("frequency_penalty", np.float32, "R"),
    ("seeds", np.int64, "R"),
    ("mask_kind", np.uint8, "R"),
    ("force_token", np.int32, "R"),
    ("ban_ids", np.int32, "RK"),
    ("num_logprobs", np.int32, "R"),
    ("hist_tokens", np.int32, "H"),
    ("hist_start", np.int32, "R1"),
    ("hist_prompt_len", np.int32, "R"),
    ("swap_out", np.int32, "SO"),
    ("swap_in", np.int32, "SI"),
)
assert tuple(f[0] for f in _PLAN_FIELDS) == tuple(f.name for f in dataclasses.fields(StepPlan)), (
    "StepPlan changed: update the ticket layout"
)
_PLAN_NAMES = tuple(f[0] for f in _PLAN_FIELDS)
_N_GEOMETRY = 9  # RingGeometry's fields in the header

# StepResult arrays: tokens and logprobs per row, top-N per row (RN), the error message (E).
_RESULT_FIELDS = (
    ("tokens", np.int32, "R"),
    ("logprobs", np.float32, "R"),
    ("top_ids", np.int32, "RN"),
    ("top_logprobs", np.float32, "RN"),
    ("error", np.uint8, "E"),
)


@dataclass(frozen=True, slots=True)
class RingGeometry:
    """The ring's shape: how many slots, and the capacity of every plan and result region."""

    num_slots: int = 4
    max_tokens: int = 8192
    max_rows: int = 256
    max_blocks_per_row: int = 512
    max_ban_ids: int = 16
    max_hist_tokens: int = 65536
    max_logprobs: int = 20
    error_msg_bytes: int = 4096
    max_swaps: int = 4096  # block copies per step, each way

    def capacity(self, kind: str) -> int:
        """Elements a region of this length kind holds."""
        return {
            "T": self.max_tokens,
            "R": self.max_rows,
            "R1": self.max_rows + 1,
            "RB": self.max_rows * self.max_blocks_per_row,
            "RK": self.max_rows * self.max_ban_ids,
            "H": self.max_hist_tokens,
            "RN": self.max_rows * self.max_logprobs,
            "E": self.error_msg_bytes,
            "SO": 2 * self.max_swaps,
            "SI": 2 * self.max_swaps,
        }[kind]


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


def segment_name(owner_pid: int, token: str | None = None) -> str:
    """The segment name for an owner pid: "metrale-<pid>-<token>" (a random token by default)."""
    return f"{SEGMENT_PREFIX}{owner_pid}-{token or secrets.token_hex(6)}"


def owner_pid_of(name: str) -> int | None:
    """The owner pid encoded in a segment (or doorbell) name; None if the name is not ours."""
    if not name.startswith(SEGMENT_PREFIX):
        return None
    pid, _, rest = name[len(SEGMENT_PREFIX) :].partition("-")
    return int(pid) if pid.isdigit() and rest else None


class TicketRing:
    """A ring of ticket slots in one shared-memory segment; create() owns it, attach() borrows it."""

    def __init__(self, shm: SharedMemory, name: str, owner: bool) -> None:
        """Map the layout onto an open segment (use create() or attach())."""
        self.name = name
        self.owner = owner
        self._shm = shm
        base = np.frombuffer(shm.buf, dtype=np.uint8)
        self._q = base.view(np.int64)  # header + control blocks as int64s (aligned)
        if int(self._q[_H_MAGIC]) != MAGIC or int(self._q[_H_VERSION]) != VERSION:
            raise ValueError(f"{name}: not a metrale ticket ring of version {VERSION}")
        self.geometry = RingGeometry(*(int(v) for v in self._q[_H_GEOMETRY : _H_GEOMETRY + _N_GEOMETRY]))
        self.num_slots = self.geometry.num_slots
        slot_bytes = int(self._q[_H_SLOT_BYTES])
        self._ctrl = [(_HEADER_BYTES + s * slot_bytes) // 8 for s in range(self.num_slots)]
        offsets = _region_offsets(self.geometry)
        slot_at = [_HEADER_BYTES + s * slot_bytes for s in range(self.num_slots)]
        self._plan_regions = [_regions(base, at, offsets, self.geometry, _PLAN_FIELDS) for at in slot_at]
        self._result_regions = [_regions(base, at, offsets, self.geometry, _RESULT_FIELDS) for at in slot_at]
        self._plan_cache: list[tuple[tuple | None, list[np.ndarray] | None]] = [(None, None)] * self.num_slots
        # The header and control blocks as int64s read and written one at a time: the hot spin reads
        # a seq through this memoryview, several times cheaper than numpy scalar indexing.
        self._seqs = shm.buf.cast("q")
        self._finalizer = weakref.finalize(self, _release, shm, self._seqs, owner)

    # ---- lifetime -----------------------------------------------------------------------

    @classmethod
    def create(cls, geometry: RingGeometry, token: str | None = None) -> TicketRing:
        """Create a fresh ring owned by this process (mode 0600, unlinked on close/exit/GC)."""
        _check_geometry(geometry)
        offsets = _region_offsets(geometry)
        slot_bytes = offsets["_end"]
        name = segment_name(os.getpid(), token)
        shm = SharedMemory(name=name, create=True, size=_HEADER_BYTES + geometry.num_slots * slot_bytes)
        try:
            os.fchmod(shm._fd, 0o600)  # the default already, but umask-independent and explicit
            q = np.frombuffer(shm.buf, dtype=np.int64, count=_HEADER_BYTES // 8)
            q[_H_MAGIC], q[_H_VERSION], q[_H_OWNER_PID], q[_H_SLOT_BYTES] = MAGIC, VERSION, os.getpid(), slot_bytes
            q[_H_GEOMETRY : _H_GEOMETRY + _N_GEOMETRY] = dataclasses.astuple(geometry)
            del q
            return cls(shm, name, owner=True)
        except BaseException:
            _release(shm, None, True)
            raise

    @classmethod
    def attach(cls, name: str) -> TicketRing:
        """Attach to a ring another process created; this side never unlinks it."""
        shm = _attach_untracked(name)
        try:
            return cls(shm, name, owner=False)
        except BaseException:
            _release(shm, None, False)
            raise

    def close(self) -> None:
        """Unmap the ring; the owner also unlinks the segment. Idempotent."""
        self._plan_regions = self._result_regions = self._plan_cache = []
        self._q = None
        self._finalizer()

    def __enter__(self) -> TicketRing:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- plans (engine writes, worker reads) ----------------------------------------------

    def write_plan(self, slot: int, plan: StepPlan) -> None:
        """Copy a plan's arrays and counts into a slot; ValueError (nothing written) if it does not fit.

        Values are cast to the slot's dtypes (the StepPlan ones) as numpy assignment does."""
        counts = self._plan_counts(plan)
        for name, view in zip(_PLAN_NAMES, self._plan_views(slot, counts)):
            view[...] = getattr(plan, name)
        c = self._ctrl[slot]
        self._q[c + _C_T : c + _C_SI + 1] = counts

    def publish_plan(self, slot: int, seq: int) -> None:
        """Make the plan written in a slot visible as ticket seq (after write_plan)."""
        self._seqs[self._ctrl[slot] + _C_PLAN_SEQ] = seq

    def plan_seq(self, slot: int) -> int:
        """The seq of the latest plan published in a slot (0: none yet)."""
        return self._seqs[self._ctrl[slot] + _C_PLAN_SEQ]

    def read_plan(self, slot: int) -> StepPlan:
        """The slot's plan as zero-copy views, valid until the engine reuses the slot (do not keep them)."""
        c = self._ctrl[slot]
        q = self._seqs
        counts = (q[c + _C_T], q[c + _C_R], q[c + _C_B], q[c + _C_K], q[c + _C_H], q[c + _C_SO], q[c + _C_SI])
        return StepPlan(*self._plan_views(slot, counts))

    def _plan_views(self, slot: int, counts: tuple[int, ...]) -> list[np.ndarray]:
        """Views of a slot's plan regions for these counts, in field order; cached while counts repeat."""
        cached_counts, cached = self._plan_cache[slot]
        if cached_counts == counts:
            return cached
        t, r, b, k, h, so, si = counts
        lengths = _lengths(t, r, b, k, h, so, si)
        views = [region[: lengths[kind]] for (_, _, kind), region in zip(_PLAN_FIELDS, self._plan_regions[slot])]
        views[5] = views[5].reshape(r, b)  # block_tables
        views[18] = views[18].reshape(r, k)  # ban_ids
        views[23] = views[23].reshape(so, 2)  # swap_out
        views[24] = views[24].reshape(si, 2)  # swap_in
        self._plan_cache[slot] = (counts, views)
        return views

    def spin_for_plan(self, slot: int, seq: int, until_ns: int) -> bool:
        """Spin until plan seq is published in slot (True) or time.monotonic_ns() reaches until_ns."""
        return self._spin(self._ctrl[slot] + _C_PLAN_SEQ, seq, until_ns)

    # ---- results (worker writes, engine reads) ---------------------------------------------

    def write_result(self, slot: int, result: StepResult, exec_ns: int = 0) -> None:
        """Copy a step's result into a slot; ValueError (nothing written) if it does not fit."""
        r, n, flags = self._result_counts(result)
        tokens, logprobs, top_ids, top_logprobs, _ = self._result_regions[slot]
        np.copyto(tokens[:r], result.tokens, casting="same_kind")
        if flags & _HAS_LOGPROBS:
            np.copyto(logprobs[:r], result.logprobs, casting="same_kind")
        if flags & _HAS_TOP:
            np.copyto(top_ids[: r * n], result.top_ids.reshape(-1), casting="same_kind")
            np.copyto(top_logprobs[: r * n], result.top_logprobs.reshape(-1), casting="same_kind")
        c = self._ctrl[slot]
        self._q[c + _C_STATUS : c + _C_EXEC_NS + 1] = (STATUS_OK, r, n, flags, 0, exec_ns)

    def write_error(self, slot: int, message: str, exec_ns: int = 0) -> None:
        """Record that a slot's step failed, with a message (truncated to error_msg_bytes)."""
        raw = message.encode("utf-8", "replace")[: self.geometry.error_msg_bytes]
        error = self._result_regions[slot][4]
        error[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        c = self._ctrl[slot]
        self._q[c + _C_STATUS : c + _C_EXEC_NS + 1] = (STATUS_ERROR, 0, 0, 0, len(raw), exec_ns)

    def publish_result(self, slot: int, seq: int) -> None:
        """Make the result (or error) written in a slot visible as the answer to ticket seq."""
        self._seqs[self._ctrl[slot] + _C_RESULT_SEQ] = seq

    def result_seq(self, slot: int) -> int:
        """The seq of the latest result published in a slot (0: none yet)."""
        return self._seqs[self._ctrl[slot] + _C_RESULT_SEQ]

    def result_error(self, slot: int) -> str | None:
        """The error message of the slot's published result; None if the step succeeded."""
        c = self._ctrl[slot]
        if self._seqs[c + _C_STATUS] == STATUS_OK:
            return None
        raw = self._result_regions[slot][4][: self._seqs[c + _C_ERR_LEN]].tobytes()
        return raw.decode("utf-8", "replace")

    def read_result(self, slot: int, copy: bool = False) -> StepResult:
        """The slot's result: zero-copy views valid until the slot is reused, or copies (copy=True)."""
        c = self._ctrl[slot]
        q = self._seqs
        r, n, flags = q[c + _C_RES_R], q[c + _C_RES_N], q[c + _C_RES_FLAGS]
        tokens, logprobs, top_ids, top_logprobs, _ = self._result_regions[slot]
        result = StepResult(tokens=tokens[:r], timings={"worker_execute_s": q[c + _C_EXEC_NS] * 1e-9})
        if flags & _HAS_LOGPROBS:
            result.logprobs = logprobs[:r]
        if flags & _HAS_TOP:
            result.top_ids = top_ids[: r * n].reshape(r, n)
            result.top_logprobs = top_logprobs[: r * n].reshape(r, n)
        if copy:
            result.tokens = result.tokens.copy()
            for name in ("logprobs", "top_ids", "top_logprobs"):
                if getattr(result, name) is not None:
                    setattr(result, name, getattr(result, name).copy())
        return result

    def spin_for_result(self, slot: int, seq: int, until_ns: int) -> bool:
        """Spin until result seq is published in slot (True) or time.monotonic_ns() reaches until_ns."""
        return self._spin(self._ctrl[slot] + _C_RESULT_SEQ, seq, until_ns)

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
        """Publish the worker's counters in the header (called by the worker)."""
        q = self._seqs
        q[_H_WORKER], q[_H_WORKER + 1], q[_H_WORKER + 2] = pid, started_ns, idle_ns
        q[_H_WORKER + 3], q[_H_WORKER + 4], q[_H_WORKER + 5] = busy_ns, steps, waiting_since_ns

    def mark_waiting(self, since_ns: int) -> None:
        """Note that the worker began (since_ns > 0) or ended (0) a wait for a plan."""
        self._seqs[_H_WORKER + 5] = since_ns

    def worker_stats(self) -> WorkerStats:
        """A snapshot of the worker's counters, the wait in progress counted as idle."""
        q = self._seqs
        for _ in range(100):  # the worker updates the fields one by one: read until two reads agree
            waiting_since, idle_done = int(q[_H_WORKER + 5]), int(q[_H_WORKER + 2])
            now = time.monotonic_ns()
            if waiting_since == q[_H_WORKER + 5] and idle_done == q[_H_WORKER + 2]:
                break
        idle = idle_done + (now - waiting_since if waiting_since else 0)
        idle = max(0, min(idle, now - int(q[_H_WORKER + 1])))  # never more than the wall time
        return WorkerStats(
            worker_pid=q[_H_WORKER],
            started_ns=q[_H_WORKER + 1],
            now_ns=now,
            idle_ns=idle,
            busy_ns=q[_H_WORKER + 3],
            steps=q[_H_WORKER + 4],
        )

    # ---- validation -----------------------------------------------------------------------

    def _plan_counts(self, plan: StepPlan) -> tuple[int, ...]:
        """(T, R, B, K, H, SO, SI) of a plan, checked against its own arrays and the ring's capacity."""
        g = self.geometry
        t, r, h = len(plan.input_ids), len(plan.seq_lens), len(plan.hist_tokens)
        so, si = len(plan.swap_out), len(plan.swap_in)
        if so > g.max_swaps or si > g.max_swaps:
            raise ValueError(f"plan has {max(so, si)} block copies, the ticket ring holds at most {g.max_swaps}")
        b = _width(plan.block_tables, r, "block_tables")
        k = _width(plan.ban_ids, r, "ban_ids")
        if t > g.max_tokens or r > g.max_rows or b > g.max_blocks_per_row or k > g.max_ban_ids or h > g.max_hist_tokens:
            for value, limit, what in (
                (t, g.max_tokens, "tokens"),
                (r, g.max_rows, "rows"),
                (b, g.max_blocks_per_row, "blocks per row"),
                (k, g.max_ban_ids, "banned ids per row"),
                (h, g.max_hist_tokens, "history tokens"),
            ):
                if value > limit:
                    raise ValueError(f"plan has {value} {what}, the ticket ring holds at most {limit}")
        shapes = {"T": (t,), "R": (r,), "R1": (r + 1,), "RB": (r, b), "RK": (r, k), "H": (h,), "SO": (so, 2), "SI": (si, 2)}
        for name, _, kind in _PLAN_FIELDS:
            if getattr(plan, name).shape != shapes[kind]:
                raise ValueError(f"plan.{name} has shape {getattr(plan, name).shape}, expected {shapes[kind]}")
        return t, r, b, k, h, so, si

    def _result_counts(self, result: StepResult) -> tuple[int, int, int]:
        """(R, N, flags) of a result, checked against its own arrays and the ring's capacity."""
        g = self.geometry
        r = len(result.tokens)
        if r > g.max_rows:
            raise ValueError(f"result has {r} rows, the ticket ring holds at most {g.max_rows}")
        flags, n = 0, 0
        if result.logprobs is not None:
            if len(result.logprobs) != r:
                raise ValueError(f"result.logprobs has {len(result.logprobs)} rows, expected {r}")
            flags |= _HAS_LOGPROBS
        if result.top_ids is not None:
            n = _width(result.top_ids, r, "top_ids")
            if result.top_logprobs is None or result.top_logprobs.shape != result.top_ids.shape:
                raise ValueError("result.top_logprobs must have the shape of result.top_ids")
            if n > g.max_logprobs:
                raise ValueError(f"result has {n} top logprobs per row, the ticket ring holds at most {g.max_logprobs}")
            flags |= _HAS_TOP
        return r, n, flags


# ---- sweeping leftovers ----------------------------------------------------------------------


def sweep_segments(owner_pids: set[int] | list[int], shm_dir: str = SHM_DIR) -> list[str]:
    """Remove every metrale segment (and doorbell socket) in shm_dir owned by one of these pids."""
    pids = set(owner_pids)
    return _sweep(shm_dir, lambda pid, path: pid in pids)


def sweep_orphans(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove every metrale segment (and doorbell socket) in shm_dir whose owner process is gone."""
    return _sweep(shm_dir, lambda pid, path: not _owner_alive(pid, path))


def _sweep(shm_dir: str, doomed) -> list[str]:
    """Unlink the entries of shm_dir named for an owner pid that doomed(pid, path) selects."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        pid = owner_pid_of(name)
        path = os.path.join(shm_dir, name)
        if pid is not None and doomed(pid, path):
            try:
                os.unlink(path)
                removed.append(name)
            except FileNotFoundError:
                pass  # its owner (or another sweeper) got there first
    return removed


def _owner_alive(pid: int, path: str) -> bool:
    """Whether the process that created path still runs (a zombie, or a reused pid, does not count)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        created = proc.create_time()
        born = os.stat(path).st_mtime  # the segment's ftruncate, shortly after its owner started
    except (psutil.NoSuchProcess, FileNotFoundError):
        return False
    except psutil.AccessDenied:
        return True
    return created <= born + 1.0  # a process born after the segment is a reused pid


# ---- helpers ----------------------------------------------------------------------------------


def _check_geometry(g: RingGeometry) -> None:
    """ValueError unless every capacity is positive."""
    for f in dataclasses.fields(g):
        if getattr(g, f.name) < 1:
            raise ValueError(f"RingGeometry.{f.name} must be >= 1, got {getattr(g, f.name)}")


def _region_offsets(g: RingGeometry) -> dict[str, int]:
    """Byte offset of every region inside a slot (aligned to 64), and the slot size under "_end"."""
    offsets, at = {}, _CTRL_BYTES
    for name, dtype, kind in _PLAN_FIELDS + _RESULT_FIELDS:
        offsets[name] = at
        at += -(-g.capacity(kind) * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
    offsets["_end"] = -(-at // 4096) * 4096
    return offsets


def _regions(base: np.ndarray, slot_at: int, offsets: dict[str, int], g: RingGeometry, fields) -> list[np.ndarray]:
    """Full-capacity 1-D arrays of one slot's regions, in field order."""
    out = []
    for name, dtype, kind in fields:
        start = slot_at + offsets[name]
        out.append(base[start : start + g.capacity(kind) * np.dtype(dtype).itemsize].view(dtype))
    return out


def _lengths(t: int, r: int, b: int, k: int, h: int, so: int, si: int) -> dict[str, int]:
    """Element count of each length kind for a plan's counts."""
    return {"T": t, "R": r, "R1": r + 1, "RB": r * b, "RK": r * k, "H": h, "SO": 2 * so, "SI": 2 * si}


def _width(array: np.ndarray, rows: int, name: str) -> int:
    """The column count of a 2-D per-row array; ValueError if it is not [rows, width]."""
    if array.ndim != 2 or array.shape[0] != rows:
        raise ValueError(f"{name} must have shape [{rows}, width], got {array.shape}")
    return array.shape[1]


def _attach_untracked(name: str) -> SharedMemory:
    """Open an existing segment so that this process's exit never unlinks it."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    shm = SharedMemory(name=name)
    # Before 3.13 attaching registers the segment with this process's resource_tracker, which
    # would unlink it when we exit. The owner's own process registered it already (a set): leave it.
    if owner_pid_of(name) != os.getpid():
        resource_tracker.unregister(shm._name, "shared_memory")
    return shm


def _release(shm: SharedMemory, seqs: memoryview | None, owner: bool) -> None:
    """Unmap a segment (and unlink it if we own it), even while numpy views of it are still alive."""
    if seqs is not None:
        try:
            seqs.release()
        except BufferError:
            pass
    try:
        shm.close()
    except BufferError:
        # A caller still holds views (a plan being executed): the mapping lives on until they
        # die; forget it here so that SharedMemory.__del__ does not try again.
        shm._buf = shm._mmap = None
        if shm._fd >= 0:
            os.close(shm._fd)
            shm._fd = -1
    if owner:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass  # swept already

"""A shared-memory all-reduce for the ranks of one CPU host: the small per-layer sums of a decode step.

gloo sums a tensor over loopback TCP: every call is a few syscalls and wake-ups per peer, far more than the
few KB a decode step's row-parallel output holds. Here every rank owns one slot of a segment they all map;
a sum is: copy x into my slot, publish my sequence number, wait until every peer has published the same
one, then add the slots in rank order (so every rank holds bit-identical sums). The slots are double
buffered by the sequence's parity: a rank writes call s's slot only after every peer arrived at s - 1, so
no peer still reads the slot of s - 2 (the same argument as DeepSpeed's and vLLM's naive shm all-reduce).
A gather is the same exchange with a concatenation instead of the sum.

Ordering: one aligned int64 store publishes a sequence, after the slot's stores (x86-64 keeps stores in
order and loads in order: ipc/tickets.py says why that is enough); elsewhere ShmAllReduce is not offered.
A wait spins (yielding the core each turn) and checks the peers' processes now and then, so a dead peer is
a GroupLost within ~0.1 s, never a hang; a stopped one is the engine core's hang watch's to find.
"""

from __future__ import annotations

import os
import time
from multiprocessing.shared_memory import SharedMemory

import torch

from metrale.ipc.segments import attach_untracked, segment_name
from metrale.ipc.tickets import SPIN_IS_SAFE

from .parallel import GroupLost

LINE = 64  # one cache line per rank's sequence number
HEADER_BYTES = 4096
DEFAULT_SLOT_BYTES = 4 << 20  # per rank and parity: a decode step's sums, and logits to gather up to this
_PEER_CHECK_S = 0.1  # how often a long wait looks at the peers' processes
_sched_yield = getattr(os, "sched_yield", lambda: None)


class ShmAllReduce:
    """The segment, this rank's place in it, and the sum and gather over it."""

    def __init__(self, shm: SharedMemory, rank: int, size: int, slot_bytes: int, owner: bool, timeout_s: float):
        """Map the layout onto an open segment (see create / attach)."""
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self.name = shm.name
        self.timeout_s = timeout_s
        self._shm, self._owner = shm, owner
        self._seqs = shm.buf.cast("q")  # rank r's published sequence at index r * LINE / 8
        self._bytes = torch.frombuffer(shm.buf, dtype=torch.uint8)
        self._views: dict[tuple, torch.Tensor] = {}  # (parity, rank, dtype, numel) -> a slot's view, reused
        self._seq = 0
        self.peer_pids: list[int] = []  # set by the group: whose death ends a wait

    @staticmethod
    def segment_bytes(size: int, slot_bytes: int) -> int:
        """The segment's size for size ranks."""
        return HEADER_BYTES + 2 * size * slot_bytes

    @classmethod
    def create(cls, size: int, *, slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: float = 600.0) -> ShmAllReduce:
        """Rank 0's side: a fresh zeroed segment ("metrale-<pid>-ar<token>", so a sweep finds a leftover)."""
        if size > HEADER_BYTES // LINE:
            raise ValueError(f"a shared-memory all-reduce holds at most {HEADER_BYTES // LINE} ranks")
        shm = SharedMemory(name=segment_name(os.getpid(), "ar" + os.urandom(4).hex()), create=True,
                           size=cls.segment_bytes(size, slot_bytes))
        os.fchmod(shm._fd, 0o600)
        return cls(shm, 0, size, slot_bytes, True, timeout_s)

    @classmethod
    def attach(cls, name: str, rank: int, size: int, *, slot_bytes: int = DEFAULT_SLOT_BYTES,
               timeout_s: float = 600.0) -> ShmAllReduce:
        """Another rank's side: map rank 0's segment."""
        return cls(attach_untracked(name), rank, size, slot_bytes, False, timeout_s)

    def unlink(self) -> None:
        """Remove the segment's name once every rank has mapped it: nothing is left in /dev/shm even if
        the ranks are killed (the mappings live on until they exit)."""
        if self._owner:
            self._shm.unlink()  # also tells the resource tracker it is gone
            self._owner = False

    def close(self) -> None:
        """Unmap (and remove, if still named and ours)."""
        self._views.clear()
        self._bytes = None
        try:
            self._seqs.release()
        except BufferError:
            pass
        try:
            self._shm.close()
        except BufferError:
            pass  # a caller still holds a view: the mapping goes with the process
        if self._owner:
            self.unlink()

    # ---- the collectives --------------------------------------------------------------------

    def fits(self, x: torch.Tensor) -> bool:
        """Whether x goes through the segment (a contiguous CPU tensor no larger than a slot)."""
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x overwritten with the sum over the ranks, added in rank order (bit-identical on every rank)."""
        flat = x.view(-1)
        parity = self._publish(flat)
        n, dtype = flat.numel(), flat.dtype
        if self.size == 2:  # a + b == b + a: add the peer's slot to mine
            flat.add_(self._slot(parity, 1 - self.rank, dtype, n))
            return x
        flat.copy_(self._slot(parity, 0, dtype, n))
        for r in range(1, self.size):
            flat.add_(self._slot(parity, r, dtype, n))
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order (a new tensor)."""
        x = x.contiguous()
        parity = self._publish(x.view(-1))
        parts = [self._slot(parity, r, x.dtype, x.numel()).view(x.shape) for r in range(self.size)]
        return torch.cat(parts, dim=dim)

    def _publish(self, flat: torch.Tensor) -> int:
        """Copy flat into my slot of the next call's parity, publish the call, wait for every peer's."""
        self._seq += 1
        seq = self._seq
        parity = seq & 1
        self._slot(parity, self.rank, flat.dtype, flat.numel()).copy_(flat)
        self._seqs[self.rank * LINE // 8] = seq
        self._wait(seq)
        return parity

    def _slot(self, parity: int, rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        """A view of n elements of dtype at the start of rank's slot of this parity (made once, then reused)."""
        key = (parity, rank, dtype, n)
        view = self._views.get(key)
        if view is None:
            at = HEADER_BYTES + (parity * self.size + rank) * self.slot_bytes
            nbytes = n * torch.empty((), dtype=dtype).element_size()
            view = self._bytes[at : at + nbytes].view(dtype)
            if len(self._views) > 256:  # shapes a step sees are few; a prefill of every length is not
                self._views.clear()
            self._views[key] = view
        return view

    def _wait(self, seq: int) -> None:
        """Return once every rank has published seq; GroupLost if a peer dies or the timeout passes."""
        seqs, stride = self._seqs, LINE // 8
        for r in range(self.size):
            if r == self.rank or seqs[r * stride] >= seq:
                continue
            start = check = time.monotonic()
            while seqs[r * stride] < seq:
                _sched_yield()
                now = time.monotonic()
                if now - check >= _PEER_CHECK_S:
                    check = now
                    self._check_peers(now - start)

    def _check_peers(self, waited_s: float) -> None:
        """GroupLost when a peer process is gone or the wait passed the group's timeout."""
        for pid in self.peer_pids:
            if not _alive(pid):
                raise GroupLost(f"rank {self.rank}: peer process {pid} is gone")
        if waited_s > self.timeout_s:
            raise GroupLost(f"rank {self.rank}: a peer did not reach the all-reduce in {self.timeout_s:.0f} s")


def offered() -> bool:
    """Whether this CPU orders memory strongly enough for the spin protocol (see the module docstring)."""
    return SPIN_IS_SAFE


def _alive(pid: int) -> bool:
    """Whether pid runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b") ", 1)[1][:1] not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True

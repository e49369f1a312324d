"""The collectives a tensor-parallel group runs with (layers/parallel.py's `Collectives`).

- `TorchCollectives`: torch.distributed over one process group: NCCL on CUDA, gloo on a CPU (over TCP, so it
  also spans hosts).
- `ShmCollectives`: on the ranks of one CPU host, sums and gathers that fit a slot go through shared memory
  (layers/shm_allreduce.py), the rest through gloo.

Any failure of a collective is a `GroupLost`: a peer is gone or stuck, the step cannot finish on any rank, so
the worker exits and the supervisor restarts the whole group (the engine core requeues its requests).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .parallel import GroupLost
from .shm_allreduce import ShmAllReduce


class TorchCollectives:
    """Sum and gather over a torch.distributed process group."""

    def __init__(self, pg: dist.ProcessGroup, size: int, device: torch.device):
        """pg: the group's process group (size ranks); device: where min_int's scalar lives (CUDA for NCCL)."""
        self.pg, self.size, self.device = pg, size, device

    def release(self) -> None:
        """Drop the process group (the group is closing: no collective runs after this)."""
        self.pg = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the group, in place."""
        try:
            dist.all_reduce(x, group=self.pg)
        except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise several types; all mean the same here
            raise GroupLost(f"all_reduce failed: {exc}") from exc
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        try:
            dist.all_gather(parts, x, group=self.pg)
        except Exception as exc:  # noqa: BLE001
            raise GroupLost(f"all_gather failed: {exc}") from exc
        return torch.cat(parts, dim=dim)

    def min_int(self, value: int) -> int:
        """The least of every rank's value."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.pg)
        except Exception as exc:  # noqa: BLE001
            raise GroupLost(f"all_reduce(min) failed: {exc}") from exc
        return int(t.item())


class ShmCollectives(TorchCollectives):
    """gloo, except that what fits a shared-memory slot is summed or gathered there (one host only)."""

    def __init__(self, pg: dist.ProcessGroup, size: int, shm: ShmAllReduce):
        """pg: the group's gloo process group; shm: the mapped segment every rank of it shares."""
        super().__init__(pg, size, torch.device("cpu"))
        self.shm = shm

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the group, in place, in rank order."""
        if x.is_contiguous() and self.shm.fits(x):
            return self.shm.all_reduce(x)
        return super().all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order."""
        if self.shm.fits(x):
            return self.shm.all_gather(x, dim)
        return super().all_gather(x, dim)

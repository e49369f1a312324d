"""The tensor-parallel group a layer belongs to: which shard of each weight this process holds, and how the
group sums and gathers.

A column-parallel layer keeps rows `rank * n : (rank + 1) * n` of its output features, a row-parallel layer
the same slice of its input features, and a vocab-parallel embedding a slice of the vocabulary. Weight
loaders cut the checkpoint's full tensors with `shard`; the forward reduces or gathers across the group
through the group's `Collectives` (layers/collectives.py: torch.distributed's gloo or NCCL, or a shared-memory
all-reduce between the ranks of one host). `SINGLE` (rank 0 of 1) has none: its loaders copy whole tensors and
its reductions are never called (layers test `group.size > 1` once, at construction).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from metrale.gpu_worker.errors import GroupLost  # noqa: F401 - what a failed collective raises (layers import it here)


class Collectives(Protocol):
    """How the ranks of a group combine tensors; every rank calls the same ones in the same order."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group, in rank order on every rank (x is overwritten and returned)."""
        ...

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x (all of one shape) concatenated along dim, in rank order."""
        ...

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (ranks agree on sizes chosen from local memory)."""
        ...

    def release(self) -> None:
        """Let go of the process group: the group is closing and runs no collective after this."""
        ...


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    """One process's place in a tensor-parallel group, and the group's collectives (None in a group of one)."""

    rank: int = 0
    size: int = 1
    comm: Collectives | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        """ValueError for a rank outside the group (a group without collectives can still shard: loader tests)."""
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")

    def split(self, total: int, what: str = "size") -> int:
        """This rank's share of `total` (which the group size must divide)."""
        if total % self.size:
            raise ValueError(f"{what} {total} is not divisible by the tensor-parallel size {self.size}")
        return total // self.size

    def shard(self, tensor: torch.Tensor, dim: int, length: int) -> torch.Tensor:
        """This rank's `length`-long slice of tensor along dim (a view; the whole tensor in a group of one)."""
        if self.size == 1 and tensor.shape[dim] == length:
            return tensor
        return tensor.narrow(dim, self.rank * length, length)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group (x itself in a group of one)."""
        if self.size == 1:
            return x
        return self._comm().all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order (x itself in a group of one)."""
        if self.size == 1:
            return x
        return self._comm().all_gather(x, dim)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (value itself in a group of one)."""
        if self.size == 1:
            return value
        return self._comm().min_int(value)

    def _comm(self) -> Collectives:
        """The group's collectives; RuntimeError for a group built without them."""
        if self.comm is None:
            raise RuntimeError(f"rank {self.rank} of {self.size} has no collectives to reduce with")
        return self.comm


SINGLE = ParallelGroup()  # the group of one process

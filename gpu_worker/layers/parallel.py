"""The tensor-parallel group a layer belongs to: which shard of each weight this process holds.

A column-parallel layer keeps rows `rank * n : (rank + 1) * n` of its output features, a row-parallel layer
the same slice of its input features, and a vocab-parallel embedding a slice of the vocabulary. Weight
loaders cut the checkpoint's full tensors with `shard`; the forward reduces or gathers across the group.
Today every group is `SINGLE` (rank 0 of 1): the loaders copy whole tensors and the forward's reductions are
never called (layers test `group.size > 1` once, at construction). Tensor parallelism fills in
`all_reduce` / `all_gather` with torch.distributed later without touching the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    """One process's place in a tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        """ValueError for a rank outside the group."""
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
        raise NotImplementedError("tensor parallelism is not implemented yet")

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order (x itself in a group of one)."""
        if self.size == 1:
            return x
        raise NotImplementedError("tensor parallelism is not implemented yet")


SINGLE = ParallelGroup()  # the group of one process

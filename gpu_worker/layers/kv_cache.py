"""The paged KV cache: per layer, preallocated K and V blocks written in place by slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale.gpu_worker.layers import cpu_kernels
from metrale.gpu_worker.layers.huge_pages import zeros as _zeros


@dataclass(slots=True)
class SlotIndex:
    """A step's slots split once into (block, offset), for writing keys stored head-dim-major."""

    slots: torch.Tensor  # int64 [T]: block * block_size + offset
    blocks: torch.Tensor | None  # int64 [T] (transposed keys only)
    offsets: torch.Tensor | None  # int64 [T]


class PagedKVCache:
    """K and V per layer as [num_blocks, block_size, num_kv_heads, head_dim], allocated once.

    A token's slot is block * block_size + offset (the plan's slot_mapping); the engine core owns
    which blocks a sequence holds, the cache only stores them.

    With transposed_keys, each key block is stored [num_kv_heads, head_dim, block_size]: one head
    dimension of a block's tokens lies contiguous, which is what the native CPU decode kernel reads
    with plain vector loads (no horizontal sums). `k[layer]` is then a permuted view with the same
    logical shape as always, so whole-block copies (swap, tests) work on either layout unchanged.
    On a CPU with the native kernels loaded, that layout is also written by one native call per layer.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        transposed_keys: bool = False,
        scratch_block: bool = False,
    ):
        """Allocate every layer's blocks, zeroed: padded block-table entries are read (then masked
        out), and masked garbage must still be finite or it would poison the softmax.

        scratch_block: one block more, at index num_blocks, that no plan may name: a decode graph's padding
        rows write and read it (graph_runner.py), so they never touch a sequence's block."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks  # the blocks the engine core may hand out
        self.scratch_block = num_blocks if scratch_block else None
        self.block_size = block_size
        self.transposed_keys = transposed_keys
        allocated = num_blocks + int(scratch_block)
        shape = (allocated, block_size, num_kv_heads, head_dim)
        if transposed_keys:
            key_shape = (allocated, num_kv_heads, head_dim, block_size)
            self.k_blocks = [_zeros(key_shape, dtype, device) for _ in range(num_layers)]
            self.k = [kb.permute(0, 3, 1, 2) for kb in self.k_blocks]
        else:
            self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
            self.k_blocks = self.k
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self._native_write = transposed_keys and torch.device(device).type == "cpu" and cpu_kernels.loaded()
        self._scratch_k: torch.Tensor | None = None  # gather's reusable output
        self._scratch_v: torch.Tensor | None = None

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def slot_index(self, slot_mapping: torch.Tensor) -> SlotIndex:
        """The step's slots as write() takes them (computed once per step, used by every layer)."""
        if not self.transposed_keys or self._native_write:
            return SlotIndex(slot_mapping, None, None)
        return SlotIndex(slot_mapping, torch.div(slot_mapping, self.block_size, rounding_mode="floor"), slot_mapping % self.block_size)

    def write(self, layer: int, slots: SlotIndex | torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a step's k, v [T, kv_heads, head_dim] into their slots of layer's blocks."""
        if not isinstance(slots, SlotIndex):
            slots = self.slot_index(slots)
        if self._native_write:
            cpu_kernels.write_kv(k, v, self.k_blocks[layer], self.v[layer], slots.slots)
            return
        vc = self.v[layer]
        vc.view(-1, *vc.shape[2:]).index_copy_(0, slots.slots, v)
        if self.transposed_keys:
            self.k_blocks[layer][slots.blocks, :, :, slots.offsets] = k
        else:
            kc = self.k[layer]
            kc.view(-1, *kc.shape[2:]).index_copy_(0, slots.slots, k)

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the given blocks laid end to end: block_ids [..., nb] -> [..., nb * block_size, kv_heads, head_dim].

        The result is a view of scratch reused by the next gather (layers run one after another, and
        each consumes its gather before the next): no allocation per layer.
        """
        kc, vc = self.k[layer], self.v[layer]
        flat = block_ids.reshape(-1)
        n = flat.shape[0]
        if self._scratch_k is None or self._scratch_k.shape[0] < n:
            self._scratch_k = torch.empty((n, *kc.shape[1:]), dtype=kc.dtype, device=kc.device)
            self._scratch_v = torch.empty_like(self._scratch_k)
        k = torch.index_select(kc, 0, flat, out=self._scratch_k[:n])  # a strided read when transposed
        v = torch.index_select(vc, 0, flat, out=self._scratch_v[:n])
        lead = block_ids.shape[:-1]
        return k.view(*lead, -1, *kc.shape[2:]), v.view(*lead, -1, *vc.shape[2:])

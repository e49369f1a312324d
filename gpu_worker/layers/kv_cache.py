"""The paged KV cache: per layer, preallocated K and V blocks written in place by slot."""

from __future__ import annotations

import torch


class PagedKVCache:
    """K and V per layer as [num_blocks, block_size, num_kv_heads, head_dim], allocated once.

    A token's slot is block * block_size + offset (the plan's slot_mapping); the engine core owns
    which blocks a sequence holds, the cache only stores them.
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
    ):
        """Allocate every layer's blocks, zeroed: padded block-table entries are read (then masked
        out), and masked garbage must still be finite or it would poison the softmax."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._scratch_k: torch.Tensor | None = None  # gather's reusable output
        self._scratch_v: torch.Tensor | None = None

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a step's k, v [T, kv_heads, head_dim] into their slots of layer's blocks."""
        kc, vc = self.k[layer], self.v[layer]
        kc.view(-1, *kc.shape[2:]).index_copy_(0, slot_mapping, k)
        vc.view(-1, *vc.shape[2:]).index_copy_(0, slot_mapping, v)

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
        k = torch.index_select(kc, 0, flat, out=self._scratch_k[:n])
        v = torch.index_select(vc, 0, flat, out=self._scratch_v[:n])
        lead = block_ids.shape[:-1]
        return k.view(*lead, -1, *kc.shape[2:]), v.view(*lead, -1, *vc.shape[2:])

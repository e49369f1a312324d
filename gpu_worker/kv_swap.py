"""Host copies of KV blocks, for swap preemption: a plan's swap_out then swap_in, before its forward; and device
copies (a swap_in pair whose host block is negative: a forked beam's partial block, ipc/plan.py)."""

from __future__ import annotations

import numpy as np
import torch

from metrale.ipc.plan import StepPlan


class KvSwapSpace:
    """num_blocks host blocks shaped like the device cache's, per layer, K and V (pinned on CUDA)."""

    def __init__(self, cache, num_blocks: int):
        self.cache = cache
        self.num_blocks = num_blocks
        pin = cache.k[0].device.type == "cuda"
        shape = (num_blocks, *cache.k[0].shape[1:])
        dtype = cache.k[0].dtype
        self.k = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in cache.k] if num_blocks else []
        self.v = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in cache.v] if num_blocks else []

    @staticmethod
    def blocks_for(swap_space_bytes: int, bytes_per_block: int) -> int:
        """How many host blocks a swap space of this many bytes holds."""
        return max(0, int(swap_space_bytes) // bytes_per_block)

    def apply(self, plan: StepPlan) -> None:
        """Copy the plan's swap_out pairs device → host, then its device → device pairs, then its swap_in pairs
        host → device."""
        if len(plan.swap_out):
            dev, host = _indices(plan.swap_out)
            for layer in range(len(self.k)):
                self.k[layer].index_copy_(0, host, self.cache.k[layer].index_select(0, dev.to(self.cache.k[layer].device)).cpu())
                self.v[layer].index_copy_(0, host, self.cache.v[layer].index_select(0, dev.to(self.cache.v[layer].device)).cpu())
        if len(plan.swap_in):
            host, dev = _indices(plan.swap_in)
            copies = host < 0
            if bool(copies.any()):
                src, dst = -1 - host[copies], dev[copies]
                host, dev = host[~copies], dev[~copies]
                for cache in (self.cache.k, self.cache.v):
                    for layer in cache:
                        layer.index_copy_(0, dst.to(layer.device), layer.index_select(0, src.to(layer.device)))
            for layer in range(len(self.k)):
                device = self.cache.k[layer].device
                d = dev.to(device)
                self.cache.k[layer].index_copy_(0, d, self.k[layer].index_select(0, host).to(device, non_blocking=True))
                self.cache.v[layer].index_copy_(0, d, self.v[layer].index_select(0, host).to(device, non_blocking=True))


def _indices(pairs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The two columns of an int32 [S, 2] pair array as int64 index tensors."""
    a = torch.from_numpy(np.ascontiguousarray(pairs[:, 0], dtype=np.int64))
    b = torch.from_numpy(np.ascontiguousarray(pairs[:, 1], dtype=np.int64))
    return a, b

"""KV blocks copied to host blocks and back are bit-identical, and land where the plan says."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from metrale.gpu_worker.kv_swap import KvSwapSpace  # noqa: E402
from metrale.gpu_worker.layers.kv_cache import PagedKVCache  # noqa: E402


class _Plan:
    def __init__(self, swap_out, swap_in):
        self.swap_out = np.array(swap_out, dtype=np.int32).reshape(-1, 2)
        self.swap_in = np.array(swap_in, dtype=np.int32).reshape(-1, 2)


@pytest.mark.parametrize("transposed_keys", [False, True])
def test_blocks_swapped_out_and_in_come_back_bit_exact(transposed_keys):
    cache = PagedKVCache(2, 8, 4, 2, 8, dtype=torch.float32, device=torch.device("cpu"), transposed_keys=transposed_keys)
    for layer in range(2):
        cache.k[layer].normal_()
        cache.v[layer].normal_()
    before_k = [k.clone() for k in cache.k]
    before_v = [v.clone() for v in cache.v]
    swap = KvSwapSpace(cache, 4)
    swap.apply(_Plan([(3, 0), (5, 2)], []))
    for layer in range(2):
        cache.k[layer][3].zero_()
        cache.v[layer][5].zero_()
    swap.apply(_Plan([], [(0, 6), (2, 1)]))  # back into other device blocks
    for layer in range(2):
        assert torch.equal(cache.k[layer][6], before_k[layer][3])
        assert torch.equal(cache.k[layer][1], before_k[layer][5])
        assert torch.equal(cache.v[layer][6], before_v[layer][3])
        assert torch.equal(cache.v[layer][1], before_v[layer][5])


def test_swap_space_size_from_bytes():
    assert KvSwapSpace.blocks_for(10_000, 1000) == 10
    assert KvSwapSpace.blocks_for(0, 1000) == 0

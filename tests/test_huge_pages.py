"""Host tensors on transparent huge pages (gpu_worker/layers/huge_pages.py)."""

from __future__ import annotations

import pytest
import torch

from metrale.gpu_worker.layers import huge_pages


@pytest.mark.parametrize("shape", [(3, 5), (4 << 20,), (1, 3 << 20), (3, 1 << 17)])
def test_zeros_is_torch_zeros(shape):
    """Whatever the size, the same tensor torch.zeros gives: shape, dtype, all zero, writable."""
    t = huge_pages.zeros(shape, torch.bfloat16, "cpu")
    assert t.shape == shape and t.dtype == torch.bfloat16 and not t.any()
    t.fill_(1)
    assert bool(t.all())


def test_large_tensors_are_advised_over_their_aligned_interior(monkeypatch):
    """madvise(MADV_HUGEPAGE) is asked for the 2 MiB-aligned pages inside the tensor, before anything touches it;
    small tensors are left alone. (Whether the kernel grants huge pages is its business.)"""
    calls = []

    class FakeLibc:
        def madvise(self, start, length, advice):
            calls.append((start.value, length.value, advice))
            return 0

    monkeypatch.setattr(huge_pages, "_libc", lambda: FakeLibc())
    monkeypatch.setattr(huge_pages, "ENABLED", True)
    huge_pages.zeros((1000,), torch.float32, "cpu")
    huge_pages.zeros((1 << 19,), torch.float16, "cpu")  # a mapping, on ordinary pages
    assert calls == []
    t = huge_pages.zeros((5 << 20,), torch.uint8, "cpu")
    (start, length, advice), = calls
    assert advice == 14 and start % huge_pages.HUGE_PAGE == 0 and length % huge_pages.HUGE_PAGE == 0 and length > 0
    assert t.data_ptr() <= start and start + length <= t.data_ptr() + t.nbytes


def _rss() -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


@pytest.mark.skipif(not huge_pages.ENABLED, reason="anonymous mappings are the Linux path")
def test_a_large_tensor_is_zero_without_being_touched():
    """A cache-sized tensor costs no memset: its pages stay unmapped until written (read-only reads of an
    untouched anonymous page see the shared zero page), and writing part of it faults in only that part."""
    size = 256 << 20
    before = _rss()
    t = huge_pages.zeros((size // 2,), torch.bfloat16, "cpu")
    assert _rss() - before < size // 4
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t[: 1 << 20].fill_(1)
    assert float(t[: 1 << 20].sum()) == float(1 << 20) and _rss() - before < size // 4


@pytest.mark.skipif(not huge_pages.ENABLED, reason="anonymous mappings are the Linux path")
def test_tensors_under_a_huge_page_are_zero_without_being_touched():
    """A layer's KV tensors under 2 MiB each (dozens of them) cost no memset either: untouched, they add no RSS."""
    before = _rss()
    tensors = [huge_pages.zeros((3 << 18,), torch.bfloat16, "cpu") for _ in range(64)]  # 1.5 MiB each, 96 MiB
    assert _rss() - before < (96 << 20) // 4
    assert not any(bool(t.any()) for t in tensors[:2])

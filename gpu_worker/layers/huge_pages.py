"""Host tensors on transparent huge pages, for the memory a decode step reads all over.

A step reads a few KB from each of thousands of KV blocks spread over the whole cache, and every
weight once: with 4 KB pages nearly every block costs a TLB miss and a page walk. Measured on the
2-core box, batch 32 bf16: `metrale.LLM` with a 512 MiB cache went from 928 to 1,195 tok/s (medians
of 6, same process, alternated) once the cache sat on 2 MiB pages. Linux only, best effort: where
the kernel says no (THP off, other systems) the tensors are ordinary.

Such a tensor is its own anonymous private mapping: the kernel hands it out zeroed page by page on first
touch, so a cache of hundreds of MiB costs no memset at start-up (only the pages a step writes are ever
faulted in), and it is unmapped when the tensor is freed.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
# From this size a CPU tensor is an anonymous mapping rather than torch.zeros' memset: a model's per-layer KV
# tensors are often under a huge page (SmolLM2's at a 2,048-token cache: 0.75 MiB each, 60 of them), and torch's
# parallel memset of each costs more than the mapping on a busy box.
MAPPED_MIN = 64 << 10
_MADV_HUGEPAGE = 14
ENABLED = sys.platform.startswith("linux")  # tests flip it to compare


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros; a CPU tensor of at least MAPPED_MIN bytes is a fresh anonymous mapping instead (zero until
    written, faulted in lazily), one of at least a huge page advised onto huge pages before anything touches it."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize * int(torch.Size(shape).numel())
    if torch.device(device).type != "cpu" or nbytes < MAPPED_MIN or not ENABLED:
        return torch.zeros(shape, dtype=dtype, device=device)
    if nbytes < HUGE_PAGE:  # a mapping of its own (zero until written), on ordinary pages
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
    # One huge page more than asked, so the tensor can start on a 2 MiB boundary (mmap aligns to 4 KiB).
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping alive; unmapped with the last view
    skip = -raw.data_ptr() % HUGE_PAGE
    _advise(raw.data_ptr() + skip, nbytes)
    return raw[skip : skip + nbytes].view(dtype).view(shape)


def _advise(address: int, nbytes: int) -> None:
    """madvise(MADV_HUGEPAGE) over the 2 MiB-aligned interior of [address, address + nbytes)."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        try:
            _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
        except (OSError, AttributeError):
            pass


_LIBC: list = []


def _libc():
    """The C library (loaded once)."""
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]

"""Host-to-device staging for a step's inputs: host arrays (pinned on CUDA) copied into reused device buffers.

A copy from pageable memory makes the host wait for the device's whole queue, so on CUDA a step's arrays go
through pinned host buffers and copy asynchronously. A pinned buffer may be written again only after the
device has read it, so there are `depth` sets of host buffers, used in turn, each guarded by an event
recorded after its step's copies: `begin()` waits on the set it is about to reuse — only when the device runs
`depth` steps behind the host, which is back-pressure, not a sync per step. On a CPU the host buffers are
plain, the events already done, and the device buffers the same reused tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from metrale.gpu_worker.device_event import new_event

DEPTH = 3  # sets of host buffers: a step being built, one queued, one running


class StepStaging:
    """Named device buffers for per-step arrays, grown on demand and reused, filled through host buffers."""

    def __init__(self, device: torch.device, depth: int = DEPTH):
        """Start empty; the first steps size the buffers."""
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._device_bufs: dict[str, torch.Tensor] = {}
        self._host_sets: list[dict[str, torch.Tensor]] = [{} for _ in range(depth)]
        self._events = [None] * depth
        self._set = 0

    def begin(self) -> None:
        """Start a step: take the next set of host buffers, once the device has read what it last held."""
        self._set = (self._set + 1) % len(self._host_sets)
        event = self._events[self._set]
        if event is not None and not event.query():  # query first: it never blocks the host
            event.synchronize()

    def end(self) -> None:
        """The step's copies are queued: mark the point after which its host buffers may be reused."""
        event = self._events[self._set]
        if event is None:
            event = self._events[self._set] = new_event(self.device)
        event.record()

    def host(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """This step's host buffer `name` viewed as shape (grown when too small): fill it, then upload it."""
        n = int(np.prod(shape))
        bufs = self._host_sets[self._set]
        buf = bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(max(n, 64, 2 * (0 if buf is None else buf.numel())), dtype=dtype, pin_memory=self.pinned)
            bufs[name] = buf
        return buf[:n].view(shape)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Copy a host buffer (from host()) into dst without waiting for the device; returns dst."""
        return dst.copy_(src, non_blocking=True)

    def put(self, name: str, array: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """The array copied into device buffer `name` (converted to dtype); a view valid until the next put."""
        n = len(array)
        buf = self._device_bufs.get(name)
        if buf is None or buf.shape[0] < n or buf.dtype != dtype:
            buf = torch.empty(max(n, 2 * (0 if buf is None else buf.shape[0]), 64), dtype=dtype, device=self.device)
            self._device_bufs[name] = buf
        view = buf[:n]
        if not self.pinned:  # a CPU: straight from the array, no host buffer in between
            return view.copy_(torch.from_numpy(np.ascontiguousarray(array)))
        host = self.host(name, (n,), dtype)
        host.numpy()[:] = array
        return self.upload(view, host)

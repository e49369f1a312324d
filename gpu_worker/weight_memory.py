"""How much memory a loaded model's weights hold: its own tensors, and the GGUF file's mapped pages it reads in place.

`weight_bytes(model, gguf)` walks everything the model's modules hold (parameters, buffers, and the tensors in
their attributes: a packed product's panels, a norm's scale, a view of the file), counts each storage once, and
splits them: `own` (memory the process allocated) and `mapped` (the file's pages resident in this process's map,
from /proc/self/smaps). For benchmarks and tests; nothing in the serving path calls it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

_DEPTH = 4  # how deep into attribute containers (a list of runs, each holding a product holding tensors)


@dataclasses.dataclass(frozen=True, slots=True)
class WeightBytes:
    """own: bytes of the model's tensors outside the map; mapped: the map's resident bytes (0 without a file);
    file_tensors: the bytes of the file's tensors."""

    own: int
    mapped: int
    file_tensors: int

    @property
    def resident(self) -> int:
        """The weights' resident bytes: own plus the map's resident pages."""
        return self.own + self.mapped


def weight_bytes(model: nn.Module, gguf: str | Path | None = None) -> WeightBytes:
    """The model's weight memory (see the module docstring); gguf: the file it was loaded from, if any."""
    span = _map_span(gguf)
    storages: dict[int, int] = {}
    for module in model.modules():
        for value in vars(module).values():
            _collect(value, storages, _DEPTH)
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            _collect(t, storages, 0)
    own = sum(n for ptr, n in storages.items() if span is None or not span[0] <= ptr < span[1])
    if gguf is None:
        return WeightBytes(own, 0, 0)
    from metrale.gguf_metadata import open_gguf

    return WeightBytes(own, _mapped_rss(Path(gguf)), sum(int(t.n_bytes) for t in open_gguf(gguf).tensors))


def _collect(value, storages: dict[int, int], depth: int) -> None:
    """Record the storages of the tensors in value (a tensor, or a container / object holding them)."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.numel():
            if value.is_mkldnn or value.layout != torch.strided:  # oneDNN's packed weight: no storage to share
                storages[-id(value)] = value.numel() * value.element_size()
            else:
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return
    if depth <= 0 or isinstance(value, (nn.Module, str, bytes, int, float, bool)) or value is None:
        return
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set)):
        items = list(value)
    elif dataclasses.is_dataclass(value):
        items = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif hasattr(value, "__slots__"):
        items = [getattr(value, s, None) for s in value.__slots__]
    else:
        return
    for item in items:
        _collect(item, storages, depth - 1)


def _map_span(gguf: str | Path | None) -> tuple[int, int] | None:
    """The address range of the file's map in this process (gguf_metadata's reader), or None."""
    if gguf is None:
        return None
    from metrale.gguf_metadata import open_gguf

    data = open_gguf(gguf).data
    return data.ctypes.data, data.ctypes.data + data.nbytes


def _mapped_rss(path: Path) -> int:
    """The resident bytes of this process's map of path that gguf_metadata's reader holds (/proc/self/smaps; 0
    where there is none). Other maps of the same file (a reader since replaced) are not the model's."""
    lo, hi = _map_span(path)
    total, inside = 0, False
    try:
        with open("/proc/self/smaps", encoding="utf-8", errors="replace") as f:
            for line in f:
                first = line.split(maxsplit=1)[0]
                if "-" in first and not first.endswith(":"):  # a mapping's header line: start-end ...
                    start, end = (int(x, 16) for x in first.split("-"))
                    inside = start < hi and lo < end
                elif inside and first == "Rss:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total

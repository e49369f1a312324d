"""The GGUF repacking loops in C (gguf_repack.c): a file's stored blocks, or rows of codes, into the quantized
kernels' panel layouts.

Written with torch ops the same shuffles take several passes over every weight, each a temporary as large as the
layer (most of a GGUF's load time). Here each layout is one pass, split over torch's thread count by panels
(ctypes releases the GIL). `from_stored` goes from the stored blocks of the common types (STORED) straight to
a kernel's layout, reading each row where the file's map (or a part's copy) holds it: no decoded form, no staging
copy. The library is plain C, built once with the system compiler into the kernel cache
(`repack/`, keyed by the source) and loaded with ctypes. `available()` is False without a compiler; callers then
keep their torch path (gguf_quant_types.py), which gives the same bytes (the tests check).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

PANEL = 16
_SOURCE = pathlib.Path(__file__).with_name("gguf_repack.c")
_MIN_PANELS_PER_THREAD = 32  # below this a thread costs more than it saves


def available() -> bool:
    """True when the C library is built (or builds now) and loads."""
    return _library() is not None


@functools.cache
def _library():
    """The loaded library, or None where no compiler builds it."""
    text = _SOURCE.read_bytes()
    cache = pathlib.Path(os.environ.get("METRALE_CACHE_DIR", pathlib.Path.home() / ".cache" / "metrale")) / "repack"
    target = cache / f"gguf_repack-{hashlib.sha256(text).hexdigest()[:16]}.so"
    if not target.exists():
        compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if compiler is None:
            return None
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                built = pathlib.Path(tmp) / target.name
                subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-o", str(built), str(_SOURCE)],
                               check=True, capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: a concurrent build writes the same bytes
        except (OSError, subprocess.SubprocessError):
            return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.panel_int8.argtypes = [ptr, i64, i64, i64, i64, ptr]
    lib.panel_int4.argtypes = [ptr, i64, i64, i64, i64, i64, ptr]
    lib.panel_bits5.argtypes = [ptr, i64, i64, i64, i64, i64, ptr]
    lib.stored_int8.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr]
    lib.stored_int4.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr]
    lib.stored_kq8.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr]
    for stored in (lib.stored_int8, lib.stored_int4, lib.stored_kq8):
        stored.restype = i64  # 1: every scale read was finite
    lib.f16_exact.argtypes = [ptr, i64, ptr]
    lib.f16_exact.restype = i64
    return lib


def _over_panels(call, panels: int) -> list:
    """call(p0, p1) over [0, panels), split over torch's threads where the layer is large enough: each call's result."""
    threads = max(1, min(torch.get_num_threads(), panels // _MIN_PANELS_PER_THREAD))
    if threads == 1:
        return [call(0, panels)]
    edges = [panels * i // threads for i in range(threads + 1)]
    return list(_pool(threads).map(call, edges[:-1], edges[1:]))


class NonFiniteScales(ValueError):
    """A stored block's fp16 scale is an inf or a NaN (from_stored checks every one it reads)."""


def _finite(results: list) -> None:
    """Raise NonFiniteScales unless every part of a stored_* call found its scales finite."""
    if not all(results):
        raise NonFiniteScales("a block's scale is not finite")


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    """One pool per thread count for the process (starting threads per layer costs as much as the work)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="gguf-repack")


def panel_int8(codes: np.ndarray) -> torch.Tensor:
    """int8 codes [rows, cols] (cols a multiple of 4) as int8 [panels, cols / 4, 16, 4] (quantization.pack_int8's
    codes)."""
    codes = np.ascontiguousarray(codes, dtype=np.int8)
    rows, cols = codes.shape
    panels = -(-rows // PANEL)
    out = torch.empty(panels, cols // 4, PANEL, 4, dtype=torch.int8)
    lib = _library()
    _over_panels(lambda p0, p1: lib.panel_int8(codes.ctypes.data, rows, cols, p0, p1, out.data_ptr()), panels)
    return out


def panel_int4(codes: np.ndarray, bias: int) -> torch.Tensor:
    """The low four bits of codes + bias (int8 [rows, cols], cols a multiple of 8) as uint8 [panels, cols / 8, 16, 4]
    (quantization.pack_int4's codes)."""
    codes = np.ascontiguousarray(codes, dtype=np.int8)
    rows, cols = codes.shape
    panels = -(-rows // PANEL)
    out = torch.empty(panels, cols // 8, PANEL, 4, dtype=torch.uint8)
    lib = _library()
    _over_panels(lambda p0, p1: lib.panel_int4(codes.ctypes.data, bias, rows, cols, p0, p1, out.data_ptr()), panels)
    return out


def panel_bits5(codes: np.ndarray, bias: int) -> torch.Tensor:
    """The fifth bits of codes + bias (int8 [rows, cols]) as uint8 [panels, cols / 8, 16] (gguf_quant_types.pack_int5's
    plane)."""
    codes = np.ascontiguousarray(codes, dtype=np.int8)
    rows, cols = codes.shape
    panels = -(-rows // PANEL)
    out = torch.empty(panels, cols // 8, 16, dtype=torch.uint8)
    lib = _library()
    _over_panels(lambda p0, p1: lib.panel_bits5(codes.ctypes.data, bias, rows, cols, p0, p1, out.data_ptr()), panels)
    return out


# The types gguf_repack.c decodes from their stored blocks (its TYPE_* numbers), and the kernels whose layouts it
# writes them in (gguf_quant_types.TYPES names each type's kernel; kq8 takes Q5_K and Q6_K mixed).
STORED = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q5_0": 4, "Q5_1": 5, "Q5_K": 6, "Q6_K": 7}
_STORED_KERNELS = {"int8": ("Q8_0",), "int4": ("Q4_0", "Q4_1", "Q4_K"), "int5": ("Q5_0", "Q5_1"), "kq8": ("Q5_K", "Q6_K")}


def from_stored(kernel: str, parts: list[tuple[str, np.ndarray]], cols: int) -> tuple[torch.Tensor, ...] | None:
    """The packed layout of one kernel's run of rows (what gguf_quant_types.pack_int8_parts, int4_pack, pack_int5
    or pack_kq8 give for the same rows, byte for byte) straight from the stored blocks: parts are (type name,
    int64 addresses of its rows' blocks, 0 for a row no part filled: zero blocks), stacked by rows. None where the
    library is not built or a part's type is not one it decodes; ValueError as pack_int5 raises it;
    NonFiniteScales where a block's fp16 scale is an inf or a NaN."""
    if not available() or any(t not in _STORED_KERNELS.get(kernel, ()) for t, _ in parts):
        return None
    rows = sum(len(a) for _, a in parts)
    panels = -(-rows // PANEL)
    ptrs = np.zeros(panels * PANEL, dtype=np.int64)
    types = np.full(panels * PANEL, -1, dtype=np.int8)  # -1: the last panel's padding rows
    at = 0
    for name, addresses in parts:
        ptrs[at : at + len(addresses)] = addresses
        types[at : at + len(addresses)] = STORED[name]
        at += len(addresses)
    lib, rows_at = _library(), (ptrs.ctypes.data, types.ctypes.data, cols)
    if kernel == "int8":
        codes = torch.empty(panels, cols // 4, PANEL, 4, dtype=torch.int8)
        d = torch.empty(panels, cols // 32, PANEL, dtype=torch.int16)
        _finite(_over_panels(lambda p0, p1: lib.stored_int8(*rows_at, p0, p1, codes.data_ptr(), d.data_ptr()), panels))
        return codes, d
    if kernel in ("int4", "int5"):
        codes = torch.empty(panels, cols // 8, PANEL, 4, dtype=torch.uint8)
        bits = torch.empty(panels, cols // 8, 16, dtype=torch.uint8) if kernel == "int5" else None
        s, z = (torch.empty(panels, cols // 32, PANEL, dtype=torch.float32) for _ in range(2))
        bits_at = bits.data_ptr() if bits is not None else None
        _finite(_over_panels(lambda p0, p1: lib.stored_int4(*rows_at, p0, p1, codes.data_ptr(), bits_at, s.data_ptr(), z.data_ptr()), panels))
        if kernel == "int5" and all(name == "Q5_0" for name, _ in parts):  # offsets -16 s: the kernel makes them
            halves = _f16_bits(s), torch.empty(0, dtype=torch.int16)
        else:
            halves = _f16_bits(s), _f16_bits(z)
        if kernel == "int5":
            if halves[0] is None or halves[1] is None:
                raise ValueError("int5: scales and offsets must be exact in fp16")
            return codes, bits, *halves
        # pack_int4's rule: fp16 bits where every scale and offset is exact, else float32
        return (codes, s, z) if halves[0] is None or halves[1] is None else (codes, *halves)
    sub = min(16 if name == "Q6_K" else 32 for name, _ in parts)  # gguf_quant_types.merged's finer sub-block
    with_mn = any(name == "Q5_K" for name, _ in parts)
    codes = torch.empty(panels, cols // 4, PANEL, 4, dtype=torch.int8)
    sc = torch.empty(panels, cols // sub, PANEL, dtype=torch.int8)
    mn = torch.empty(panels, cols // sub, PANEL, dtype=torch.int8) if with_mn else torch.empty(0, dtype=torch.int8)
    d = torch.empty(panels, cols // 256, PANEL, dtype=torch.int16)
    dm = torch.empty(panels, cols // 256, PANEL, dtype=torch.int16) if with_mn else torch.empty(0, dtype=torch.int16)
    outs = (codes.data_ptr(), sc.data_ptr(), mn.data_ptr() if with_mn else None, d.data_ptr(), dm.data_ptr() if with_mn else None)
    _finite(_over_panels(lambda p0, p1: lib.stored_kq8(*rows_at, sub, int(with_mn), p0, p1, *outs), panels))
    return codes, sc, mn, d, dm


def _f16_bits(x: torch.Tensor) -> torch.Tensor | None:
    """x's fp16 bits (int16, x's shape) when every value is exactly an fp16 number, else None."""
    out = torch.empty(x.shape, dtype=torch.int16)
    return out if _library().f16_exact(x.data_ptr(), x.numel(), out.data_ptr()) else None

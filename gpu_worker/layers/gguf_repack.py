"""The GGUF repacking loops in C (gguf_repack.c): rows of codes into the quantized kernels' panel layouts.

Written with torch ops the same shuffles take several passes over every weight, each a temporary as large as the
layer (most of a GGUF's load time). Here each layout is one pass, split over torch's thread count by panels
(ctypes releases the GIL). The library is plain C, built once with the system compiler into the kernel cache
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
_MIN_PANELS_PER_THREAD = 64  # below this a thread costs more than it saves


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
    return lib


def _over_panels(call, panels: int) -> None:
    """call(p0, p1) over [0, panels), split over torch's threads where the layer is large enough."""
    threads = max(1, min(torch.get_num_threads(), panels // _MIN_PANELS_PER_THREAD))
    if threads == 1:
        call(0, panels)
        return
    edges = [panels * i // threads for i in range(threads + 1)]
    list(_pool(threads).map(call, edges[:-1], edges[1:]))


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

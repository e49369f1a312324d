"""Which kernel class multiplies each quantized weight format: the one this CPU runs fastest, not the widest.

The classes rank by instruction set (metrale/cpu_isa.py), but a wider class is not always faster: on some AMD
CPUs the AVX2 build of the int8 and 4-bit products outruns the AVX-512 one. So for each quantized product (an op
of cpu_quant.cpp and cpu_quant_k.cpp: `int8_linear`, `int4_linear`, `kq8_linear`) the process takes the class that ran a decode-sized product
fastest on this CPU model: a short measurement (every candidate class alternated, medians), made once per CPU
model, kernel sources and torch version and cached under $METRALE_CACHE_DIR (default ~/.cache/metrale)/dispatch,
so later starts read the answer. The chosen classes are logged and reported with the worker's kernels.

The candidates are the CPU's best class and avx2 (generic never wins where avx2 runs, and the classes between
differ from the best in the bf16 paths, not in these products): at most one more class to build on a first start.
A forced
METRALE_CPU_ISA, or METRALE_KERNEL_DISPATCH=rank, keeps every op on the process's own class (the tests run so,
forcing one path at a time); METRALE_KERNEL_DISPATCH=measure (the default) measures.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import platform
import statistics
import time
from collections.abc import Callable

import torch

from metrale import cpu_isa
from metrale.gpu_worker.layers import cpu_kernels

log = logging.getLogger(__name__)

ENV = "METRALE_KERNEL_DISPATCH"  # measure (default) | rank
# The product measured: one row (a decode step's) through a layer of this size, REPEATS alternated rounds of
# CALLS calls per class.
ROWS, IN, OUT = 1, 2048, 2048
REPEATS, CALLS = 5, 8

# op name -> the arguments of a probe call after x (a packed weight of the op's layout), built on first use.
_PROBES: dict[str, Callable[[], tuple]] = {}
_chosen: dict[str, str] = {}


def probe(op: str) -> Callable[[Callable[[], tuple]], Callable[[], tuple]]:
    """Register how to build a packed weight for op `op` (decorator): a function returning the op's arguments
    after x. An op without a probe stays on the process's class."""

    def register(build: Callable[[], tuple]) -> Callable[[], tuple]:
        _PROBES[op] = build
        return build

    return register


def mode() -> str:
    """measure or rank (METRALE_KERNEL_DISPATCH, and rank whenever METRALE_CPU_ISA forces a class)."""
    value = os.environ.get(ENV, "measure").strip().lower() or "measure"
    if value not in ("measure", "rank"):
        raise ValueError(f"{ENV} must be measure or rank (got {value!r})")
    return "rank" if cpu_isa.requested() != "auto" else value


def class_for(op: str) -> str:
    """The kernel class whose build runs op `op` in this process."""
    own = cpu_kernels.isa()
    if op not in _PROBES or mode() == "rank" or own == "amx":
        return own  # on amx the products' wide path (AMX tiles for many rows) lives in that build alone
    if op not in _chosen:
        _chosen[op] = _cached_or_measured(op, own)
    return _chosen[op]


def describe() -> str:
    """The process's class, with the ops that run on another: "avx512_bf16 (int8_linear: avx2)"."""
    own = cpu_kernels.isa()
    moved = [f"{op}: {cls}" for op, cls in sorted(_chosen.items()) if cls != own]
    return f"{own} ({', '.join(moved)})" if moved else own


def candidates() -> list[str]:
    """The classes measured: avx2 and the process's own, where this CPU runs them and their kernels build."""
    out = []
    for cls in dict.fromkeys(("avx2", cpu_kernels.isa())):
        if cls not in cpu_isa.supported():
            continue
        try:
            cpu_kernels.ops(cls)
        except RuntimeError:
            continue
        out.append(cls)
    return out


def _cached_or_measured(op: str, own: str) -> str:
    """The cached answer for this CPU, else a fresh measurement (written to the cache)."""
    path = _cache_path()
    answers = _read(path)
    cls = answers.get(op)
    if cls in candidates() and cpu_kernels.has(op, cls):
        log.info("kernel dispatch: %s runs on %s (measured before on this CPU: %s)", op, cls, path)
        return cls
    times = measure(op)
    if not times:
        return own
    cls = min(times, key=times.get)
    log.info("kernel dispatch: %s runs on %s (%s, median µs of a %dx%d product)", op, cls,
             ", ".join(f"{c} {t:.0f}" for c, t in sorted(times.items(), key=lambda kv: kv[1])), OUT, IN)
    answers[op] = cls
    _write(path, answers)
    return cls


def measure(op: str, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median µs per call of op on each candidate class that has it (classes alternated every round)."""
    args = _PROBES[op]()
    x = torch.randn(ROWS, IN, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    calls = {}
    for cls in candidates():
        if cpu_kernels.has(op, cls):
            fn = getattr(cpu_kernels.ops(cls), op).default
            fn(x, *args)  # warm: first-touch of the scratch and the weight
            calls[cls] = fn
    if len(calls) < 2:
        return {cls: 0.0 for cls in calls}
    samples: dict[str, list[float]] = {cls: [] for cls in calls}
    for _ in range(REPEATS):
        for cls, fn in calls.items():
            start = clock()
            for _ in range(CALLS):
                fn(x, *args)
            samples[cls].append((clock() - start) / CALLS * 1e6)
    return {cls: statistics.median(s) for cls, s in samples.items()}


def _cache_path() -> pathlib.Path:
    """One file per CPU model, kernel sources and torch version."""
    root = pathlib.Path(os.environ.get("METRALE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "metrale") / "dispatch"
    key = hashlib.sha256()
    for part in (_cpu_model(), torch.__version__, *(cpu_kernels._source(u) for u in cpu_kernels.UNITS)):
        key.update(part.encode())
    return root / f"{key.hexdigest()[:16]}.json"


def _cpu_model() -> str:
    """The CPU's model name and flags (two boxes sold under one name can differ in flags)."""
    name = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return name + " " + " ".join(sorted(cpu_isa.cpu_flags()))


def _read(path: pathlib.Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: pathlib.Path, answers: dict[str, str]) -> None:
    """Write the answers atomically (several workers of one server may measure at once)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(answers, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("kernel dispatch: cannot cache the choice in %s (%s)", path, exc)


@probe("int8_linear")
def _int8_probe() -> tuple:
    from metrale.gpu_worker.layers.quantization import pack_int8, quantize_int8

    codes, scales = pack_int8(*quantize_int8(_probe_weight()))
    return codes, scales, OUT, False


@probe("int4_linear")
def _int4_probe() -> tuple:
    from metrale.gpu_worker.layers.quantization import pack_int4, quantize_int4

    codes, scales, zeros = pack_int4(*quantize_int4(_probe_weight()))
    return codes, scales, zeros, OUT, False


def _probe_weight() -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(1)) * 0.02


@probe("int5_linear")
def _int5_probe() -> tuple:
    from metrale.gpu_worker.layers import gguf_quant_types as qt

    return (*qt.pack_int5([("Q5_0", _random_blocks("Q5_0", d_at=0))]), OUT)


@probe("kq8_linear")
def _kq8_probe() -> tuple:
    from metrale.gpu_worker.layers import gguf_quant_types as qt

    return (*qt.pack_kq8(_random_blocks("Q6_K", d_at=-2)), OUT)


def _random_blocks(name: str, d_at: int):
    """A probe layer of GGUF type `name`: random blocks whose fp16 scale d (at byte d_at of each block) is small."""
    import numpy as np

    from metrale.gpu_worker.layers import gguf_quant_types as qt

    t = qt.TYPES[name]
    raw = np.random.default_rng(1).integers(0, 256, size=(OUT, IN // t.block, t.nbytes), dtype=np.uint8)
    d = np.full(1, 1e-4, dtype=np.float16).view(np.uint8)
    raw[:, :, d_at : d_at + 2 or None] = d
    return qt.decode(name, raw.reshape(OUT, -1))

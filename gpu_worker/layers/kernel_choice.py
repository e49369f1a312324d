"""Which kernel class runs each native part of a CPU decode step: the one this CPU runs fastest, not the widest.

The classes rank by instruction set (metrale/cpu_isa.py), but a wider class is not always faster: on some AMD
CPUs the AVX2 build of the int8 and 4-bit products outruns the AVX-512 one, for some weight shapes and not
others, and the fused decode step's own work (norms, rotary, the KV write, attention, residuals) can run faster
in a narrower build too. So the process measures, on each candidate class, with the model's own weights:

- each quantized product (an op of cpu_quant.cpp, cpu_quant_k.cpp, cpu_quant_q5.cpp: `int8_linear`,
  `int4_linear`, `int5_linear`, `kq8_linear`) per weight shape (`product_class`): the layer's packed weight
  times one decode row, streamed from memory as a decode step reads it (`measure_product`). On the amx class this
  picks the few-row path only: from WIDE_ROWS bf16 rows a quantized layer (every one of these products) still
  takes amx's wide product (AMX tiles, which live in that build alone; quantization.py's NativeProduct holds both
  ops);
- the fused decode step (`step_class`, models/fused_decode.py): the model's own step built from each class's
  library, one row over a small private KV cache, its products as chosen above. Only a step whose every
  projection is a native product is measured (a dense projection's GEMV and its packed weight belong to the
  process's class, which keeps that step).

Each choice is a short measurement (the candidate classes alternated, each one's fastest round), made once per CPU model, kernel
sources and torch version, and cached under $METRALE_CACHE_DIR (default ~/.cache/metrale)/dispatch (one JSON
object, keyed "op OUTxIN" and "decode_step ..."), so later starts read the answers. Each choice is logged, and
the ones off the process's class are listed in the worker's kernels description (`describe`, `metrale status`).

The candidates are the CPU's best class and avx2 (generic never wins where avx2 runs; the classes between differ
from the best in the bf16 paths): at most one more class to build on a first start. A forced METRALE_CPU_ISA,
or METRALE_KERNEL_DISPATCH=rank, keeps every part on the process's own class (the tests run so, forcing one
path at a time); METRALE_KERNEL_DISPATCH=measure (the default) measures.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import pathlib
import platform
import time
from collections.abc import Callable

import torch

from metrale import cpu_isa
from metrale.gpu_worker.layers import cpu_kernels

log = logging.getLogger(__name__)

ENV = "METRALE_KERNEL_DISPATCH"  # measure (default) | rank
# Each measurement: REPEATS alternated rounds per class; a product's round reads every copy of its weight once.
REPEATS = 5
STEP_CALLS = 2  # a whole decode step's calls a round (it reads every layer's weight already)
STREAM_MIN, STREAM_MAX = 64 << 20, 256 << 20  # bytes of weight copies a product's measurement streams
MEASURE = "streamed"  # how products are measured: part of the cache's name, so an older method's answers go

_chosen: dict[str, str] = {}  # key ("int8_linear 2048x2048", "decode_step ...") -> class, this process


def mode() -> str:
    """measure or rank (METRALE_KERNEL_DISPATCH, and rank whenever METRALE_CPU_ISA forces a class)."""
    value = os.environ.get(ENV, "measure").strip().lower() or "measure"
    if value not in ("measure", "rank"):
        raise ValueError(f"{ENV} must be measure or rank (got {value!r})")
    return "rank" if cpu_isa.requested() != "auto" else value


def product_key(op: str, rows: int, cols: int) -> str:
    """The cache key of a product: its op and weight shape."""
    return f"{op} {rows}x{cols}"


def product_class(op: str, args: tuple, rows: int, cols: int) -> str:
    """The kernel class whose build runs op `op` fastest for a weight of `rows` x `cols` at a decode step's row:
    args are the op's arguments after x (the layer's packed weight, rows, and wide=False where it takes it)."""
    own = cpu_kernels.isa()
    if mode() == "rank":
        return own
    key = product_key(op, rows, cols)
    if key not in _chosen:
        usable = [c for c in candidates() if cpu_kernels.has(op, c)]
        _chosen[key] = _cached_or_measured(key, own, usable, lambda: measure_product(op, args, cols, usable))
    return _chosen[key]


def step_class(key: str, runner: Callable[[str], Callable[[], object]]) -> str:
    """The kernel class whose build runs the fused decode step `key` fastest: runner(cls) builds the step from
    class cls's library and returns one call of it (measured only where no answer is cached)."""
    own = cpu_kernels.isa()
    if mode() == "rank":
        return own
    if key not in _chosen:
        usable = candidates()
        _chosen[key] = _cached_or_measured(key, own, usable, lambda: measure_calls({c: runner(c) for c in usable}, STEP_CALLS))
    return _chosen[key]


def describe() -> str:
    """The process's class, with the parts that run on another: "amx (kq8_linear 49152x576: avx2)"."""
    own = cpu_kernels.isa()
    moved = [f"{key}: {cls}" for key, cls in sorted(_chosen.items()) if cls != own]
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


def _cached_or_measured(key: str, own: str, usable: list[str], timed: Callable[[], dict[str, float]]) -> str:
    """The cached answer for this CPU, else a fresh measurement (written to the cache); own where there is
    nothing to choose from."""
    if len(usable) < 2:
        return own
    path = _cache_path()
    answers = _read(path)
    cls = answers.get(key)
    if cls in usable:
        log.info("kernel dispatch: %s runs on %s (measured before on this CPU: %s)", key, cls, path)
        return cls
    times = timed()
    cls = min(times, key=times.get)
    log.info("kernel dispatch: %s runs on %s (µs a call, fastest round: %s)", key, cls,
             ", ".join(f"{c} {t:.0f}" for c, t in sorted(times.items(), key=lambda kv: kv[1])))
    answers = _read(path)  # another worker may have written its answers meanwhile
    answers[key] = cls
    _write(path, answers)
    return cls


def measure_product(op: str, args: tuple, cols: int, classes: list[str] | None = None,
                    clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """µs per call (measure_calls) of op on each of `classes` (default: the candidates that have it) for one bf16 row
    times the weight in args, as a decode step meets it: streamed from memory, not from cache. A decode step runs
    every layer's weight once, the model's bytes far beyond the last-level cache, while one weight called again
    and again stays in cache, where another class may win (on an AMD EPYC the AVX-512 int8 product won in cache and
    lost streamed). So each round calls the op once on each of copies of the weight that together exceed
    stream_bytes(), in turn, every class on the same copies."""
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    size = sum(a.nbytes for a in args if isinstance(a, torch.Tensor))
    copies = [args] + [tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
                       for _ in range(-(-stream_bytes() // max(size, 1)) - 1)]
    turn = itertools.count()  # one cycle for every class: each call's copy was last read a stream ago
    calls = {}
    for cls in classes if classes is not None else [c for c in candidates() if cpu_kernels.has(op, c)]:
        fn = getattr(cpu_kernels.ops(cls), op).default
        calls[cls] = lambda fn=fn: fn(x, *copies[next(turn) % len(copies)])
    return measure_calls(calls, len(copies), clock)


def stream_bytes() -> int:
    """Bytes of weight copies a product's measurement streams: twice the last-level cache (sysfs), at least
    STREAM_MIN and at most STREAM_MAX."""
    largest = 0
    for size in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size.read_text().strip().upper()
            largest = max(largest, int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return min(max(2 * largest, STREAM_MIN), STREAM_MAX)


def measure_calls(calls: dict[str, Callable[[], object]], per_round: int,
                  clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """µs per call of each class's call in its fastest round, the classes alternated every round (each warmed
    first). The fastest round, not the median: other work on the box only ever adds time (on a shared box a
    round can lose whole time slices), so each class's best round is the closest to what its kernels cost."""
    for call in calls.values():
        call()  # first touch of the scratch and the weight
    samples: dict[str, list[float]] = {cls: [] for cls in calls}
    for _ in range(REPEATS):
        for cls, call in calls.items():
            start = clock()
            for _ in range(per_round):
                call()
            samples[cls].append((clock() - start) / per_round * 1e6)
    return {cls: min(s) for cls, s in samples.items()}


def _cache_path() -> pathlib.Path:
    """One file per CPU model, kernel sources, torch version and way of measuring."""
    root = pathlib.Path(os.environ.get("METRALE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "metrale") / "dispatch"
    key = hashlib.sha256()
    for part in (_cpu_model(), torch.__version__, MEASURE, *(cpu_kernels._source(u) for u in cpu_kernels.UNITS)):
        key.update(part.encode())
    return root / f"{key.hexdigest()[:16]}.json"


def _cpu_model() -> str:
    """The CPU's model name and flags (two boxes sold under one name can differ in flags)."""
    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    # platform.processor() runs `uname -p` in a child process on Linux: only where /proc/cpuinfo names nothing
    return (name or platform.processor()) + " " + " ".join(sorted(cpu_isa.cpu_flags()))


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

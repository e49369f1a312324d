"""Native CPU kernels for the decode step: paged attention, the KV write, RMSNorm, the few-row GEMV, greedy argmax.

The torch path of decode attention gathers every decode row's blocks into a padded copy and runs
SDPA on it: per layer it writes and reads the whole live KV twice. `paged_decode` walks each row's
block table and reads each key and value once, with an online softmax (flash-decoding) in float32:
no copy, no mask, and the query heads of one KV group share each key load. The other three replace
several small torch ops each (a decode step is hundreds of them, and each costs its dispatch).

Plain C++ against ATen (parallel_for on torch's own thread pool), compiled on first use with the
system C++ compiler, once per instruction-set class (metrale/cpu_isa.py: generic, avx2, avx512, avx512_bf16,
amx), each with its class's flags and its own op namespace (`metrale_cpu_<class>`), so several can be loaded
in one process and a build never depends on the machine that made it. The process runs the class
`cpu_isa.chosen()` names (the CPU's best, or METRALE_CPU_ISA); `ops(cls)` loads any other the CPU can run (the
tests check each against torch). Builds are cached under $METRALE_CACHE_DIR (default ~/.cache/metrale)/kernels,
keyed by the source, the flags and torch's version. Without a compiler, or if the build fails, `available()`
is False and every caller keeps its torch path. METRALE_CPU_KERNELS=torch never builds or uses them;
=native makes a failed build an error.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading

import torch

from metrale import cpu_isa

log = logging.getLogger(__name__)

ENV_CHOICE = "METRALE_CPU_KERNELS"  # auto (default) | native | torch
BUILD_TIMEOUT_S = 300

# The kernels' C++ (next to this file), in units each built into its own library per class, the text of
# cpu_prelude.h first (the class macros, the op namespace). Within a unit the sources form one translation
# unit in this order: the dense product (cpu_gemv.cpp) and the fused decode step (cpu_decode_step.cpp) call the
# kernels before them directly. The quantized products and the sampler's passes are units of their own: a
# failed build of one leaves the others. "core" loads first (it defines the namespace). The text is part of
# the build cache key.
_HERE = pathlib.Path(__file__).parent
UNITS = {
    "core": ("cpu_kernels.cpp", "cpu_gemv.cpp", "cpu_decode_step.cpp"),
    "quant": ("cpu_quant.cpp", "cpu_quant_k.cpp", "cpu_quant_q5.cpp"),
    "sampling": ("cpu_sampling.cpp",),
}


def _source(unit: str) -> str:
    """The text compiled for one unit: the prelude, then its files."""
    return "\n".join((_HERE / name).read_text(encoding="utf-8") for name in ("cpu_prelude.h", *UNITS[unit]))


# -ffp-contract=off: a product rounds before the add that follows it, as in torch's separate ops (explicit
# FMA intrinsics still fuse, where a kernel asks for them).
# -fopenmp: with torch's OpenMP backend, at::parallel_for is inline in the headers, and without the flag
# its pragma is dropped and every kernel runs on one thread. The library then shares torch's OpenMP runtime
# (libgomp.so.1 is already loaded by torch, so its soname resolves there).
_FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w"]
if torch.backends.openmp.is_available():
    _FLAGS.insert(2, "-fopenmp")

# Per class: the loaded op namespace, or the reason it is not loaded. "active" is the process's class.
_loaded: dict[str, object] = {}
_errors: dict[str, str] = {}
_names: dict[str, set[str]] = {}  # per class: the ops its loaded units registered
_active: dict[str, object] = {}


def choice() -> str:
    """What METRALE_CPU_KERNELS asks for: auto, native or torch."""
    value = os.environ.get(ENV_CHOICE, "auto").strip().lower() or "auto"
    if value not in ("auto", "native", "torch"):
        raise ValueError(f"{ENV_CHOICE} must be auto, native or torch (got {value!r})")
    return value


def isa() -> str:
    """The instruction-set class this process's kernels are built for (cpu_isa.chosen(), read once); ValueError
    when METRALE_CPU_ISA forces a class this CPU cannot run."""
    if "isa" not in _active:
        _active["isa"] = cpu_isa.chosen()
    return _active["isa"]


def supported_isas() -> list[str]:
    """The classes this CPU can run, least first (each can be loaded with ops(cls))."""
    return cpu_isa.supported()


def available() -> bool:
    """True when the native kernels of this process's class are loaded (building them on first call, unless
    the choice is torch). The first load logs the class.

    Under METRALE_CPU_KERNELS=native a failed build raises RuntimeError instead of returning False.
    """
    wanted = choice()
    if wanted == "torch":
        return False
    cls = isa()
    if "ops" not in _active:
        ns = _load(cls)
        _active["ops"] = ns
        if ns is not None:
            log.info("native CPU kernels: %s (the CPU's best: %s; %s=auto|%s)", cls, cpu_isa.best(), cpu_isa.ENV, "|".join(supported_isas()))
        else:
            log.warning("native CPU kernels unavailable, using torch's ops (%s)", _errors.get(cls))
    if wanted == "native" and _active["ops"] is None:
        raise RuntimeError(f"{ENV_CHOICE}=native but the kernels are unavailable: {_errors.get(cls)}")
    return _active["ops"] is not None


def loaded() -> bool:
    """True when the kernels are already loaded in this process and not turned off since (METRALE_CPU_KERNELS=torch
    after a load: then ops() refuses, so nothing may take the native path); never builds, cheap to ask anywhere."""
    return _active.get("ops") is not None and choice() != "torch"


def error() -> str | None:
    """Why this process's kernels did not load (None when they did, or were never asked for)."""
    return _errors.get(_active.get("isa", ""))


def ops(cls: str | None = None):
    """The op namespace of class cls (default: this process's), built and loaded on first use; RuntimeError
    when it cannot be (a class the CPU lacks, no compiler, a failed build)."""
    if cls is None:
        if not available():
            raise RuntimeError(f"native CPU kernels unavailable: {error()}")
        return _active["ops"]
    lacking = cpu_isa.missing(cls)
    if lacking:
        raise RuntimeError(f"this CPU cannot run the {cls} kernels (it lacks {', '.join(lacking)})")
    ns = _load(cls)
    if ns is None:
        raise RuntimeError(f"the {cls} kernels did not build: {_errors.get(cls)}")
    return ns


def classes(cls: str | None = None):
    """The custom-class namespace (torch.classes.metrale_cpu_<class>) of class cls (default: this process's)."""
    ops(cls)
    return getattr(torch.classes, namespace(cls or isa()))


def namespace(cls: str) -> str:
    """The op namespace of class cls's build."""
    return f"metrale_cpu_{cls}"


def has(name: str, cls: str | None = None) -> bool:
    """True when op `name` is loaded for class cls (default: this process's): a unit that failed to build
    leaves its ops out, and their callers keep their torch path."""
    return name in _names.get(cls or _active.get("isa", ""), ())


def _load(cls: str):
    """Build (or find cached) and load class cls's libraries: its op namespace, or None when the core unit
    fails (the reason in _errors). Another unit that fails is logged and left out (see has())."""
    if cls in _loaded:
        return _loaded[cls]
    _loaded[cls] = None
    for unit in UNITS:
        try:
            torch.ops.load_library(str(_build(cls, unit)))
        except Exception as exc:  # no compiler, a failed build, a library that will not load
            _errors[cls if unit == "core" else f"{cls}/{unit}"] = f"{type(exc).__name__}: {exc}"
            if unit == "core":
                return None
            log.warning("native CPU kernels: the %s unit for %s is unavailable (%s)", unit, cls, exc)
    _loaded[cls] = getattr(torch.ops, namespace(cls))
    _names[cls] = {
        op.split("::", 1)[1] for op in torch._C._dispatch_get_all_op_names() if op.startswith(namespace(cls) + "::")
    }
    return _loaded[cls]


def paged_decode(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    first_key: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per row over its cached keys first_key[r] <= t < seq_lens[r].

    q [R, heads, head_dim] (any row/head strides); k_blocks [blocks, kv_heads, head_dim, block_size]
    (PagedKVCache with transposed_keys); v_cache [blocks, block_size, kv_heads, head_dim];
    block_tables int64 [R, W]; seq_lens, first_key int64 [R]. Returns [R, heads, head_dim] in q's dtype.
    """
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return _active["ops"].paged_decode(q, k_blocks, v_cache, block_tables, seq_lens, first_key, scale, out)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_blocks: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] at slots (int64 [T]); keys into head-dim-major blocks."""
    _active["ops"].write_kv(k, v, k_blocks, v_cache, slots)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
    """HF's RMSNorm of x (bit for bit in bfloat16); with delta, first x += delta in place (the residual add)."""
    out = torch.empty_like(x)
    _active["ops"].rms_norm(x, delta, weight, eps, out)
    return out


def rotary(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated in place by its tokens' rows of table [len, 2, head_dim] (cos,
    signed sin); torch's rounding points, so bit for bit what layers/rotary.apply_rotary gives."""
    _active["ops"].rotary(x, table, positions)
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2n] = [gate | up], rounded where torch rounds: [T, n]."""
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype, device=gate_up.device)
    _active["ops"].silu_mul(gate_up, out)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for x [rows, in] and a plain [out, in] weight: the native GEMV for one or two
    bfloat16 rows, else F.linear (see layers/cpu_gemv.cpp)."""
    return _active["ops"].linear(x, weight, bias)


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [S]: each row's argmax of float32 or bfloat16 x [S, V], the first index among ties (into out
    when given: contiguous int64 [S])."""
    if out is None:
        out = torch.empty(x.shape[0], dtype=torch.int64)
    _active["ops"].argmax_rows(x, out)
    return out


def _build(cls: str | None = None, unit: str = "core") -> pathlib.Path:
    """Class cls's library of one unit (default: this process's class, the core unit), compiled now unless an
    identical build is cached."""
    cls = cls or isa()
    flags = _FLAGS + cpu_isa.compile_flags(cls) + [
        f"-DMETRALE_NS={namespace(cls)}",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    ]
    source = _source(unit)
    key = hashlib.sha256("\n".join([source, *flags, torch.__version__, sys.platform]).encode()).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("METRALE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "metrale") / "kernels"
    lib = cache / f"metrale_cpu_{cls}_{unit}-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    # One builder at a time (a server's worker and a test may start together); the rest wait, then load.
    with open(cache / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return lib
        _compile(source, flags, lib, f"{cls}/{unit}")
    return lib


def _compile(source: str, flags: list[str], lib: pathlib.Path, what: str) -> None:
    """Compile source into lib (written to a temp name, then renamed: readers never see half a file)."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) on PATH")
    torch_lib = pathlib.Path(torch.__file__).parent / "lib"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src = pathlib.Path(tmp) / "cpu_kernels.cpp"
        src.write_text(source)
        out = pathlib.Path(tmp) / lib.name
        cmd = [compiler, *flags, *includes, str(src), "-o", str(out), f"-L{torch_lib}", "-lc10", "-ltorch_cpu"]
        log.info("building the native CPU kernels %s (once; cached in %s)", what, lib.parent)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(out, lib)


def prebuild(classes: list[str] | None = None, jobs: int = 2, stop: threading.Event | None = None) -> dict[str, str]:
    """Build (or find cached) every unit of each class (default: every class this CPU can run, this process's
    first, then least first, the order of the tests' kernel_isa fixture), `jobs` compilers at a time, without
    loading any: for an image or a test session that would otherwise compile them one after another on first
    use. Once `stop` is set no further build starts. Returns "class/unit" -> the error of each build that failed."""
    from concurrent.futures import ThreadPoolExecutor

    if classes is None:
        own = isa()
        classes = [own] + [c for c in supported_isas() if c != own]

    def build(cls: str, unit: str) -> None:
        if stop is None or not stop.is_set():
            _build(cls, unit)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {f"{c}/{u}": pool.submit(build, c, u) for c in classes for u in UNITS}
    return {what: f"{type(f.exception()).__name__}: {f.exception()}" for what, f in futures.items() if f.exception()}


if __name__ == "__main__":  # python -m metrale.gpu_worker.layers.cpu_kernels [JOBS]: prebuild()
    # SIGTERM (a test session that ended first): the compilers, in this process group, die of it, each build's
    # temporary folder is removed as its thread sees the failure, and no queued build starts.
    halt = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: halt.set())
    failed = prebuild(jobs=int(sys.argv[1]) if len(sys.argv) > 1 else 2, stop=halt)
    for what, why in failed.items():
        print(f"{what}: {why}", file=sys.stderr)
    sys.exit(1 if failed and not halt.is_set() else 0)

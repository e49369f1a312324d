"""Native CPU kernels for the decode step: paged attention, the KV write, RMSNorm, the few-row GEMV, greedy argmax.

The torch path of decode attention gathers every decode row's blocks into a padded copy and runs
SDPA on it: per layer it writes and reads the whole live KV twice. `paged_decode` walks each row's
block table and reads each key and value once, with an online softmax (flash-decoding) in float32:
no copy, no mask, and the query heads of one KV group share each key load. The other three replace
several small torch ops each (a decode step is hundreds of them, and each costs its dispatch).

Plain C++ against ATen (parallel_for on torch's own thread pool), compiled on first use with the
system C++ compiler and cached under $METRALE_CACHE_DIR (default ~/.cache/metrale)/kernels, keyed by
the source, the flags and torch's version. Without a compiler, or if the build fails, `available()`
is False and every caller keeps its torch path. METRALE_CPU_KERNELS=torch never builds or uses them;
=native makes a failed build an error.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import torch

log = logging.getLogger(__name__)

ENV_CHOICE = "METRALE_CPU_KERNELS"  # auto (default) | native | torch
BUILD_TIMEOUT_S = 300

# The kernels' C++ (next to this file), compiled as one translation unit in this order: the dense product
# (cpu_gemv.cpp) and the fused decode step (cpu_decode_step.cpp) call the kernels before them directly.
# The text is part of the build cache key.
SOURCE = "\n".join(
    (pathlib.Path(__file__).with_name(name)).read_text(encoding="utf-8")
    for name in ("cpu_kernels.cpp", "cpu_gemv.cpp", "cpu_decode_step.cpp")
)

# -ffp-contract=off: a product rounds before the add that follows it, as in torch's separate ops.
# -fopenmp: with torch's OpenMP backend, at::parallel_for is inline in the headers, and without the flag
# its pragma is dropped and every kernel runs on one thread (measured: a bf16 decode step at batch 32 went
# from ~15 to ~12.5 ms once they ran on both cores). The library then shares torch's OpenMP runtime (libgomp.so.1
# is already loaded by torch, so its soname resolves there).
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w"]
if torch.backends.openmp.is_available():
    _FLAGS.insert(2, "-fopenmp")

_state: dict[str, bool | str] = {}  # "loaded": bool, "error": why not


def choice() -> str:
    """What METRALE_CPU_KERNELS asks for: auto, native or torch."""
    value = os.environ.get(ENV_CHOICE, "auto").strip().lower() or "auto"
    if value not in ("auto", "native", "torch"):
        raise ValueError(f"{ENV_CHOICE} must be auto, native or torch (got {value!r})")
    return value


def available() -> bool:
    """True when the native kernels are loaded (building them on first call, unless the choice is torch).

    Under METRALE_CPU_KERNELS=native a failed build raises RuntimeError instead of returning False.
    """
    wanted = choice()
    if wanted == "torch":
        return False
    if "loaded" not in _state:
        try:
            torch.ops.load_library(str(_build()))
            _state["loaded"] = True
        except Exception as exc:  # no compiler, a failed build, a library that will not load
            _state["loaded"] = False
            _state["error"] = f"{type(exc).__name__}: {exc}"
            log.warning("native CPU kernels unavailable, using torch's ops (%s)", _state["error"])
    if wanted == "native" and not _state["loaded"]:
        raise RuntimeError(f"{ENV_CHOICE}=native but the kernels are unavailable: {_state.get('error')}")
    return bool(_state["loaded"])


def loaded() -> bool:
    """True when the kernels are already loaded in this process (never builds: cheap to ask anywhere)."""
    return bool(_state.get("loaded"))


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
    return torch.ops.metrale_cpu.paged_decode(q, k_blocks, v_cache, block_tables, seq_lens, first_key, scale, out)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_blocks: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] at slots (int64 [T]); keys into head-dim-major blocks."""
    torch.ops.metrale_cpu.write_kv(k, v, k_blocks, v_cache, slots)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
    """HF's RMSNorm of x (bit for bit in bfloat16); with delta, first x += delta in place (the residual add)."""
    out = torch.empty_like(x)
    torch.ops.metrale_cpu.rms_norm(x, delta, weight, eps, out)
    return out


def rotary(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated in place by its tokens' rows of table [len, 2, head_dim] (cos,
    signed sin); torch's rounding points, so bit for bit what layers/rotary.apply_rotary gives."""
    torch.ops.metrale_cpu.rotary(x, table, positions)
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2n] = [gate | up], rounded where torch rounds: [T, n]."""
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype, device=gate_up.device)
    torch.ops.metrale_cpu.silu_mul(gate_up, out)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for x [rows, in] and a plain [out, in] weight: the native GEMV for one or two
    bfloat16 rows, else F.linear (see layers/cpu_gemv.cpp)."""
    return torch.ops.metrale_cpu.linear(x, weight, bias)


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [S]: each row's argmax of float32 or bfloat16 x [S, V], the first index among ties (into out
    when given: contiguous int64 [S])."""
    if out is None:
        out = torch.empty(x.shape[0], dtype=torch.int64)
    torch.ops.metrale_cpu.argmax_rows(x, out)
    return out


def _build() -> pathlib.Path:
    """The kernels' shared library, compiled now unless an identical build is cached."""
    flags = _FLAGS + [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    # -march=native: the build is for this CPU, so its instruction sets are part of the key (a cache
    # folder shared with an older machine must not hand it instructions it lacks).
    key = hashlib.sha256("\n".join([SOURCE, *flags, torch.__version__, sys.platform, _cpu_flags()]).encode()).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("METRALE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "metrale") / "kernels"
    lib = cache / f"metrale_cpu_kernels-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    # One builder at a time (a server's worker and a test may start together); the rest wait, then load.
    with open(cache / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return lib
        _compile(flags, lib)
    return lib


def _cpu_flags() -> str:
    """The CPU's feature flags as the kernel sees them (/proc/cpuinfo; the machine name elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.machine()


def _compile(flags: list[str], lib: pathlib.Path) -> None:
    """Compile SOURCE into lib (written to a temp name, then renamed: readers never see half a file)."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) on PATH")
    torch_lib = pathlib.Path(torch.__file__).parent / "lib"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src = pathlib.Path(tmp) / "cpu_kernels.cpp"
        src.write_text(SOURCE)
        out = pathlib.Path(tmp) / lib.name
        cmd = [compiler, *flags, *includes, str(src), "-o", str(out), f"-L{torch_lib}", "-lc10", "-ltorch_cpu"]
        log.info("building the native CPU kernels (once; cached in %s)", lib.parent)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(out, lib)

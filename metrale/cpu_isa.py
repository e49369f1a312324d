"""Which CPU kernel set a process runs: the best instruction-set class the CPU has, or the one forced.

The native kernels (gpu_worker/layers/cpu_kernels.py) are built once per class, side by side, each with its
own compiler flags, never with -march=native: a build made on one machine must not decide what another runs.
The classes, from least to most:

    generic       x86-64 baseline (or any other architecture): plain C++ the compiler vectorises
    avx2          AVX2 + FMA + F16C (Haswell, AMD Zen 1-3): most CPU users' machines
    avx512        AVX-512 F/BW/VL/DQ + VNNI (Cascade Lake, Ice Lake)
    avx512_bf16   avx512 + AVX512-BF16 (AMD Zen 4/5, Cooper Lake)
    amx           avx512_bf16 + AMX tiles, BF16 and INT8 (Sapphire Rapids and later)

METRALE_CPU_ISA=auto (default) takes the best the CPU has; a class name forces it, and asking for one the CPU
lacks is an error naming the missing flags. A forced class also caps what torch's own kernels
(ATEN_CPU_CAPABILITY), oneDNN (ONEDNN_MAX_CPU_ISA) and MKL (MKL_ENABLE_INSTRUCTIONS) use, unless those are set already, so the whole
process computes as it would on a CPU of that class: an AMX box can run and measure the AVX2 path. Both are
read when torch starts, so `apply_to_environment()` runs before torch is imported (metrale/__init__.py).

No torch here: the engine core and the frontend read the choice too (status, metrics).
"""

from __future__ import annotations

import functools
import os
import platform

ENV = "METRALE_CPU_ISA"
CLASSES = ("generic", "avx2", "avx512", "avx512_bf16", "amx")

# The /proc/cpuinfo flags each class needs (each class needs its predecessors' too).
_NEEDS = {
    "generic": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}

# The compiler flags of each class's build (cumulative, like _NEEDS).
_FLAGS = {
    "generic": (),
    "avx2": ("-mavx", "-mavx2", "-mfma", "-mf16c", "-mbmi2"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"),
    "avx512_bf16": ("-mavx512bf16",),
    "amx": ("-mamx-tile", "-mamx-bf16", "-mamx-int8"),
}

# What a forced class caps torch's ATen kernels and oneDNN to (None: no cap, the CPU's best).
_ATEN_CAP = {"generic": "default", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512", "amx": None}
_ONEDNN_CAP = {"generic": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE_VNNI", "avx512_bf16": "AVX512_CORE_BF16", "amx": None}
_MKL_CAP = {"generic": "SSE4_2", "avx2": "AVX2", "avx512": "AVX512", "avx512_bf16": "AVX512", "amx": None}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none), read once per process (a
    model's load asks per layer)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def missing(cls: str, flags: frozenset[str] | None = None) -> list[str]:
    """The CPU flags that class `cls` needs and this CPU lacks (empty: it can run it)."""
    if cls not in CLASSES:
        raise ValueError(f"{ENV} must be auto or one of {', '.join(CLASSES)} (got {cls!r})")
    if cls != "generic" and not _is_x86():
        return [f"an x86-64 CPU (this is {platform.machine()})"]
    have = cpu_flags() if flags is None else flags
    needed = [f for c in CLASSES[: CLASSES.index(cls) + 1] for f in _NEEDS[c]]
    return [f for f in needed if f not in have]


def supported(flags: frozenset[str] | None = None) -> list[str]:
    """Every class this CPU can run, least first."""
    return [c for c in CLASSES if not missing(c, flags)]


def best(flags: frozenset[str] | None = None) -> str:
    """The most capable class this CPU can run."""
    return supported(flags)[-1]


def requested() -> str:
    """What METRALE_CPU_ISA asks for: "auto" or a class name (ValueError for anything else)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value != "auto" and value not in CLASSES:
        raise ValueError(f"{ENV} must be auto or one of {', '.join(CLASSES)} (got {value!r})")
    return value


def chosen() -> str:
    """The class this process runs: the forced one, or the CPU's best. ValueError (one line naming what is
    missing) when the forced class needs flags this CPU lacks."""
    value = requested()
    if value == "auto":
        return best()
    lacking = missing(value)
    if lacking:
        raise ValueError(f"{ENV}={value}, but this CPU lacks {', '.join(lacking)} (it can run: {', '.join(supported())})")
    return value


def compile_flags(cls: str) -> list[str]:
    """The compiler flags of class `cls`'s kernel build."""
    if cls == "generic":
        return ["-march=x86-64", "-mtune=generic"] if _is_x86() else []
    return ["-mtune=generic", *(f for c in CLASSES[1 : CLASSES.index(cls) + 1] for f in _FLAGS[c])]


def has_native_bf16(cls: str) -> bool:
    """True for the classes that multiply bfloat16 natively (AVX512-BF16, AMX); the others widen to float32."""
    return CLASSES.index(cls) >= CLASSES.index("avx512_bf16")


def apply_to_environment() -> None:
    """Cap torch's and oneDNN's own kernels to a forced class (see the module docstring); nothing under auto or
    for a bad value (the worker reports that when it starts)."""
    try:
        value = requested()
    except ValueError:
        return
    if value == "auto":
        return
    if _ATEN_CAP[value] is not None:
        os.environ.setdefault("ATEN_CPU_CAPABILITY", _ATEN_CAP[value])
    if _ONEDNN_CAP[value] is not None:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN_CAP[value])
    if _MKL_CAP[value] is not None:
        os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", _MKL_CAP[value])

"""The seeded draw's rules, shared by the device sampler (gpu_worker/sampler.py, cpu_sampling.cpp) and the numpy one
(metrale/testing/host_sampler.py, FakeDevice's): one definition of each constant and of the numpy side of each rule.

The fake device the lane is tested on must pick what the device would have, so both compute the same float32
values bit for bit: the noise key is splitmix64 of (seed, position, vocab index), the uniform draw
(k + 0.5) / 2**NOISE_BITS, the noise -log32(-log32(u)), top-p's weights exp_weights. `log32` (fdlibm's logf) and `exp_weights` (Cephes' expf) are IEEE
+ - * / and bit operations in a fixed order, with constants given by their bits, so the device's versions (torch
op for op, the native kernels) give the same bits whatever libm or vector unit runs them. numpy only: it is the
numpy side of each rule.
"""

from __future__ import annotations

import numpy as np

GREEDY_EPS = 1e-5  # temperatures below this pick greedily (vLLM's _SAMPLING_EPS)
NOISE_BITS = 23  # uniform draws are (k + 0.5) / 2**23: exact in float32 and strictly inside (0, 1)
WEIGHT_BITS = 30  # top-p weights are floor(e^(x - max) * 2^30): exact integer masses

# splitmix64 constants (Steele, Lea & Flood 2014; the finaliser of Vigna's splitmix64).
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
_U64 = np.uint64


def f32(bits: int) -> np.float32:
    """The float32 with these bits (the rules' constants: no decimal conversion to disagree on)."""
    return np.array(bits, dtype=np.uint32).view(np.float32)[()]


# log32: fdlibm's logf polynomial and ln 2 split; exp_weights: Cephes' expf (ln 2 split, polynomial, log2 e).
LG1, LG2, LG3, LG4 = f32(0x3F2AAAAA), f32(0x3ECCCE13), f32(0x3E91E9EE), f32(0x3E789E26)
LN2_HI, LN2_LO = f32(0x3F317180), f32(0x3717F7D1)
LOG2E, C1, C2 = f32(0x3FB8AA3B), f32(0x3F318000), f32(0xB95E8083)
P = tuple(f32(b) for b in (0x39506967, 0x3AB743CE, 0x3C088908, 0x3D2AA9C1, 0x3E2AAAAA, 0x3F000000))
_ONE, _TWO, _HALF = np.float32(1.0), np.float32(2.0), np.float32(0.5)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 values (wrapping)."""
    z = (z ^ (z >> _U64(30))) * _U64(MIX1)
    z = (z ^ (z >> _U64(27))) * _U64(MIX2)
    return z ^ (z >> _U64(31))


def row_keys(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Each row's noise key (int64 bits): a hash of its (seed, position) and nothing else."""
    with np.errstate(over="ignore"):
        s = np.asarray(seeds).astype(np.int64).view(np.uint64)
        p = np.asarray(positions).astype(np.int64).view(np.uint64)
        key = mix64(mix64(s + _U64(GOLDEN)) + (p + _U64(1)) * _U64(GOLDEN))
    return key.view(np.int64)


def log32(x: np.ndarray) -> np.ndarray:
    """float32 log of positive normal float32 values, within a few ulp: fdlibm's logf (one branch) in + - * /, so
    the same bits as the device's (sampler._log32_, cpu_sampling.cpp's log32), whatever libm or vector unit."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    ix = x.view(np.int32)
    m = ix & np.int32(0x7FFFFF)
    i = (m + np.int32(0x4AFB20)) & np.int32(0x800000)  # a mantissa >= sqrt(2) is halved
    f = (m | (i ^ np.int32(0x3F800000))).view(np.float32) - _ONE
    dk = ((ix >> np.int32(23)) + np.int32(-127) + (i >> np.int32(23))).astype(np.float32)
    s = f / (f + _TWO)
    z = s * s
    w = z * z
    r = (w * LG3 + LG1) * z + (w * LG4 + LG2) * w
    hfsq = f * _HALF * f
    return dk * LN2_HI - ((hfsq - ((hfsq + r) * s + dk * LN2_LO)) - f)


def exp_weights(t: np.ndarray) -> np.ndarray:
    """int32 floor(e^t * 2^30) for float32 t <= 0 (t below -64 weighs 0): Cephes' expf in + - * / and a power of
    two, the same bits as the device's (sampler._exp_weights, cpu_sampling.cpp's exp_weight)."""
    t = np.maximum(np.asarray(t, dtype=np.float32), np.float32(-64.0))
    n = np.floor(t * LOG2E + _HALF)
    r = (t - n * C1) - n * C2
    p = P[0] * r + P[1]
    for c in P[2:]:
        p = p * r + c
    e = (p * (r * r) + r) + _ONE
    scale = ((n.astype(np.int32) + np.int32(157)) << np.int32(23)).view(np.float32)  # 2^(n + 30)
    return (e * scale).astype(np.int32)

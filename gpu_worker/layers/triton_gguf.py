"""GGUF blocks multiplied on CUDA by a Triton kernel that dequantizes each weight tile in registers.

The weight stays in gguf_quant_types' common form on the device, w[n, k] = d * sc * c + dm * mn (`pack_for_triton`):

- codes: int8 [N, K], or two per byte [N, K / 2] (k even in the low nibble) where the codes span at most 16
  values (Q4_0, Q4_1, Q4_K: c = nibble + lo), or are 4-bit indices into IQ4's table (IQ4_NL, IQ4_XS);
- sc, mn: int8 per sub-block of `sub` inputs [N, K / sub]; d, dm: fp16 per block of `sup` inputs [N, K / sup].

`matmul(x, w)` is y[M, N] = x[M, K] @ W.T. Below DENSE_ROWS rows it is one fused kernel: each program loads a
[BLOCK_N, BLOCK_K] tile of codes as [BLOCK_N, BLOCK_K / sub, sub], scales it by its sub-blocks' d * sc and
offsets it by dm * mn in float32 (the products `gguf_quant_types.dequantize` rounds, so the weight is the dense
path's, rounded to x's dtype as it rounds it), and accumulates x tile @ w tile.T in float32 with tl.dot; a
single row (batch-1 decode) sums elementwise products instead, no tl.dot. Decode rows take narrow BLOCK_N
tiles, so every weight is read once and the grid still covers the GPU; more rows take wider tiles. From
DENSE_ROWS rows (prefill), where the product outweighs reading the weight, the weight is dequantized for the
step into x's dtype (`dequantize`, the same tile code) and multiplied by torch's matmul, then freed: no dense
copy outlives the call. x and y are float32, bfloat16 or float16; float32 dots run in IEEE precision (not TF32).

This is vLLM's GGUF path in Triton (its CUDA kernels dequantize per type; here one kernel takes every type
through the common form).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from metrale.gpu_worker.layers.gguf_quant_types import IQ4_VALUES, Blocks

GEMV_ROWS = 1  # up to this many rows of x: the GEMV kernel (each row reads the weight; from L2 after the first)
GEMV_PROGRAMS_PER_SM = 4  # a single row's programs (split over K to reach it): loads in flight on every SM
DECODE_ROWS = 16  # up to this many rows of x: the decode config (tl.dot's smallest M is 16)
DENSE_ROWS = 256  # from this many rows: dequantized for the step, then torch's matmul (bench_gguf_cuda.py)


@dataclass(frozen=True, slots=True)
class Config:
    """One launch shape: tiles, warps, pipeline stages (`config_for`'s, or a benchmark's)."""

    block_m: int  # 1: the GEMV kernel (one program per row of x and BLOCK_N outputs; no tl.dot)
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # GEMV only: spans of K run as separate programs, their sums added after


@dataclass(slots=True)
class TritonWeight:
    """A weight in the common form on the device (see the module docstring); `lut` is IQ4's table of codes
    (int8 [16]) when the nibbles index it, else None; `lo` the code of nibble 0 otherwise."""

    codes: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor | None
    d: torch.Tensor
    dm: torch.Tensor | None
    sub: int
    sup: int
    n: int
    k: int
    packed: bool
    lo: int = 0
    lut: torch.Tensor | None = None


@triton.jit
def _rounded_to_bf16(v):
    """float32 v rounded to the nearest bfloat16 (ties to even), still float32: the interpreter's cast truncates."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _weight_tile(
    C, SC, MN, D, DM, LUT, n, n_ok, k0, K, lo, stride_c, stride_sc, stride_d,
    SUB: tl.constexpr, SUP: tl.constexpr, PACKED: tl.constexpr, HAS_LUT: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """w[n, k0 : k0 + BLOCK_K] in float32 ([BLOCK_N, BLOCK_K]; zeros past N and K): d * sc * c + dm * mn."""
    G: tl.constexpr = BLOCK_K // SUB
    g = tl.arange(0, G)
    if PACKED:  # a sub-block's SUB / 2 bytes hold its codes in pairs: (low nibble, high nibble)
        j = tl.arange(0, SUB // 2)
        kb = k0 // 2 + g[None, :, None] * (SUB // 2) + j[None, None, :]  # [1, G, SUB / 2]
        byte = tl.load(C + n[:, None, None] * stride_c + kb, mask=n_ok[:, None, None] & (kb < K // 2), other=0)
        byte = byte.to(tl.int32)
        nib = tl.reshape(tl.join(byte & 0xF, (byte >> 4) & 0xF), (BLOCK_N, G, SUB))
        if HAS_LUT:
            c = tl.load(LUT + nib).to(tl.float32)
        else:
            c = (nib + lo).to(tl.float32)
    else:
        i = tl.arange(0, SUB)
        k3 = k0 + g[None, :, None] * SUB + i[None, None, :]  # [1, G, SUB]
        c = tl.load(C + n[:, None, None] * stride_c + k3, mask=n_ok[:, None, None] & (k3 < K), other=0).to(tl.float32)
    ks = k0 + g[None, :] * SUB  # each sub-block's first input [1, G]
    ok = n_ok[:, None] & (ks < K)
    d = tl.load(D + n[:, None] * stride_d + ks // SUP, mask=ok, other=0.0).to(tl.float32)
    s = d * tl.load(SC + n[:, None] * stride_sc + ks // SUB, mask=ok, other=0).to(tl.float32)
    w3 = c * s[:, :, None]
    if HAS_MIN:
        dm = tl.load(DM + n[:, None] * stride_d + ks // SUP, mask=ok, other=0.0).to(tl.float32)
        z = dm * tl.load(MN + n[:, None] * stride_sc + ks // SUB, mask=ok, other=0).to(tl.float32)
        w3 = w3 + z[:, :, None]
    return tl.reshape(w3, (BLOCK_N, BLOCK_K))


@triton.jit(do_not_specialize=["M", "lo"])  # one compile for every count of rows
def _gguf_matmul_kernel(
    X, Y, C, SC, MN, D, DM, LUT,
    M, N, K, lo,
    stride_xm, stride_ym, stride_c, stride_sc, stride_d,
    SUB: tl.constexpr, SUP: tl.constexpr, PACKED: tl.constexpr, HAS_LUT: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    ROUND_BF16: tl.constexpr, PRECISION: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y over all of K, the weight tile dequantized in registers."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _weight_tile(C, SC, MN, D, DM, LUT, n, n_ok, k0, K, lo, stride_c, stride_sc, stride_d,
                         SUB, SUP, PACKED, HAS_LUT, HAS_MIN, BLOCK_N, BLOCK_K)
        k = k0 + kk
        x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & (k[None, :] < K), other=0.0)
        if ROUND_BF16:
            w = _rounded_to_bf16(w)
        if DOT_F32:  # x's dtype is float32, or the interpreter (no bfloat16 dot): the same products in float32
            w = w.to(X.dtype.element_ty).to(tl.float32)
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision=PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w.to(X.dtype.element_ty)))
    if ROUND_BF16:
        acc = _rounded_to_bf16(acc)
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M", "lo", "k_span"])
def _gguf_gemv_kernel(
    X, Y, P, C, SC, MN, D, DM, LUT,
    M, N, K, lo, k_span,
    stride_xm, stride_ym, stride_c, stride_sc, stride_d,
    SUB: tl.constexpr, SUP: tl.constexpr, PACKED: tl.constexpr, HAS_LUT: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    """BLOCK_N outputs of one row of x over one span of K: products summed elementwise in float32, reduced
    once at the end (one row gains nothing from tl.dot, whose operand layout costs a trip through shared
    memory). Split over K, each span's sums land in P [SPLIT_K, M, N] for `_sum_splits_kernel`."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1)
    split = tl.program_id(2)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_end = tl.minimum(K, (split + 1) * k_span)
    for k0 in range(split * k_span, k_end, BLOCK_K):
        w = _weight_tile(C, SC, MN, D, DM, LUT, n, n_ok, k0, k_end, lo, stride_c, stride_sc, stride_d,
                         SUB, SUP, PACKED, HAS_LUT, HAS_MIN, BLOCK_N, BLOCK_K)
        if ROUND_BF16:
            w = _rounded_to_bf16(w)
        w = w.to(X.dtype.element_ty).to(tl.float32)  # the dense path's weight, rounded to x's dtype
        k = k0 + kk
        x = tl.load(X + row * stride_xm + k, mask=k < k_end, other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if SPLIT_K > 1:
        tl.store(P + (split * M + row) * N + n, y, mask=n_ok)
    else:
        if ROUND_BF16:
            y = _rounded_to_bf16(y)
        tl.store(Y + row * stride_ym + n, y.to(Y.dtype.element_ty), mask=n_ok)


@triton.jit
def _sum_splits_kernel(P, Y, M, N, stride_ym, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr):
    """y[row] = the sum of the K spans' partial sums, in a fixed order (no atomics: the same answer each run)."""
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    y = tl.zeros([BLOCK], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        y += tl.load(P + (split * M + row) * N + n, mask=ok, other=0.0)
    if ROUND_BF16:
        y = _rounded_to_bf16(y)
    tl.store(Y + row * stride_ym + n, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["lo"])
def _gguf_dequantize_kernel(
    W, C, SC, MN, D, DM, LUT,
    N, K, lo,
    stride_w, stride_c, stride_sc, stride_d,
    SUB: tl.constexpr, SUP: tl.constexpr, PACKED: tl.constexpr, HAS_LUT: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    """One [BLOCK_N, BLOCK_K] tile of the weight written dense in W's dtype (the prefill path's first half)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = n < N
    w = _weight_tile(C, SC, MN, D, DM, LUT, n, n_ok, k0, K, lo, stride_c, stride_sc, stride_d,
                     SUB, SUP, PACKED, HAS_LUT, HAS_MIN, BLOCK_N, BLOCK_K)
    if ROUND_BF16:
        w = _rounded_to_bf16(w)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(W + n[:, None] * stride_w + k[None, :], w.to(W.dtype.element_ty), mask=n_ok[:, None] & (k[None, :] < K))


def pack_for_triton(blocks: Blocks, device: torch.device | str) -> TritonWeight:
    """The device tensors of `blocks`: codes two per byte where they fit in a nibble (see the module docstring)."""
    codes = blocks.codes
    rows, cols = codes.shape
    lo, hi = (int(codes.min()), int(codes.max())) if codes.size else (0, 0)
    lut = None
    nibbles = None
    if cols % 2 == 0 and hi - lo <= 15:
        nibbles = (codes.astype(np.int16) - lo).astype(np.uint8)
    elif cols % 2 == 0:
        inverse = np.full(256, 255, dtype=np.uint8)
        inverse[IQ4_VALUES.astype(np.int16) + 128] = np.arange(16, dtype=np.uint8)
        index = inverse[codes.astype(np.int16) + 128]
        if (index != 255).all():
            nibbles, lo = index, 0
            lut = torch.from_numpy(IQ4_VALUES.copy()).to(device)
    if nibbles is not None:
        stored = torch.from_numpy(np.ascontiguousarray(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)))
    else:
        stored, lo = torch.from_numpy(np.ascontiguousarray(codes, dtype=np.int8)), 0

    def put(a):
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(device)

    has_min = blocks.mn is not None
    return TritonWeight(
        codes=stored.to(device), sc=put(blocks.sc), mn=put(blocks.mn) if has_min else None, d=put(blocks.d),
        dm=put(blocks.dm) if has_min else None, sub=blocks.sub, sup=blocks.sup, n=rows, k=cols,
        packed=nibbles is not None, lo=lo, lut=lut,
    )


def config_for(m: int, n: int, k: int, sms: int = 1) -> Config:
    """The launch shape for m rows on a GPU of `sms` multiprocessors: narrow tiles while the weight's bytes
    dominate (enough programs to keep loads in flight on every multiprocessor, each weight read once per
    BLOCK_M rows; one row splits K for more), wider ones as the rows grow."""
    narrow = 32 if n >= 8192 else 16
    if m <= GEMV_ROWS:
        block_k = 256 if k % 256 == 0 else 64
        split = max(1, min(triton.cdiv(GEMV_PROGRAMS_PER_SM * sms, triton.cdiv(n, narrow)), k // (2 * block_k), 8))
        return Config(1, narrow, block_k, num_warps=4, num_stages=1, split_k=split)
    if m <= DECODE_ROWS:
        return Config(16, narrow, 256 if k % 256 == 0 else 64, num_warps=4, num_stages=4)
    if m <= 64:
        return Config(32 if m <= 32 else 64, narrow, 128 if k % 128 == 0 else 64, num_warps=4, num_stages=4)
    return Config(64, 64, 64, num_warps=4, num_stages=3)


def matmul(x: torch.Tensor, w: TritonWeight, config: Config | None = None, *, dense: bool | None = None):
    """x [M, K] @ W.T -> [M, N] in x's dtype (float32, bfloat16 or float16), accumulated in float32: fused
    (the tile dequantized in registers) below DENSE_ROWS rows, else the weight dequantized to x's dtype for
    the step and multiplied by torch (the dequantization then costs little beside the product); `dense`
    forces either."""
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"x {tuple(x.shape)} does not match a GGUF weight of {w.k} inputs")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x in {x.dtype}: the GGUF kernel takes float32, bfloat16 or float16")
    x = x.contiguous()
    m = x.shape[0]
    if dense is None:
        dense = m >= DENSE_ROWS
    if dense:
        return x @ dequantize(w, x.dtype).T
    y = torch.empty(m, w.n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or config_for(m, w.n, w.k, _multiprocessors(x.device))
    interpreted = _interpreted()
    grid = (triton.cdiv(w.n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    if cfg.block_m == 1:
        _gemv(x, y, w, cfg, interpreted)
        return y
    _gguf_matmul_kernel[grid](
        x, y, *_weight_args(w), m, w.n, w.k, w.lo,
        x.stride(0), y.stride(0), w.codes.stride(0), w.sc.stride(0), w.d.stride(0),
        **_form(w), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=max(cfg.block_k, w.sub),
        DOT_F32=x.dtype == torch.float32 or interpreted, ROUND_BF16=interpreted and x.dtype == torch.bfloat16,
        PRECISION="ieee", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def _gemv(x: torch.Tensor, y: torch.Tensor, w: TritonWeight, cfg: Config, interpreted: bool) -> None:
    """y = x @ W.T by the GEMV kernel, over cfg.split_k spans of K (whole blocks of BLOCK_K) summed after."""
    block_k = max(cfg.block_k, w.sub)
    k_span = triton.cdiv(triton.cdiv(w.k, cfg.split_k), block_k) * block_k
    split_k = triton.cdiv(w.k, k_span)
    m = x.shape[0]
    partial = torch.empty(split_k, m, w.n, dtype=torch.float32, device=x.device) if split_k > 1 else y
    round_bf16 = interpreted and x.dtype == torch.bfloat16
    _gguf_gemv_kernel[(triton.cdiv(w.n, cfg.block_n), m, split_k)](
        x, y, partial, *_weight_args(w), m, w.n, w.k, w.lo, k_span,
        x.stride(0), y.stride(0), w.codes.stride(0), w.sc.stride(0), w.d.stride(0),
        **_form(w), BLOCK_N=cfg.block_n, BLOCK_K=block_k, SPLIT_K=split_k, ROUND_BF16=round_bf16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split_k > 1:
        _sum_splits_kernel[(m, triton.cdiv(w.n, 1024))](
            partial, y, m, w.n, y.stride(0), SPLIT_K=split_k, BLOCK=1024, ROUND_BF16=round_bf16, num_warps=4,
        )


def dequantize(w: TritonWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype`, each value the dense path's (float32 d * sc * c + dm * mn, rounded once)."""
    out = torch.empty(w.n, w.k, dtype=dtype, device=w.codes.device)
    block_n, block_k = 32, max(128, w.sub)
    _gguf_dequantize_kernel[(triton.cdiv(w.n, block_n), triton.cdiv(w.k, block_k))](
        out, *_weight_args(w), w.n, w.k, w.lo, out.stride(0), w.codes.stride(0), w.sc.stride(0), w.d.stride(0),
        **_form(w), BLOCK_N=block_n, BLOCK_K=block_k, ROUND_BF16=_interpreted() and dtype == torch.bfloat16,
        num_warps=4,
    )
    return out


def product(w: TritonWeight, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
    """GgufLinearMethod's run product (`wide` is the CPU kernels' choice; nothing to choose here)."""
    return matmul(x, w)


def _weight_args(w: TritonWeight) -> tuple[torch.Tensor, ...]:
    """C, SC, MN, D, DM, LUT: an absent tensor passed as a present one (the kernel never reads it)."""
    return (w.codes, w.sc, w.mn if w.mn is not None else w.sc, w.d, w.dm if w.dm is not None else w.d,
            w.lut if w.lut is not None else w.sc)


def _form(w: TritonWeight) -> dict:
    return dict(SUB=w.sub, SUP=w.sup, PACKED=w.packed, HAS_LUT=w.lut is not None, HAS_MIN=w.mn is not None)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessor count (1 off CUDA: the interpreter gains nothing from more programs)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _interpreted() -> bool:
    """Triton's interpreter (a CPU): no bfloat16 dot, and its bfloat16 casts truncate."""
    return os.environ.get("TRITON_INTERPRET") == "1"

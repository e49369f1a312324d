"""GGUF blocks multiplied on CUDA by Triton kernels that dequantize each weight tile in registers.

`pack_for_triton` lays a layer's blocks (gguf_quant_types' common form, w = d * sc * c + dm * mn) out once for
the kernels (triton_gguf_kernels.py explains the layout): codes in chunks of H inputs, two per byte where they
span at most 16 values (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K), else int8; the int8 sub-block multipliers and fp16 block
scales as the common form keeps them. A decode row reads ~4.5 bits a weight (Q4_K) where dense bf16 reads 16,
so a kernel that streams the bytes at the rate the dense matmul does is faster by what it does not read.

`matmul(x, w)` is y[M, N] = x[M, K] @ W.T, through the row of `TABLE` for M rows: the GEMV kernel for a few
rows (float32 FMAs, no tl.dot: tensor cores gain nothing there), tl.dot with the dequantized tile as its left
operand for more, and from the last row's count the weight dequantized for the step into x's dtype and
torch's matmul (prefill, where the product outweighs reading the weight). Each kernel splits K into spans
until its programs fill the GPU (`PROGRAMS_PER_SM`) while the spans' partial sums stay small beside the
weight (`PARTIAL_SHARE`), the sums added after in a fixed order.
The table is data: scripts/bench_gguf_cuda.py times each row against alternatives on a GPU, so one run
says which to keep. x and y are float32, bfloat16 or float16; float32 dots run in IEEE precision (not TF32).

Numerics: the GEMV kernel multiplies the weight's exact value (float32) and rounds y once; tl.dot and the
dense path multiply the weight rounded to x's dtype, as a dense copy of it would be.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton

from metrale.gpu_worker.layers import triton_gguf_kernels as kernels
from metrale.gpu_worker.layers.gguf_quant_types import Blocks

CHUNK = 256  # inputs per chunk of the layout, where K allows (else the largest power of two that divides it)
PROGRAMS_PER_SM = 8  # split K until the grid has this many programs per multiprocessor (loads in flight)
PARTIAL_SHARE = 0.25  # ... but no further than the spans' float32 sums (written, read back) cost this share of
# the weight's bytes: a wide x's sums soon outweigh the bytes a split saves waiting for


@dataclass(frozen=True, slots=True)
class Config:
    """One launch shape. kind: "gemv" (float32 FMAs), "dot" (tl.dot, block_m >= 16) or "dense" (dequantize,
    then torch's matmul). split_k 0: as many spans as PROGRAMS_PER_SM asks; chunks: the GEMV's chunks per loop
    (their loads in flight together)."""

    kind: str
    block_m: int = 1
    block_n: int = 16
    chunks: int = 1
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 1


# The launch per count of rows: the first row whose bound is >= M (None: every M). bench_gguf_cuda.py times
# each against the alternatives it lists, on the three layer shapes of an 8B model.
TABLE: tuple[tuple[int | None, Config], ...] = (
    (1, Config("gemv", 1, 16, chunks=2)),
    (4, Config("gemv", 4, 16, chunks=1)),
    (16, Config("dot", 16, 64, num_stages=2)),
    (32, Config("dot", 32, 64, num_stages=2)),
    (128, Config("dot", 64, 128, num_warps=8, num_stages=2)),
    (None, Config("dense")),
)


@dataclass(slots=True)
class TritonWeight:
    """A weight in the kernels' layout (see the module docstring); `lo` is the code of nibble 0 when packed."""

    codes: torch.Tensor  # uint8 [N, K / 2] packed, else int8 [N, K]
    sc: torch.Tensor  # int8 [N, K / sub]
    mn: torch.Tensor | None  # int8 [N, K / sub], or None: no offset
    d: torch.Tensor  # fp16 [N, K / sup]
    dm: torch.Tensor | None
    sub: int
    sup: int
    chunk: int  # H: inputs per chunk
    n: int
    k: int
    packed: bool
    lo: int = 0


def _chunk(k: int, sub: int, packed: bool) -> int | None:
    """The layout's chunk for K inputs: a power of two dividing K, whole sub-blocks per half when packed."""
    for h in (CHUNK, 128, 64, 32, 16):
        if k % h == 0 and h % (2 * sub if packed else sub) == 0:
            return h
    return None


def pack_for_triton(blocks: Blocks, device: torch.device | str) -> TritonWeight:
    """The device tensors of `blocks` in the kernels' layout (repacked once, at load)."""
    codes = blocks.codes
    rows, cols = codes.shape
    lo, hi = (int(codes.min()), int(codes.max())) if codes.size else (0, 0)
    packed = hi - lo <= 15 and _chunk(cols, blocks.sub, True) is not None
    chunk = _chunk(cols, blocks.sub, packed)
    if chunk is None:
        raise ValueError(f"{cols} inputs are not whole sub-blocks of {blocks.sub}")
    if packed:  # per chunk: byte j holds input j (low nibble) and input H / 2 + j (high nibble)
        nib = (codes.astype(np.int16) - lo).astype(np.uint8).reshape(rows, cols // chunk, 2, chunk // 2)
        stored = np.ascontiguousarray((nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(rows, cols // 2))
    else:
        stored, lo = np.ascontiguousarray(codes, dtype=np.int8), 0

    def put(a):
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return TritonWeight(
        codes=put(stored), sc=put(blocks.sc), mn=put(blocks.mn), d=put(blocks.d),
        dm=put(blocks.dm) if blocks.mn is not None else None, sub=blocks.sub, sup=blocks.sup, chunk=chunk,
        n=rows, k=cols, packed=packed, lo=lo,
    )


def config_for(m: int) -> Config:
    """TABLE's launch for m rows."""
    for bound, config in TABLE:
        if bound is None or m <= bound:
            return config
    raise AssertionError("TABLE ends in a row for every count")


def matmul(x: torch.Tensor, w: TritonWeight, config: Config | None = None, *, dense: bool | None = None):
    """x [M, K] @ W.T -> [M, N] in x's dtype (float32, bfloat16 or float16), accumulated in float32, by
    TABLE's launch for M rows or `config`; `dense` forces the dequantize-then-matmul path or keeps off it."""
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"x {tuple(x.shape)} does not match a GGUF weight of {w.k} inputs")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x in {x.dtype}: the GGUF kernel takes float32, bfloat16 or float16")
    x = x.contiguous()
    m = x.shape[0]
    cfg = config or config_for(m)
    if dense is not None and dense != (cfg.kind == "dense"):
        cfg = Config("dense") if dense else next(c for _, c in TABLE[::-1] if c.kind != "dense")
    if cfg.kind == "dense":
        return x @ dequantize(w, x.dtype).T
    y = torch.empty(m, w.n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    interpreted = _interpreted()
    round_bf16 = interpreted and x.dtype == torch.bfloat16
    n_tiles, m_tiles = triton.cdiv(w.n, cfg.block_n), triton.cdiv(m, cfg.block_m)
    chunks = w.k // w.chunk
    split = cfg.split_k or _auto_split(w, m, n_tiles * m_tiles, _multiprocessors(x.device))
    span = triton.cdiv(triton.cdiv(chunks, max(1, min(split, chunks))), cfg.chunks) * cfg.chunks
    split = triton.cdiv(chunks, span)
    partial = torch.empty(split, m, w.n, dtype=torch.float32, device=x.device) if split > 1 else y
    args = (x, y, partial, *_weight_args(w), m, w.n, w.k, w.lo, span,
            x.stride(0), y.stride(0), w.codes.stride(0), w.sc.stride(0), w.d.stride(0))
    grid = (n_tiles, m_tiles, split)
    if cfg.kind == "gemv":
        kernels.gemv_kernel[grid](
            *args, **_form(w), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CHUNKS=cfg.chunks, SPLIT=split > 1,
            ROUND_BF16=round_bf16, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    elif cfg.kind == "dot":
        kernels.dot_kernel[grid](
            *args, **_form(w), BLOCK_M=max(cfg.block_m, 16), BLOCK_N=cfg.block_n, SPLIT=split > 1,
            DOT_F32=x.dtype == torch.float32 or interpreted, ROUND_BF16=round_bf16, PRECISION="ieee",
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    else:
        raise ValueError(f"unknown kernel kind {cfg.kind!r}")
    if split > 1:
        kernels.sum_splits_kernel[(m, triton.cdiv(w.n, 1024))](
            partial, y, m, w.n, y.stride(0), split, BLOCK=1024, ROUND_BF16=round_bf16, num_warps=4,
        )
    return y


def _auto_split(w: TritonWeight, m: int, tiles: int, sms: int) -> int:
    """Spans of K for a grid of `tiles` output tiles: PROGRAMS_PER_SM programs a multiprocessor, within
    PARTIAL_SHARE of the weight's bytes in partial sums."""
    weight_bytes = sum(t.numel() * t.element_size() for t in (w.codes, w.sc, w.mn, w.d, w.dm) if t is not None)
    cap = int(PARTIAL_SHARE * weight_bytes / (8 * m * w.n))
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, tiles), cap))


def dequantize(w: TritonWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype`, each value the dense path's (float32 d * sc * c + dm * mn, rounded once)."""
    out = torch.empty(w.n, w.k, dtype=dtype, device=w.codes.device)
    block_n = 32
    kernels.dequantize_kernel[(triton.cdiv(w.n, block_n), w.k // w.chunk)](
        out, *_weight_args(w), w.n, w.k, w.lo, out.stride(0), w.codes.stride(0), w.sc.stride(0), w.d.stride(0),
        **_form(w), BLOCK_N=block_n, ROUND_BF16=_interpreted() and dtype == torch.bfloat16, num_warps=4,
    )
    return out


def product(w: TritonWeight, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
    """GgufLinearMethod's run product (`wide` is the CPU kernels' choice; nothing to choose here)."""
    return matmul(x, w)


def _weight_args(w: TritonWeight) -> tuple[torch.Tensor, ...]:
    """C, SC, MN, D, DM: an absent tensor passed as a present one (the kernel never reads it)."""
    return (w.codes, w.sc, w.mn if w.mn is not None else w.sc, w.d, w.dm if w.dm is not None else w.d)


def _form(w: TritonWeight) -> dict:
    return dict(SUB=w.sub, SUP=w.sup, H=w.chunk, PACKED=w.packed, HAS_MIN=w.mn is not None)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessor count (1 off CUDA: the interpreter gains nothing from more programs)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _interpreted() -> bool:
    """Triton's interpreter (a CPU): no bfloat16 dot, and its bfloat16 casts truncate."""
    return os.environ.get("TRITON_INTERPRET") == "1"

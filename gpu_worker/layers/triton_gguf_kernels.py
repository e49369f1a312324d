"""The Triton kernels behind triton_gguf.py: a GGUF weight in its device layout, dequantized in registers.

The layout (triton_gguf.pack_for_triton): the weight's K inputs run in chunks of H (a power of two dividing K,
256 where it can). A chunk of a row is HB contiguous bytes of codes: H int8 codes, or, packed, H / 2 bytes whose
low nibbles are the chunk's first half of inputs and whose high nibbles its second half (ggml's own order, at
the chunk's width). So a program reads each chunk as one [BLOCK_N, G, SUB] tile of bytes (G sub-blocks of SUB
codes, 16-byte vector loads), and a nibble needs a mask or a shift, never a shuffle between threads. Scales
stay as the common form has them: sc, mn int8 per sub-block [N, K / SUB], d, dm fp16 per block [N, K / SUP];
a tile loads its rows' [BLOCK_N, G] of them once and scales whole sub-blocks.

- `gemv_kernel` (a few rows of x): each sub-block's codes times x summed in float32 registers, then scaled by
  d * sc (and x's sum by dm * mn): llama.cpp's mmvq order, with no tl.dot. The weight's value is exact (no
  rounding to x's dtype).
- `dot_kernel` (more rows): the weight tile dequantized to x's dtype (the dense path's weight) and multiplied
  by tensor cores as the left operand, y.T = W @ x.T, so the row count is tl.dot's N (16 upward).
- both split K into spans when their tiles alone do not fill the GPU: each span's sums land in P
  [spans, M, N] (float32) and `sum_splits_kernel` adds them in a fixed order (the same answer each run).
- `dequantize_kernel`: the weight dense in W's dtype, for the prefill path's torch matmul.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded_to_bf16(v):
    """float32 v rounded to the nearest bfloat16 (ties to even), still float32: the interpreter's cast truncates."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _chunk_bytes(C, n, ok, q, stride_c, HB: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr):
    """Chunk q's stored codes of rows n: [BLOCK_N, G, SUB] (bytes, or int8 codes), zeros where not `ok`."""
    g = tl.arange(0, G)
    i = tl.arange(0, SUB)
    off = n[:, None, None] * stride_c + q * HB + g[None, :, None] * SUB + i[None, None, :]
    return tl.load(C + off, mask=ok[:, None, None], other=0)


@triton.jit
def _scales(SC, MN, D, DM, n, ok, first, stride_sc, stride_d,
            G: tl.constexpr, PER_BLOCK: tl.constexpr, HAS_MIN: tl.constexpr):
    """Sub-blocks first .. first + G - 1 of rows n: (d * sc, dm * mn) in float32 [BLOCK_N, G] (exact: an fp16
    times a small integer); the second is the first again where the type has no offset."""
    s_at = first + tl.arange(0, G)
    ok2 = ok[:, None]
    d = tl.load(D + n[:, None] * stride_d + (s_at // PER_BLOCK)[None, :], mask=ok2, other=0.0).to(tl.float32)
    s = d * tl.load(SC + n[:, None] * stride_sc + s_at[None, :], mask=ok2, other=0).to(tl.float32)
    z = s
    if HAS_MIN:
        dm = tl.load(DM + n[:, None] * stride_d + (s_at // PER_BLOCK)[None, :], mask=ok2, other=0.0).to(tl.float32)
        z = dm * tl.load(MN + n[:, None] * stride_sc + s_at[None, :], mask=ok2, other=0).to(tl.float32)
    return s, z


@triton.jit
def _codes(b, lo, half: tl.constexpr, PACKED: tl.constexpr):
    """The float32 codes of one half of a chunk's bytes (packed: low nibbles first), or of all of them."""
    if PACKED:
        v = b.to(tl.int32)
        if half == 0:
            v = v & 0xF
        else:
            v = v >> 4
        return (v + lo).to(tl.float32)
    else:
        return b.to(tl.float32)


@triton.jit
def _gemv_part(acc, c, s, z, X, n, row0, M, k0, q_ok, stride_xm,
               G: tl.constexpr, SUB: tl.constexpr, BLOCK_M: tl.constexpr, HAS_MIN: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] plus, per row of x, each sub-block's sum of codes c [BLOCK_N, G, SUB] times
    x[k0 ...], scaled by s (and x's sum by z). x is loaded in c's own layout (each thread the inputs of its
    codes, from L1), so nothing crosses threads but the sums."""
    k = k0 + tl.arange(0, G)[None, :, None] * SUB + tl.arange(0, SUB)[None, None, :] + 0 * n[:, None, None]
    r_at = tl.arange(0, BLOCK_M)[None, :]
    for r in tl.static_range(BLOCK_M):
        row = row0 + r
        ok = q_ok & ((row + 0 * n) < M)  # vectors only: the interpreter's scalar comparisons are no booleans
        x = tl.load(X + row * stride_xm + k, mask=ok[:, None, None], other=0.0).to(tl.float32)
        t = tl.sum(c * x, axis=2) * s
        if HAS_MIN:
            t += z * tl.sum(x, axis=2)
        acc += tl.where(r_at == r, tl.sum(t, axis=1)[:, None], 0.0)
    return acc


@triton.jit(do_not_specialize=["M", "lo", "span"])
def gemv_kernel(
    X, Y, P, C, SC, MN, D, DM,
    M, N, K, lo, span,
    stride_xm, stride_ym, stride_c, stride_sc, stride_d,
    SUB: tl.constexpr, SUP: tl.constexpr, H: tl.constexpr, PACKED: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, SPLIT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """y[BLOCK_M rows, BLOCK_N outputs] over chunks [split * span, (split + 1) * span) of K, CHUNKS chunks a
    loop (their loads in flight together); sums in float32 registers."""
    HB: tl.constexpr = H // 2 if PACKED else H
    G: tl.constexpr = HB // SUB
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row0 = tl.program_id(1) * BLOCK_M
    split = tl.program_id(2)
    n_ok = n < N
    q_begin = split * span
    q_end = tl.minimum(K // H, q_begin + span)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for q0 in range(q_begin, q_end, CHUNKS):
        for j in tl.static_range(CHUNKS):
            q = q0 + j
            q_ok = (q + 0 * n) < q_end  # [BLOCK_N]: see _gemv_part
            b = _chunk_bytes(C, n, n_ok & q_ok, q, stride_c, HB, G, SUB)
            first = q * (H // SUB)
            s, z = _scales(SC, MN, D, DM, n, n_ok & q_ok, first, stride_sc, stride_d, G, SUP // SUB, HAS_MIN)
            acc = _gemv_part(acc, _codes(b, lo, 0, PACKED), s, z, X, n, row0, M, q * H, q_ok, stride_xm,
                             G, SUB, BLOCK_M, HAS_MIN)
            if PACKED:
                s, z = _scales(SC, MN, D, DM, n, n_ok & q_ok, first + G, stride_sc, stride_d, G, SUP // SUB, HAS_MIN)
                acc = _gemv_part(acc, _codes(b, lo, 1, PACKED), s, z, X, n, row0, M, q * H + HB, q_ok, stride_xm,
                                 G, SUB, BLOCK_M, HAS_MIN)
    rows = row0 + tl.arange(0, BLOCK_M)
    ok = n_ok[:, None] & (rows < M)[None, :]
    if SPLIT:
        tl.store(P + (split * M + rows[None, :]) * N + n[:, None], acc, mask=ok)
    else:
        if ROUND_BF16:
            acc = rounded_to_bf16(acc)
        tl.store(Y + rows[None, :] * stride_ym + n[:, None], acc.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _weight_half(b, lo, s, z, half: tl.constexpr, PACKED: tl.constexpr, HAS_MIN: tl.constexpr,
                 BLOCK_N: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr):
    """w of one half of a chunk (or all of an unpacked one) in float32 [BLOCK_N, G * SUB]: s * c + z."""
    w = _codes(b, lo, half, PACKED) * s[:, :, None]
    if HAS_MIN:
        w += z[:, :, None]
    return tl.reshape(w, (BLOCK_N, G * SUB))


@triton.jit
def _dot_part(acc, w, X, m, m_ok, k0, stride_xm, HB: tl.constexpr, DOT_F32: tl.constexpr,
              ROUND_BF16: tl.constexpr, PRECISION: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += w [BLOCK_N, HB] @ x[m, k0 : k0 + HB].T, w rounded to x's dtype first."""
    k = k0 + tl.arange(0, HB)
    xt = tl.load(X + m[None, :] * stride_xm + k[:, None], mask=m_ok[None, :], other=0.0)  # [HB, BLOCK_M]
    if ROUND_BF16:
        w = rounded_to_bf16(w)
    if DOT_F32:  # x in float32, or the interpreter (no bfloat16 dot): the same products in float32
        w = w.to(X.dtype.element_ty).to(tl.float32)
        acc += tl.dot(w, xt.to(tl.float32), input_precision=PRECISION)
    else:
        acc += tl.dot(w.to(X.dtype.element_ty), xt)
    return acc


@triton.jit(do_not_specialize=["M", "lo", "span"])
def dot_kernel(
    X, Y, P, C, SC, MN, D, DM,
    M, N, K, lo, span,
    stride_xm, stride_ym, stride_c, stride_sc, stride_d,
    SUB: tl.constexpr, SUP: tl.constexpr, H: tl.constexpr, PACKED: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr, ROUND_BF16: tl.constexpr, PRECISION: tl.constexpr,
):
    """y.T[BLOCK_N outputs, BLOCK_M rows] over chunks [split * span, (split + 1) * span) of K by tl.dot, the
    weight tile dequantized in registers as the left operand."""
    HB: tl.constexpr = H // 2 if PACKED else H
    G: tl.constexpr = HB // SUB
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    n_ok = n < N
    m_ok = m < M
    q_begin = split * span
    q_end = tl.minimum(K // H, q_begin + span)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for q in range(q_begin, q_end):
        b = _chunk_bytes(C, n, n_ok, q, stride_c, HB, G, SUB)
        first = q * (H // SUB)
        s, z = _scales(SC, MN, D, DM, n, n_ok, first, stride_sc, stride_d, G, SUP // SUB, HAS_MIN)
        w = _weight_half(b, lo, s, z, 0, PACKED, HAS_MIN, BLOCK_N, G, SUB)
        acc = _dot_part(acc, w, X, m, m_ok, q * H, stride_xm, HB, DOT_F32, ROUND_BF16, PRECISION)
        if PACKED:
            s, z = _scales(SC, MN, D, DM, n, n_ok, first + G, stride_sc, stride_d, G, SUP // SUB, HAS_MIN)
            w = _weight_half(b, lo, s, z, 1, PACKED, HAS_MIN, BLOCK_N, G, SUB)
            acc = _dot_part(acc, w, X, m, m_ok, q * H + HB, stride_xm, HB, DOT_F32, ROUND_BF16, PRECISION)
    ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        tl.store(P + (split * M + m[None, :]) * N + n[:, None], acc, mask=ok)
    else:
        if ROUND_BF16:
            acc = rounded_to_bf16(acc)
        tl.store(Y + m[None, :] * stride_ym + n[:, None], acc.to(Y.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M", "splits"])
def sum_splits_kernel(P, Y, M, N, stride_ym, splits, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr):
    """y[row] = the sum of the K spans' partial sums, in a fixed order (no atomics: the same answer each run)."""
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    y = tl.zeros([BLOCK], dtype=tl.float32)
    for split in range(splits):
        y += tl.load(P + (split * M + row) * N + n, mask=ok, other=0.0)
    if ROUND_BF16:
        y = rounded_to_bf16(y)
    tl.store(Y + row * stride_ym + n, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["lo"])
def dequantize_kernel(
    W, C, SC, MN, D, DM,
    N, K, lo,
    stride_w, stride_c, stride_sc, stride_d,
    SUB: tl.constexpr, SUP: tl.constexpr, H: tl.constexpr, PACKED: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_N: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    """Chunk program_id(1) of BLOCK_N rows of the weight written dense in W's dtype, in the inputs' order."""
    HB: tl.constexpr = H // 2 if PACKED else H
    G: tl.constexpr = HB // SUB
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    q = tl.program_id(1)
    n_ok = n < N
    b = _chunk_bytes(C, n, n_ok, q, stride_c, HB, G, SUB)
    first = q * (H // SUB)
    k = q * H + tl.arange(0, HB)
    for half in tl.static_range(2 if PACKED else 1):
        s, z = _scales(SC, MN, D, DM, n, n_ok, first + half * G, stride_sc, stride_d, G, SUP // SUB, HAS_MIN)
        w = _weight_half(b, lo, s, z, half, PACKED, HAS_MIN, BLOCK_N, G, SUB)
        if ROUND_BF16:
            w = rounded_to_bf16(w)
        tl.store(W + n[:, None] * stride_w + (k + half * HB)[None, :], w.to(W.dtype.element_ty), mask=n_ok[:, None])

"""Paged attention in Triton: decode and varlen prefill reading K/V in place through the block table.

The CUDA attention backend when triton imports (CUDA builds of torch ship it; it is never a dependency).
Nothing is gathered and no mask is built on the host: each program reads its row's keys and values where
they lie in the cache ([num_blocks, block_size, kv_heads, head_dim], looked up per key through the row's
block table) and masks by position — the row's length, causality, a sliding window — with an online softmax
in float32 (logit soft-capping before it, as Gemma 2's attention does).

- `paged_decode`: one query token per row; one program per (row, KV head) takes every query head of that KV
  head's group at once (GQA: each key and value is read once for the group; the group padded to 16 rows
  for the tensor-core dot), from the row's first visible key (a window's start) to its length.
- `paged_prefill`: every prefill chunk of the step in one launch; a program per (chunk, head, block of
  queries) reads the chunk's cached context and the chunk itself (written to the cache first) up to its
  causal bound.

The lengths come from device tensors and the grid from host facts the step already has (rows, the longest
chunk), so a decode step can be captured in a CUDA graph. float32 dots run in IEEE precision (not TF32), so
an fp32 model matches the torch path. The layout follows vLLM's and SGLang's Triton kernels
(triton_decode_attention.py, prefix_prefill.py), written anew for this cache and metadata.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch
import triton
import triton.language as tl

from metrale.gpu_worker.layers.attention_backends import TORCH, TorchAttention
from metrale.gpu_worker.layers.attention_metadata import AttentionMetadata, DecodeRows, PrefillBatch, build_metadata
from metrale.gpu_worker.layers.kv_cache import PagedKVCache

log = logging.getLogger(__name__)

_MIN_DOT = 16  # tl.dot's smallest M, N and K
_PROBE_TOLERANCE = 1e-4  # float32, against the torch path


@triton.jit
def _tanh(x):
    """tanh from exp (no tanh in tl): 1 - 2 / (e^(2x) + 1), exact at both ends."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _decode_kernel(
    Q, K, V, O, block_tables, seq_lens, first_keys,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_bt,
    scale, softcap,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
):
    """One row's query heads of one KV head against the row's keys [first_key, seq_len)."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)
    head_ok = h < GROUP
    heads = kv_head * GROUP + h
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=head_ok[:, None] & d_ok[None, :], other=0.0)
    seq_len = tl.load(seq_lens + row)
    first = tl.load(first_keys + row)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    # The first tile holds `first` itself and every later one a key below seq_len: no tile is all masked.
    for n0 in range((first // BLOCK_N) * BLOCK_N, seq_len, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        in_row = n < seq_len
        seen = in_row & (n >= first)
        block = tl.load(block_tables + row * stride_bt + n // BLOCK_SIZE, mask=in_row, other=0)
        tok = n % BLOCK_SIZE
        k = tl.load(K + block[:, None] * stride_kb + tok[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                    mask=seen[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(seen[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(V + block[:, None] * stride_vb + tok[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                    mask=seen[:, None] & d_ok[None, :], other=0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + row * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty),
             mask=head_ok[:, None] & d_ok[None, :])


@triton.jit
def _prefill_kernel(
    Q, K, V, O, starts, q_lens, seq_lens, block_tables,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_bt,
    scale, softcap, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOWED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """A block of one chunk's queries of one head against the row's context and the chunk, causally."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    mb = tl.program_id(2)
    q_len = tl.load(q_lens + chunk)
    if mb * BLOCK_M >= q_len:
        return
    start = tl.load(starts + chunk)
    seq_len = tl.load(seq_lens + chunk)
    context = seq_len - q_len
    kv_head = head // GROUP
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < q_len
    q_pos = context + m
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + (start + m)[:, None] * stride_qt + head * stride_qh + d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = tl.minimum(seq_len, context + (mb + 1) * BLOCK_M)  # the block's last query sees keys below this
    lo = 0
    if WINDOWED:
        lo = tl.maximum(context + mb * BLOCK_M - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        in_row = n < seq_len
        block = tl.load(block_tables + chunk * stride_bt + n // BLOCK_SIZE, mask=in_row, other=0)
        tok = n % BLOCK_SIZE
        k = tl.load(K + block[:, None] * stride_kb + tok[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                    mask=in_row[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        seen = in_row[None, :] & (n[None, :] <= q_pos[:, None])
        if WINDOWED:
            seen = seen & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        # A query of this block may see none of this tile's keys (yet): keep its exponents finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(V + block[:, None] * stride_vb + tok[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                    mask=in_row[:, None] & d_ok[None, :], other=0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + (start + m)[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


def _precision(dtype: torch.dtype) -> str:
    """The dot's precision: IEEE for float32 (TF32 would stray from the torch path), the default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(head_dim: int) -> int:
    """The head dimension padded to a power of two, at least tl.dot's minimum."""
    return max(_MIN_DOT, triton.next_power_of_2(head_dim))


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: DecodeRows, window, scale: float,
    softcap: float | None, out: torch.Tensor,
) -> torch.Tensor:
    """Attend decode rows' queries q [Rd, heads, head_dim] to their cached keys; writes and returns out [Rd, heads, head_dim]."""
    num_rows, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    bt = rows.block_ids
    block_d = _block_d(head_dim)
    _decode_kernel[(num_rows, kv_heads)](
        q, k_cache, v_cache, out, bt, rows.seq_lens, rows.first_keys[window],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), bt.stride(0),
        scale, softcap or 0.0,
        GROUP=group, BLOCK_H=max(_MIN_DOT, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=64 if block_d <= 128 else 32, BLOCK_SIZE=k_cache.shape[1], SOFTCAP=softcap is not None,
        PRECISION=_precision(q.dtype),
    )
    return out


def paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunks: PrefillBatch, window, scale: float,
    softcap: float | None, out: torch.Tensor,
) -> None:
    """Attend every prefill chunk's queries (q [T, heads, head_dim], the step's tokens) causally to its row's
    cached context and itself (already written to the cache); writes their rows of out [T, heads, head_dim]."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    block_d = _block_d(head_dim)
    block_m = 64 if block_d <= 128 else 32
    bt = chunks.block_tables
    grid = (chunks.num_chunks, heads, triton.cdiv(chunks.max_q_len, block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, chunks.starts, chunks.q_lens, chunks.seq_lens, bt,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), bt.stride(0),
        scale, softcap or 0.0, window or 0,
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=32,
        BLOCK_SIZE=k_cache.shape[1], SOFTCAP=softcap is not None, WINDOWED=window is not None,
        PRECISION=_precision(q.dtype),
    )


class TritonAttention(TorchAttention):
    """Decode rows and prefill chunks by the Triton paged kernels; every layer (windows, soft-caps, GQA)."""

    name = "triton"
    native_decode = True  # reads DecodeRows.seq_lens / first_keys
    transposed_keys = False
    graph_safe = True  # lengths from tensors, shapes from host facts: a decode step can be captured
    varlen_prefill = True  # reads AttentionMetadata.prefill_batch, not the per-row PrefillRows

    def supports(self, layer) -> bool:
        """Every layer."""
        return True

    def forward(self, layer, q, k, v, cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Write k, v into the cache, then attend in place through the block tables: [T, heads * head_dim]."""
        cache.write(layer.layer, meta.slot_mapping, k, v)
        num_tokens, heads, head_dim = q.shape
        kc, vc = cache.k[layer.layer], cache.v[layer.layer]
        out = torch.empty(num_tokens, heads, head_dim, dtype=q.dtype, device=q.device)
        decode = meta.decode
        if decode is not None:
            if decode.token_idx is None:
                paged_decode(q, kc, vc, decode, layer.window, layer.scale, layer.softcap, out)
            else:
                idx = decode.token_idx
                out[idx] = paged_decode(q[idx], kc, vc, decode, layer.window, layer.scale, layer.softcap, torch.empty_like(q[idx]))
        if meta.prefill_batch is not None:
            paged_prefill(q, kc, vc, meta.prefill_batch, layer.window, layer.scale, layer.softcap, out)
        return out.view(num_tokens, heads * head_dim)


TRITON = TritonAttention()


@functools.cache
def works_on(device: torch.device) -> bool:
    """Whether both kernels compile and run on the device and match the torch path on a small mixed step
    (decode rows, a window, a soft-cap, a chunk over cached context): the backend is only chosen if they do, so
    a triton that cannot build them here costs speed, not the device. Logged when not."""
    try:
        g = torch.Generator().manual_seed(0)
        block, heads, kv_heads, dim = 16, 4, 2, 32
        caches = [PagedKVCache(1, 8, block, kv_heads, dim, dtype=torch.float32, device=device) for _ in range(2)]
        init = torch.randn(caches[0].k[0].shape, generator=g), torch.randn(caches[0].v[0].shape, generator=g)
        for c in caches:
            c.k[0].copy_(init[0])
            c.v[0].copy_(init[1])
        rows = [(20, 1), (3, 1), (13, 9)]  # (context, new tokens)
        tables = np.array([[0, 1], [2, 0], [3, 4]], dtype=np.int32)
        slots = [int(tables[i, p // block]) * block + p % block for i, (c, n) in enumerate(rows) for p in range(c, c + n)]
        query_start = np.concatenate([[0], np.cumsum([n for _, n in rows])]).astype(np.int32)
        seq_lens = np.array([c + n for c, n in rows], dtype=np.int32)
        t = len(slots)
        q, k, v = (torch.randn(t, h, dim, generator=g).to(device) for h in (heads, kv_heads, kv_heads))
        for window, softcap in ((None, None), (7, 30.0)):
            meta = build_metadata(query_start, seq_lens, tables, torch.tensor(slots, device=device), block_size=block,
                                  windows={window}, device=device, native=True, masks=True, varlen=True, rows=True)
            layer = _ProbeLayer(0, dim**-0.5, window, softcap)
            got = TRITON.forward(layer, q, k, v, caches[0], meta)
            want = TORCH.forward(layer, q, k, v, caches[1], meta)
            err = float((got - want).abs().max())
            if not err <= _PROBE_TOLERANCE:
                log.warning("Triton attention off: its kernels differ from the torch path by %.3g here", err)
                return False
        return True
    except Exception as exc:  # noqa: BLE001 - any failure to build or run them means: not here
        log.warning("Triton attention off: its kernels cannot run here (%s: %s)", type(exc).__name__, exc)
        return False


class _ProbeLayer:
    """What a backend reads of a layer, for the probe."""

    __slots__ = ("layer", "scale", "window", "softcap")

    def __init__(self, layer: int, scale: float, window, softcap):
        self.layer, self.scale, self.window, self.softcap = layer, scale, window, softcap

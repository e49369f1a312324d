"""Attention over the paged KV cache for a flat batch mixing prefill chunks and decode rows.

A step's T tokens belong to R rows (the StepPlan layout). Rows with one query token (decodes, or a
one-token chunk) are served together. On a CPU with the native kernels (layers/cpu_kernels.py) they
read their keys and values straight from their blocks; otherwise their K/V are gathered from their
block tables, padded to the longest, and one SDPA call runs with a length mask. Rows with several
tokens (prefill chunks) run one SDPA each; a chunk whose row already has cached context (a later
chunk, or a cached prefix) reads that context from the cache and uses a causal mask offset by it.

The per-step bookkeeping (which rows are which, block ids, masks) is built once per step by
`build_metadata` and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from metrale.gpu_worker.layers import cpu_kernels
from metrale.gpu_worker.layers.kv_cache import PagedKVCache, SlotIndex

Window = int | None  # sliding window in tokens (a query sees itself and the window-1 before it), or None


@dataclass(slots=True)
class DecodeRows:
    """The one-token rows of a step, attended together."""

    token_idx: torch.Tensor | None  # int64 [Rd]: their tokens in T; None when they are all of T, in order
    block_ids: torch.Tensor  # int64 [Rd, nb]: each row's first nb blocks (nb covers the longest row)
    num_keys: int  # the longest row's seq_len: keys past it are never read
    native: bool  # attend with the native CPU kernel (seq_lens, first_keys) rather than SDPA (masks)
    seq_lens: torch.Tensor | None = None  # int64 [Rd] (native)
    first_keys: dict[Window, torch.Tensor] = field(default_factory=dict)  # int64 [Rd]: first key seen (native)
    # Additive float mask [Rd, 1, 1, num_keys] in the model's dtype (0 where the row's query may see
    # the key, -inf elsewhere), or None when every row sees every key (equal lengths, no window cut).
    masks: dict[Window, torch.Tensor | None] = field(default_factory=dict)


@dataclass(slots=True)
class PrefillRow:
    """A multi-token chunk of one row."""

    start: int  # its tokens are start:end of T
    end: int
    context: int  # tokens of the row already in the cache before this chunk
    block_ids: torch.Tensor | None  # int64 [nb] covering context + chunk; None when context == 0
    masks: dict[Window, torch.Tensor | None]  # bool [chunk, keys], None = plain causal (is_causal)


@dataclass(slots=True)
class AttentionMetadata:
    """What every layer's attention needs to know about the step."""

    slot_mapping: SlotIndex | torch.Tensor  # where each token's K/V goes (int64 [T] slots)
    num_tokens: int
    decode: DecodeRows | None
    prefills: list[PrefillRow] = field(default_factory=list)


def build_metadata(
    query_start: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    slot_mapping: SlotIndex | torch.Tensor,
    *,
    block_size: int,
    windows: set[Window],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    native: bool = False,
) -> AttentionMetadata:
    """Sort the step's rows into decode rows and prefill chunks and precompute their masks."""
    q_lens = np.diff(query_start)
    num_tokens = int(query_start[-1])
    decode_rows = np.flatnonzero(q_lens == 1)
    decode = None
    if len(decode_rows):
        decode = _decode_rows(
            decode_rows, query_start, seq_lens, block_tables, num_tokens, block_size, windows, device, dtype, native
        )
    prefills = []
    for r in np.flatnonzero(q_lens > 1):
        start, end = int(query_start[r]), int(query_start[r + 1])
        prefills.append(_prefill_row(start, end, int(seq_lens[r]), block_tables[r], block_size, windows, device))
    return AttentionMetadata(slot_mapping=slot_mapping, num_tokens=num_tokens, decode=decode, prefills=prefills)


def _decode_rows(
    rows, query_start, seq_lens, block_tables, num_tokens, block_size, windows, device, dtype, native
) -> DecodeRows:
    """Block ids and, per window, the keys each one-token row sees (built on the host: a few KB)."""
    lens = seq_lens[rows].astype(np.int64)
    num_keys = int(lens.max())
    nb = -(-num_keys // block_size)
    block_ids = torch.from_numpy(np.ascontiguousarray(block_tables[rows, :nb], dtype=np.int64)).to(device)
    all_in_order = len(rows) == num_tokens  # then token i is row i's, since each has exactly one
    token_idx = None if all_in_order else torch.from_numpy(query_start[rows].astype(np.int64)).to(device)
    decode = DecodeRows(token_idx=token_idx, block_ids=block_ids, num_keys=num_keys, native=native)
    firsts = {w: np.zeros_like(lens) if w is None else np.maximum(lens - w, 0) for w in windows}
    if native:
        decode.seq_lens = torch.from_numpy(lens).to(device)
        decode.first_keys = {w: torch.from_numpy(first).to(device) for w, first in firsts.items()}
        return decode
    keys = np.arange(num_keys)[None, :]
    for w, first in firsts.items():
        if (lens == num_keys).all() and not first.any():
            decode.masks[w] = None
            continue
        hidden = (keys >= lens[:, None]) | (keys < first[:, None])
        mask = np.where(hidden, -np.inf, 0.0).astype(np.float32)
        decode.masks[w] = torch.from_numpy(mask).to(device=device, dtype=dtype)[:, None, None, :]
    return decode


def _prefill_row(start, end, seq_len, block_table, block_size, windows, device) -> PrefillRow:
    """Block ids (when there is cached context) and masks for one multi-token chunk."""
    chunk = end - start
    context = seq_len - chunk
    block_ids = None
    if context > 0:
        nb = -(-seq_len // block_size)
        block_ids = torch.from_numpy(block_table[:nb].astype(np.int64)).to(device)
    masks: dict[Window, torch.Tensor | None] = {}
    for w in windows:
        if context == 0 and (w is None or w >= chunk):
            masks[w] = None  # plain causal over the chunk's own keys
            continue
        q_pos = torch.arange(context, seq_len, device=device)[:, None]
        keys = torch.arange(seq_len, device=device)[None, :]
        m = keys <= q_pos
        if w is not None:
            m &= keys > q_pos - w
        masks[w] = m
    return PrefillRow(start=start, end=end, context=context, block_ids=block_ids, masks=masks)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    meta: AttentionMetadata,
    *,
    scale: float,
    window: Window,
) -> torch.Tensor:
    """Write k, v into the cache, attend, return [T, heads * head_dim].

    q [T, heads, head_dim]; k, v [T, kv_heads, head_dim] (already rotated).
    """
    cache.write(layer, meta.slot_mapping, k, v)
    num_tokens, heads, head_dim = q.shape
    if meta.decode is not None and not meta.prefills and meta.decode.token_idx is None:
        return _attend_decode(q, cache, layer, meta.decode, scale, window).reshape(num_tokens, heads * head_dim)
    out = torch.empty(num_tokens, heads * head_dim, dtype=q.dtype, device=q.device)
    if meta.decode is not None:
        idx = meta.decode.token_idx
        out[idx] = _attend_decode(q[idx], cache, layer, meta.decode, scale, window).reshape(len(idx), -1)
    for row in meta.prefills:
        chunk = _attend_prefill(q, k, v, cache, layer, row, scale, window)
        out[row.start : row.end] = chunk.reshape(row.end - row.start, -1)
    return out


def _attend_decode(q, cache, layer, rows: DecodeRows, scale, window) -> torch.Tensor:
    """One query per row against the row's cached keys: [Rd, heads, head_dim]."""
    if rows.native:
        return cpu_kernels.paged_decode(
            q, cache.k_blocks[layer], cache.v[layer], rows.block_ids, rows.seq_lens, rows.first_keys[window], scale
        )
    k, v = cache.gather(layer, rows.block_ids)  # [Rd, nb * block_size, kv_heads, head_dim]
    n = rows.num_keys
    out = F.scaled_dot_product_attention(
        q[:, :, None, :],  # [Rd, heads, 1, head_dim]
        k[:, :n].transpose(1, 2),
        v[:, :n].transpose(1, 2),
        attn_mask=rows.masks[window],
        scale=scale,
        enable_gqa=True,
    )
    return out[:, :, 0, :]


def _attend_prefill(q, k, v, cache, layer, row: PrefillRow, scale, window) -> torch.Tensor:
    """A chunk's queries against its row's context and itself: [chunk, heads, head_dim]."""
    qr = q[row.start : row.end].transpose(0, 1)[None]  # [1, heads, chunk, head_dim]
    if row.block_ids is None:
        kr = k[row.start : row.end]
        vr = v[row.start : row.end]
    else:
        seq_len = row.context + (row.end - row.start)
        kr, vr = cache.gather(layer, row.block_ids)
        kr, vr = kr[:seq_len], vr[:seq_len]
    mask = row.masks[window]
    out = F.scaled_dot_product_attention(
        qr,
        kr.transpose(0, 1)[None],
        vr.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)

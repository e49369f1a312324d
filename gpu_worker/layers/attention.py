"""Attention over the paged KV cache for a flat batch mixing prefill chunks and decode rows.

A step's T tokens belong to R rows (the StepPlan layout). Rows with one query token (decodes, or a
one-token chunk) are served together: their K/V are gathered from their block tables, padded to the
longest, and one SDPA call runs with a length mask. Rows with several tokens (prefill chunks) run one
SDPA each; a chunk whose row already has cached context (a later chunk, or a cached prefix) reads
that context from the cache and uses a causal mask offset by it.

The per-step bookkeeping (which rows are which, block ids, masks) is built once per step by
`build_metadata` and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from metrale.gpu_worker.layers.kv_cache import PagedKVCache

Window = int | None  # sliding window in tokens (a query sees itself and the window-1 before it), or None


@dataclass(slots=True)
class DecodeRows:
    """The one-token rows of a step, attended together."""

    token_idx: torch.Tensor | None  # int64 [Rd]: their tokens in T; None when they are all of T, in order
    block_ids: torch.Tensor  # int64 [Rd, nb]: each row's first nb blocks (nb covers the longest row)
    masks: dict[Window, torch.Tensor]  # bool [Rd, 1, 1, nb * block_size]: keys the row's query may see


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

    slot_mapping: torch.Tensor  # int64 [T]
    num_tokens: int
    decode: DecodeRows | None
    prefills: list[PrefillRow] = field(default_factory=list)


def build_metadata(
    query_start: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    slot_mapping: torch.Tensor,
    *,
    block_size: int,
    windows: set[Window],
    device: torch.device,
) -> AttentionMetadata:
    """Sort the step's rows into decode rows and prefill chunks and precompute their masks."""
    q_lens = np.diff(query_start)
    num_tokens = int(query_start[-1])
    decode_rows = np.flatnonzero(q_lens == 1)
    decode = None
    if len(decode_rows):
        decode = _decode_rows(decode_rows, query_start, seq_lens, block_tables, num_tokens, block_size, windows, device)
    prefills = []
    for r in np.flatnonzero(q_lens > 1):
        start, end = int(query_start[r]), int(query_start[r + 1])
        prefills.append(_prefill_row(start, end, int(seq_lens[r]), block_tables[r], block_size, windows, device))
    return AttentionMetadata(slot_mapping=slot_mapping, num_tokens=num_tokens, decode=decode, prefills=prefills)


def _decode_rows(rows, query_start, seq_lens, block_tables, num_tokens, block_size, windows, device) -> DecodeRows:
    """Block ids and length masks for the one-token rows."""
    lens = seq_lens[rows].astype(np.int64)
    nb = -(-int(lens.max()) // block_size)
    block_ids = torch.from_numpy(block_tables[rows, :nb].astype(np.int64)).to(device)
    tokens = query_start[rows].astype(np.int64)
    all_in_order = len(rows) == num_tokens  # then token i is row i's, since each has exactly one
    token_idx = None if all_in_order else torch.from_numpy(tokens).to(device)
    lens_t = torch.from_numpy(lens).to(device)[:, None]
    keys = torch.arange(nb * block_size, device=device)[None, :]
    masks = {}
    for w in windows:
        m = keys < lens_t
        if w is not None:
            m &= keys >= lens_t - w
        masks[w] = m[:, None, None, :]
    return DecodeRows(token_idx=token_idx, block_ids=block_ids, masks=masks)


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
    k, v = cache.gather(layer, rows.block_ids)  # [Rd, L, kv_heads, head_dim]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :],  # [Rd, heads, 1, head_dim]
        k.transpose(1, 2),
        v.transpose(1, 2),
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

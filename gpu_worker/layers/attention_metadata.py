"""A step's attention bookkeeping, built once per step and shared by every layer.

A step's T tokens belong to R rows (the StepPlan layout). Rows with one query token (decodes, or a
one-token chunk) are attended together: the native CPU kernel reads their keys from their block tables
with each row's length and first visible key (`native`), the torch path gathers their blocks, padded to
the longest, and masks (`masks`); a step builds what its layers' backends read (both, when some layers
cannot use the native kernel). Rows with several tokens (prefill chunks) are attended one by one; a chunk
whose row already has cached context (a later chunk, or a cached prefix) reads that context from the
cache, with a causal mask offset by it. Masks are per sliding window (None = the whole context). A backend
that attends every chunk in one launch reading the cache in place (the Triton kernels) reads them all as one
`PrefillBatch` of per-chunk tensors instead (`varlen`), and per-row chunks are built only for backends
that read them (`rows`).

Host arrays reach the device through `put(name, array)` when the caller gives one (the runner's pinned
staging: on CUDA a copy from pageable memory would wait for the device's queue), else a plain copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from metrale.gpu_worker.layers.kv_cache import SlotIndex

Window = int | None  # sliding window in tokens (a query sees itself and the window-1 before it), or None


@dataclass(slots=True)
class DecodeRows:
    """The one-token rows of a step, attended together."""

    token_idx: torch.Tensor | None  # int64 [Rd]: their tokens in T; None when they are all of T, in order
    block_ids: torch.Tensor  # int64 [Rd, nb]: each row's first nb blocks (nb covers the longest row)
    num_keys: int  # the longest row's seq_len: keys past it are never read
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
class PrefillBatch:
    """Every multi-token chunk of a step, as tensors for one kernel launch (the chunk's K/V already written)."""

    starts: torch.Tensor  # int64 [P]: each chunk's first token in T
    q_lens: torch.Tensor  # int64 [P]
    seq_lens: torch.Tensor  # int64 [P]: context + chunk
    block_tables: torch.Tensor  # int64 [P, nb], nb covering the longest row
    num_chunks: int
    max_q_len: int


@dataclass(slots=True)
class AttentionMetadata:
    """What every layer's attention needs to know about the step."""

    slot_mapping: SlotIndex | torch.Tensor  # where each token's K/V goes (int64 [T] slots)
    num_tokens: int
    decode: DecodeRows | None
    prefills: list[PrefillRow] = field(default_factory=list)
    prefill_batch: PrefillBatch | None = None  # the chunks at once (varlen backends)


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
    masks: bool | None = None,
    varlen: bool = False,
    rows: bool = True,
    put: Callable[[str, np.ndarray], torch.Tensor] | None = None,
) -> AttentionMetadata:
    """Sort the step's rows into decode rows and prefill chunks and precompute what their attention reads:
    native, the decode rows' lengths (the native and Triton kernels); masks (default: not native), the torch
    path's masks; varlen, the chunks as one PrefillBatch; rows, the chunks one by one."""
    if masks is None:
        masks = not native
    if put is None:
        put = lambda name, a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)  # noqa: E731
    q_lens = np.diff(query_start)
    num_tokens = int(query_start[-1])
    decode_rows = np.flatnonzero(q_lens == 1)
    decode = None
    if len(decode_rows):
        decode = _decode_rows(
            decode_rows, query_start, seq_lens, block_tables, num_tokens, block_size, windows, device, dtype, native, masks, put
        )
    chunks = np.flatnonzero(q_lens > 1)
    prefills = []
    if rows:
        for r in chunks:
            start, end = int(query_start[r]), int(query_start[r + 1])
            prefills.append(_prefill_row(start, end, int(seq_lens[r]), block_tables[r], block_size, windows, device))
    batch = _prefill_batch(chunks, query_start, q_lens, seq_lens, block_tables, block_size, put) if varlen and len(chunks) else None
    return AttentionMetadata(slot_mapping=slot_mapping, num_tokens=num_tokens, decode=decode, prefills=prefills, prefill_batch=batch)


def _prefill_batch(chunks, query_start, q_lens, seq_lens, block_tables, block_size, put) -> PrefillBatch:
    """The chunks' starts, lengths and block tables as tensors for one launch."""
    lens = seq_lens[chunks]
    nb = -(-int(lens.max()) // block_size)
    return PrefillBatch(
        starts=put("prefill_starts", query_start[chunks]),
        q_lens=put("prefill_q_lens", q_lens[chunks]),
        seq_lens=put("prefill_seq_lens", lens),
        block_tables=put("prefill_blocks", block_tables[chunks, :nb].reshape(-1)).view(len(chunks), nb),
        num_chunks=len(chunks),
        max_q_len=int(q_lens[chunks].max()),
    )


def _decode_rows(
    rows, query_start, seq_lens, block_tables, num_tokens, block_size, windows, device, dtype, native, masks, put
) -> DecodeRows:
    """Block ids and, per window, the keys each one-token row sees (built on the host: a few KB)."""
    lens = seq_lens[rows].astype(np.int64)
    num_keys = int(lens.max())
    nb = -(-num_keys // block_size)
    block_ids = put("decode_blocks", block_tables[rows, :nb].reshape(-1)).view(len(rows), nb)
    all_in_order = len(rows) == num_tokens  # then token i is row i's, since each has exactly one
    token_idx = None if all_in_order else put("decode_tokens", query_start[rows])
    decode = DecodeRows(token_idx=token_idx, block_ids=block_ids, num_keys=num_keys)
    firsts = {w: np.zeros_like(lens) if w is None else np.maximum(lens - w, 0) for w in windows}
    if native:
        decode.seq_lens = put("decode_seq_lens", lens)
        decode.first_keys = {w: put(f"decode_first_keys_{w}", first) for w, first in firsts.items()}
    if not masks:
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

"""Turns a scheduled step (sequences, token counts, masks) into a StepPlan in reused numpy buffers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from metrale.ipc.plan import FEED_HOST, StepPlan

from .pipeline import RowMask
from .sequence import Sequence
from .swap import SwapSpace

MAX_BAN_IDS = 64


@dataclass(slots=True)
class _Buffers:
    """One set of step arrays at full capacity; a plan is views of their first T / R entries."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray  # flat; viewed as [R, B]
    sample: np.ndarray
    feed_from_row: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    repetition_penalty: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    seeds: np.ndarray
    mask_kind: np.ndarray
    force_token: np.ndarray
    ban_ids: np.ndarray
    num_logprobs: np.ndarray
    hist_tokens: np.ndarray
    hist_start: np.ndarray
    hist_prompt_len: np.ndarray

    @classmethod
    def allocate(cls, max_tokens: int, max_rows: int, max_blocks: int, max_hist: int) -> "_Buffers":
        i32 = np.int32
        return cls(
            input_ids=np.zeros(max_tokens, i32),
            positions=np.zeros(max_tokens, i32),
            slot_mapping=np.zeros(max_tokens, np.int64),
            query_start=np.zeros(max_rows + 1, i32),
            seq_lens=np.zeros(max_rows, i32),
            block_tables=np.zeros(max_rows * max_blocks, i32),
            sample=np.zeros(max_rows, np.bool_),
            feed_from_row=np.zeros(max_rows, i32),
            temperature=np.zeros(max_rows, np.float32),
            top_k=np.zeros(max_rows, i32),
            top_p=np.zeros(max_rows, np.float32),
            min_p=np.zeros(max_rows, np.float32),
            repetition_penalty=np.zeros(max_rows, np.float32),
            presence_penalty=np.zeros(max_rows, np.float32),
            frequency_penalty=np.zeros(max_rows, np.float32),
            seeds=np.zeros(max_rows, np.int64),
            mask_kind=np.zeros(max_rows, np.uint8),
            force_token=np.zeros(max_rows, i32),
            ban_ids=np.zeros((max_rows, MAX_BAN_IDS), i32),
            num_logprobs=np.zeros(max_rows, i32),
            hist_tokens=np.zeros(max_hist, i32),
            hist_start=np.zeros(max_rows + 1, i32),
            hist_prompt_len=np.zeros(max_rows, i32),
        )


class StepBuilder:
    """Builds StepPlans. Keeps a few buffer sets in rotation: a plan stays intact while later ones are built
    (a device may read a launched plan while the next is launched ahead of it)."""

    def __init__(
        self, *, max_tokens: int, max_rows: int, max_model_len: int, block_size: int, swap: SwapSpace | None = None, depth: int = 3
    ):
        self.block_size = block_size
        self.swap = swap or SwapSpace(0)
        self.max_blocks = -(-max_model_len // block_size) + 1
        self.max_tokens = max_tokens
        self.max_rows = max_rows
        self._hist_cap = max(4096, max_tokens)
        self._sets = [
            _Buffers.allocate(max_tokens, max_rows, self.max_blocks, self._hist_cap) for _ in range(depth)
        ]
        self._turn = 0

    def build(self, seqs: list[Sequence], num_new: list[int], masks: list[RowMask], *, fed: bool = False) -> StepPlan:
        """A plan running num_new[r] tokens of seqs[r] from its num_computed.

        fed=True: a step launched ahead, every row a decode whose input is the previous step's
        output of the same row, written at position num_computed (its launch bookkeeping comes later).
        """
        b = self._sets[self._turn]
        self._turn = (self._turn + 1) % len(self._sets)
        R = len(seqs)
        T = sum(num_new)
        assert R <= self.max_rows and T <= self.max_tokens, "step larger than the builder's capacity"
        width = max(1, max(-(-(s.num_computed + k) // self.block_size) for s, k in zip(seqs, num_new)))
        tables = b.block_tables[: R * width].reshape(R, width)
        tables.fill(0)
        hist_need = sum(s.num_tokens for s in seqs if s.params.has_penalties)
        if hist_need > len(b.hist_tokens):  # rare: grow, and keep the larger size from now on
            b.hist_tokens = np.zeros(hist_need * 2, np.int32)
        bs = self.block_size
        b.ban_ids[:R] = -1
        floats, ints, seq_lens, samples, kinds, forces = [], [], [], [], [], []
        t = h = 0
        b.hist_start[0] = 0
        for r, (seq, k, mask) in enumerate(zip(seqs, num_new, masks)):
            start = seq.num_computed
            bt = seq.block_table
            tables[r, : len(bt)] = bt
            if k == 1:  # a decode: scalars, no temporary arrays
                b.positions[t] = start
                b.slot_mapping[t] = bt[start // bs] * bs + start % bs
                b.input_ids[t] = 0 if fed else seq.tokens[start]
            else:
                pos = np.arange(start, start + k, dtype=np.int32)
                b.positions[t : t + k] = pos
                b.slot_mapping[t : t + k] = tables[r, pos // bs].astype(np.int64) * bs + pos % bs
                b.input_ids[t : t + k] = seq.tokens[start : start + k]
            t += k
            seq_lens.append(start + k)
            samples.append(fed or start + k == seq.num_tokens)
            if not seq.sampling_row:
                seq.sampling_row = sampling_row(seq)
            floats.append(seq.sampling_row[0])
            ints.append(seq.sampling_row[1])
            kinds.append(mask.kind)
            forces.append(mask.force_token)
            if mask.ban:
                ban = mask.ban[:MAX_BAN_IDS]
                b.ban_ids[r, : len(ban)] = ban
            if seq.params.has_penalties:
                n = seq.num_tokens
                b.hist_tokens[h : h + n] = seq.tokens
                b.hist_prompt_len[r] = seq.num_prompt
                h += n
            else:
                b.hist_prompt_len[r] = 0
            b.hist_start[r + 1] = h
        b.query_start[0] = 0
        np.cumsum(num_new, out=b.query_start[1 : R + 1])
        b.seq_lens[:R] = seq_lens
        b.sample[:R] = samples
        b.feed_from_row[:R] = np.arange(R) if fed else FEED_HOST
        f = np.array(floats, dtype=np.float32).reshape(R, 6)
        i = np.array(ints, dtype=np.int64).reshape(R, 3)
        b.temperature[:R], b.top_p[:R], b.min_p[:R] = f[:, 0], f[:, 1], f[:, 2]
        b.repetition_penalty[:R], b.presence_penalty[:R], b.frequency_penalty[:R] = f[:, 3], f[:, 4], f[:, 5]
        b.top_k[:R], b.seeds[:R], b.num_logprobs[:R] = i[:, 0], i[:, 1], i[:, 2]
        b.mask_kind[:R] = kinds
        b.force_token[:R] = forces
        swap_out, swap_in = self.swap.take_copies()
        return StepPlan(
            input_ids=b.input_ids[:T],
            positions=b.positions[:T],
            slot_mapping=b.slot_mapping[:T],
            query_start=b.query_start[: R + 1],
            seq_lens=b.seq_lens[:R],
            block_tables=tables,
            sample=b.sample[:R],
            feed_from_row=b.feed_from_row[:R],
            temperature=b.temperature[:R],
            top_k=b.top_k[:R],
            top_p=b.top_p[:R],
            min_p=b.min_p[:R],
            repetition_penalty=b.repetition_penalty[:R],
            presence_penalty=b.presence_penalty[:R],
            frequency_penalty=b.frequency_penalty[:R],
            seeds=b.seeds[:R],
            mask_kind=b.mask_kind[:R],
            force_token=b.force_token[:R],
            ban_ids=b.ban_ids[:R],
            num_logprobs=b.num_logprobs[:R],
            hist_tokens=b.hist_tokens[:h],
            hist_start=b.hist_start[: R + 1],
            hist_prompt_len=b.hist_prompt_len[:R],
            swap_out=swap_out,
            swap_in=swap_in,
        )



def sampling_row(seq: Sequence) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """A sequence's per-row sampling values, as the builder lays them out (computed once per sequence)."""
    p = seq.params
    floats = (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
    ints = (p.top_k if p.top_k > 0 else 0, seq.seed, -1 if p.logprobs is None else p.logprobs)
    return floats, ints

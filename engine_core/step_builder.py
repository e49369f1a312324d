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
        t = h = 0
        b.query_start[0] = b.hist_start[0] = 0
        for r, (seq, k, mask) in enumerate(zip(seqs, num_new, masks)):
            start = seq.num_computed
            bt = seq.block_table
            tables[r, : len(bt)] = bt
            pos = np.arange(start, start + k, dtype=np.int32)
            b.positions[t : t + k] = pos
            b.slot_mapping[t : t + k] = tables[r, pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size
            if fed:
                b.input_ids[t] = 0
                b.feed_from_row[r] = r
            else:
                b.input_ids[t : t + k] = seq.tokens[start : start + k]
                b.feed_from_row[r] = FEED_HOST
            t += k
            b.query_start[r + 1] = t
            b.seq_lens[r] = start + k
            b.sample[r] = fed or start + k == seq.num_tokens
            self._fill_sampling(b, r, seq, mask)
            if seq.params.has_penalties:
                n = seq.num_tokens
                b.hist_tokens[h : h + n] = seq.tokens
                b.hist_prompt_len[r] = seq.num_prompt
                h += n
            else:
                b.hist_prompt_len[r] = 0
            b.hist_start[r + 1] = h
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

    @staticmethod
    def _fill_sampling(b: _Buffers, r: int, seq: Sequence, mask: RowMask) -> None:
        """Copy a row's sampling parameters and mask into the step arrays."""
        p = seq.params
        b.temperature[r] = p.temperature
        b.top_k[r] = p.top_k if p.top_k > 0 else 0
        b.top_p[r] = p.top_p
        b.min_p[r] = p.min_p
        b.repetition_penalty[r] = p.repetition_penalty
        b.presence_penalty[r] = p.presence_penalty
        b.frequency_penalty[r] = p.frequency_penalty
        b.seeds[r] = seq.seed
        b.mask_kind[r] = mask.kind
        b.force_token[r] = mask.force_token
        ban = mask.ban[:MAX_BAN_IDS]
        b.ban_ids[r, : len(ban)] = ban
        b.ban_ids[r, len(ban) :] = -1
        b.num_logprobs[r] = -1 if p.logprobs is None else p.logprobs

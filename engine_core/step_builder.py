"""Turns a scheduled step (sequences, token counts, masks) into a StepPlan in reused numpy buffers.

Most of a plan's cost is converting Python ints to numpy: a decode step at 32 rows carries ~1,000 block
table entries that change once every block_size tokens. So each sequence's block table and sampling values
live in a numpy mirror (converted when they change), and a plan gathers its rows from it with a few
`take`s; a step whose rows are all decodes computes its token arrays with whole-batch numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import add

import numpy as np

from metrale.ipc.plan import FEED_HOST, MASK_GRAMMAR, POOL_NONE, StepPlan

from .grammar import fill_bitmasks
from .pipeline import NO_MASK, RowMask
from .sequence import Sequence
from .swap import SwapSpace

MAX_BAN_IDS = 64
_NO_STATE = np.zeros(0, np.int32)  # the plans of a model without recurrent state carry no state slots
_NUM_FLOATS = 6  # temperature, top_p, min_p, repetition, presence, frequency penalty (sampling_row[0])


@dataclass(slots=True)
class _Buffers:
    """One set of step arrays at full capacity; a plan is views of their first T / R entries.

    The float sampling fields are the rows of one [6, R] array and top_k / num_logprobs of one [2, R]
    array, so one gather from the mirror fills them all.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray  # flat; viewed as [R, B]
    sample: np.ndarray
    feed_from_row: np.ndarray
    floats: np.ndarray  # [6, max_rows]: the rows below
    temperature: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    repetition_penalty: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    int32s: np.ndarray  # [2, max_rows]: top_k, num_logprobs
    top_k: np.ndarray
    num_logprobs: np.ndarray
    seeds: np.ndarray
    mask_kind: np.ndarray
    force_token: np.ndarray
    ban_ids: np.ndarray
    hist_tokens: np.ndarray
    hist_start: np.ndarray
    hist_prompt_len: np.ndarray
    grammar_bitmask: np.ndarray  # [max_rows, W]: the grammar rows' bitmasks, first rows first
    num_drafts: np.ndarray
    state_slots: np.ndarray
    bias_start: np.ndarray
    bias_ids: np.ndarray  # grown when a step's logit_bias entries exceed it
    bias_values: np.ndarray
    prompt_lp: np.ndarray  # [3, max_rows]: prompt_lp_n, prompt_lp_count, prompt_lp_next
    pool: np.ndarray
    lora_slots: np.ndarray

    @classmethod
    def allocate(cls, max_tokens: int, max_rows: int, max_blocks: int, max_hist: int, words: int) -> "_Buffers":
        i32 = np.int32
        floats = np.zeros((_NUM_FLOATS, max_rows), np.float32)
        int32s = np.zeros((2, max_rows), i32)
        return cls(
            input_ids=np.zeros(max_tokens, i32),
            positions=np.zeros(max_tokens, i32),
            slot_mapping=np.zeros(max_tokens, np.int64),
            query_start=np.zeros(max_rows + 1, i32),
            seq_lens=np.zeros(max_rows, i32),
            block_tables=np.zeros(max_rows * max_blocks, i32),
            sample=np.zeros(max_rows, np.bool_),
            feed_from_row=np.zeros(max_rows, i32),
            floats=floats,
            temperature=floats[0],
            top_p=floats[1],
            min_p=floats[2],
            repetition_penalty=floats[3],
            presence_penalty=floats[4],
            frequency_penalty=floats[5],
            int32s=int32s,
            top_k=int32s[0],
            num_logprobs=int32s[1],
            seeds=np.zeros(max_rows, np.int64),
            mask_kind=np.zeros(max_rows, np.uint8),
            force_token=np.zeros(max_rows, i32),
            ban_ids=np.zeros((max_rows, MAX_BAN_IDS), i32),
            hist_tokens=np.zeros(max_hist, i32),
            hist_start=np.zeros(max_rows + 1, i32),
            hist_prompt_len=np.zeros(max_rows, i32),
            grammar_bitmask=np.zeros((max_rows, words), i32),
            num_drafts=np.zeros(max_rows, i32),
            state_slots=np.zeros(max_rows, i32),
            bias_start=np.zeros(max_rows + 1, i32),
            bias_ids=np.zeros(1024, i32),
            bias_values=np.zeros(1024, np.float32),
            prompt_lp=np.zeros((3, max_rows), i32),
            pool=np.zeros(max_rows, i32),
            lora_slots=np.zeros(max_rows, i32),
        )


@dataclass(slots=True)
class _Entry:
    """A sequence's row in the mirror, the block table that row holds now, and (for a penalised row) its
    token history as numpy, extended by the tokens committed since the last plan."""

    row: int
    table: list[int]
    hist: np.ndarray | None = None
    hist_len: int = 0
    bias: tuple[np.ndarray, np.ndarray] | None = None  # logit_bias as (int32 ids, float32 values); None: none

    def history(self, seq: Sequence) -> np.ndarray:
        """seq's tokens as int32, converting only those added since the last call (tokens only grow)."""
        n = seq.num_tokens
        if self.hist is None or len(self.hist) < n:
            grown = np.empty(max(2 * n, 256), np.int32)
            if self.hist is not None:
                grown[: self.hist_len] = self.hist[: self.hist_len]
            self.hist = grown
        if n > self.hist_len:
            self.hist[self.hist_len : n] = seq.tokens[self.hist_len : n]
            self.hist_len = n
        return self.hist[:n]


class _Mirror:
    """Numpy copies of recent sequences' block tables and sampling values, one row per sequence.

    A table row is rewritten only when the sequence's block_table differs from the copy it was made
    from (compared as lists: appends, rollbacks, frees and swaps all show); sampling values are written
    once, when a sequence gets its row — like Sequence.sampling_row, they assume params never change.
    Capacity is twice the rows of a step: when it runs out, the rows of sequences absent from the step
    being built are reclaimed (finished sequences are held at most until then).
    """

    def __init__(self, capacity: int, max_blocks: int):
        self.tables = np.zeros((capacity, max_blocks), np.int32)
        self.floats = np.zeros((_NUM_FLOATS, capacity), np.float32)
        self.int32s = np.zeros((2, capacity), np.int32)  # top_k, num_logprobs
        self.seeds = np.zeros(capacity, np.int64)
        self.penalties = np.zeros(capacity, np.bool_)
        self.biased = np.zeros(capacity, np.bool_)
        self.prompt_lp = np.full(capacity, -1, np.int32)  # prompt_logprobs asked (-1: none)
        self.pool = np.zeros(capacity, np.int32)  # an embeddings request's POOL_* (0: a generating request)
        self.lora = np.full(capacity, -1, np.int32)  # the request's LoRA slot (-1: the base model)
        self._entries: dict[Sequence, _Entry] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def entry(self, seq: Sequence) -> _Entry:
        """seq's entry (rows() has given it one this step)."""
        return self._entries[seq]

    def rows(self, seqs: list[Sequence]) -> np.ndarray:
        """Each sequence's mirror row (intp[R]), its block table brought up to date."""
        entries = self._entries
        out = []
        for seq in seqs:
            e = entries.get(seq)
            if e is None:
                e = self._admit(seq, seqs)
            if e.table != seq.block_table:
                self._write_table(e, seq.block_table)
            out.append(e.row)
        return np.array(out, np.intp)

    def _admit(self, seq: Sequence, step: list[Sequence]) -> _Entry:
        """Give a sequence a row and write its sampling values; reclaim absent sequences' rows when full."""
        if not self._free:
            live = set(step)
            for gone in [s for s in self._entries if s not in live]:
                e = self._entries.pop(gone)
                self._free.append(e.row)
                self.tables[e.row, : len(e.table)] = 0
        e = _Entry(self._free.pop(), [])
        self._entries[seq] = e
        if not seq.sampling_row:
            seq.sampling_row = sampling_row(seq)
        floats, ints = seq.sampling_row
        # Through float32 / int64 arrays first, as the per-step conversion did, so rounding and casts match.
        self.floats[:, e.row] = np.array(floats, dtype=np.float32)
        top_k, seed, num_logprobs = np.array(ints, dtype=np.int64)
        self.int32s[:, e.row] = top_k, num_logprobs
        self.seeds[e.row] = seed
        self.penalties[e.row] = seq.params.has_penalties
        self.prompt_lp[e.row] = -1 if seq.params.prompt_logprobs is None else seq.params.prompt_logprobs
        self.pool[e.row] = seq.pool_kind
        self.lora[e.row] = seq.lora_slot
        bias = seq.params.logit_bias
        self.biased[e.row] = bool(bias)
        if bias:
            e.bias = np.fromiter(bias.keys(), np.int32, len(bias)), np.fromiter(bias.values(), np.float32, len(bias))
        return e

    def _write_table(self, e: _Entry, table: list[int]) -> None:
        """Rewrite a row's block table from the sequence's list."""
        row = self.tables[e.row]
        row[len(table) : len(e.table)] = 0
        row[: len(table)] = table
        e.table = list(table)


class StepBuilder:
    """Builds StepPlans. Keeps a few buffer sets in rotation: a plan stays intact while later ones are built
    (a device may read a launched plan while the next is launched ahead of it)."""

    def __init__(
        self, *, max_tokens: int, max_rows: int, max_model_len: int, block_size: int, swap: SwapSpace | None = None, depth: int = 3,
        vocab_size: int = 0, state_slots: bool = False,
    ):
        """vocab_size: the model's, for grammar rows' bitmasks (0: a builder that never meets one); state_slots:
        the model keeps recurrent state, so every plan carries each row's state slot."""
        self.block_size = block_size
        self.state_slots = state_slots
        self.swap = swap or SwapSpace(0)
        self.max_blocks = -(-max_model_len // block_size) + 1
        self.max_tokens = max_tokens
        self.max_rows = max_rows
        self._hist_cap = max(4096, max_tokens)
        self._sets = [
            _Buffers.allocate(max_tokens, max_rows, self.max_blocks, self._hist_cap, -(-vocab_size // 32)) for _ in range(depth)
        ]
        self._turn = 0
        self._mirror = _Mirror(2 * max_rows, self.max_blocks)
        self._arange = np.arange(max_rows + 1, dtype=np.int32)

    def build(
        self, seqs: list[Sequence], num_new: list[int], masks: list[RowMask], *, feed: list[int] | None = None,
        lookahead: int = 0, drafts: list[list[int]] | None = None,
    ) -> StepPlan:
        """A plan running num_new[r] tokens of seqs[r] from its num_launched (behind the step in flight, if any).

        feed: per row FEED_HOST, or the row of the previous step whose sampled token is this row's input (a row
        launched ahead: one token written at position num_launched, which always samples). None: every row
        host-fed.
        lookahead: the block tables also cover that many positions past the step's (a decode burst's).
        drafts: per row, draft tokens that follow its committed ones (a verify step, engine_core/speculative.py):
        the row runs its last token and its drafts (num_new = 1 + len(drafts)) and samples at each.
        """
        b = self._sets[self._turn]
        self._turn = (self._turn + 1) % len(self._sets)
        R = len(seqs)
        T = sum(num_new)
        assert R <= self.max_rows and T <= self.max_tokens, "step larger than the builder's capacity"
        starts = [s.num_launched for s in seqs]
        width = max(1, -(-(max(map(add, starts, num_new)) + lookahead) // self.block_size))
        rows = self._mirror.rows(seqs)
        tables = b.block_tables[: R * width].reshape(R, width)
        tables[...] = self._mirror.tables[rows, :width]
        if num_new.count(1) == R:
            self._decode_tokens(b, seqs, starts, rows, feed)
        else:
            self._mixed_tokens(b, seqs, starts, num_new, tables, feed, drafts)
        g = self._sampling(b, seqs, rows, masks)
        if drafts is not None:
            b.num_drafts[:R] = [len(d) for d in drafts]
        h = self._history(b, seqs, rows, feed)
        n_bias = self._bias(b, seqs, rows)
        prompt_lp = self._prompt_logprobs(b, seqs, rows, starts, num_new, feed)
        pool = self._pool(b, rows)
        swap_out, swap_in = self.swap.take_copies()
        state_slots = _NO_STATE
        if self.state_slots:  # state slot (recurrent models)
            state_slots = b.state_slots[:R]
            state_slots[:] = [s.state_slot for s in seqs]
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
            grammar_bitmask=b.grammar_bitmask[:g] if g else b.grammar_bitmask[:0, :0],
            num_drafts=b.num_drafts[:R],
            state_slots=state_slots,
            bias_start=b.bias_start[: R + 1],
            bias_ids=b.bias_ids[:n_bias],
            bias_values=b.bias_values[:n_bias],
            prompt_lp_n=prompt_lp[0],
            prompt_lp_count=prompt_lp[1],
            prompt_lp_next=prompt_lp[2],
            pool=pool,
            lora_slots=self._mirror.lora.take(rows, out=b.lora_slots[:R]),
        )

    def _decode_tokens(self, b: _Buffers, seqs: list[Sequence], starts: list[int], rows: np.ndarray,
                       feed: list[int] | None) -> None:
        """Token and per-row arrays of a step whose every row runs one token, with whole-batch numpy."""
        R, bs = len(seqs), self.block_size
        pos = b.positions[:R]
        pos[:] = starts
        slots = b.slot_mapping[:R]
        np.multiply(self._mirror.tables[rows, pos // bs], bs, out=slots, dtype=np.int64)
        slots += pos % bs
        np.add(pos, 1, out=b.seq_lens[:R])
        b.query_start[: R + 1] = self._arange[: R + 1]
        if feed is None:
            b.input_ids[:R] = [s.tokens[n] for s, n in zip(seqs, starts)]
            b.sample[:R] = [n + 1 == len(s.tokens) for s, n in zip(seqs, starts)]
            b.feed_from_row[:R] = FEED_HOST
            return
        # A fed row's input is the device's (0 here) and it samples; a host-fed row's input was committed.
        b.input_ids[:R] = [0 if src != FEED_HOST else s.tokens[n] for s, n, src in zip(seqs, starts, feed)]
        b.sample[:R] = [src != FEED_HOST or n + 1 == len(s.tokens) for s, n, src in zip(seqs, starts, feed)]
        b.feed_from_row[:R] = feed

    def _mixed_tokens(
        self, b: _Buffers, seqs: list[Sequence], starts: list[int], num_new: list[int], tables: np.ndarray,
        feed: list[int] | None, drafts: list[list[int]] | None = None,
    ) -> None:
        """Token and per-row arrays of a step with prefill chunks (or drafts), row by row."""
        R, bs = len(seqs), self.block_size
        feed = feed or [FEED_HOST] * R
        extra = [len(d) for d in drafts] if drafts is not None else [0] * R  # tokens past the committed ones
        t = 0
        for r, (seq, start, k) in enumerate(zip(seqs, starts, num_new)):
            if k == 1:  # a decode: scalars, no temporary arrays
                b.positions[t] = start
                b.slot_mapping[t] = seq.block_table[start // bs] * bs + start % bs
                b.input_ids[t] = 0 if feed[r] != FEED_HOST else seq.tokens[start]
            else:
                pos = np.arange(start, start + k, dtype=np.int32)
                b.positions[t : t + k] = pos
                b.slot_mapping[t : t + k] = tables[r, pos // bs].astype(np.int64) * bs + pos % bs
                b.input_ids[t : t + k] = seq.tokens[start : start + k] + (drafts[r] if extra[r] else [])
            t += k
        b.seq_lens[:R] = ends = list(map(add, starts, num_new))
        b.sample[:R] = [src != FEED_HOST or end - x == len(s.tokens) for s, end, src, x in zip(seqs, ends, feed, extra)]
        b.query_start[0] = 0
        np.cumsum(num_new, out=b.query_start[1 : R + 1])
        b.feed_from_row[:R] = feed

    def _sampling(self, b: _Buffers, seqs: list[Sequence], rows: np.ndarray, masks: list[RowMask]) -> int:
        """Each row's sampling values (from the mirror) and mask; returns the grammar rows (their bitmasks filled)."""
        R, m = len(rows), self._mirror
        m.floats.take(rows, axis=1, out=b.floats[:, :R])
        m.int32s.take(rows, axis=1, out=b.int32s[:, :R])
        m.seeds.take(rows, out=b.seeds[:R])
        b.ban_ids[:R] = -1
        b.num_drafts[:R] = 0
        if masks.count(NO_MASK) == R:  # the usual step: no row constrained
            b.mask_kind[:R] = NO_MASK.kind
            b.force_token[:R] = NO_MASK.force_token
            return 0
        kinds = [mask.kind for mask in masks]
        b.mask_kind[:R] = kinds
        b.force_token[:R] = [mask.force_token for mask in masks]
        for r, mask in enumerate(masks):
            if mask.ban:
                ban = mask.ban[:MAX_BAN_IDS]
                b.ban_ids[r, : len(ban)] = ban
        if not any(kind & MASK_GRAMMAR for kind in kinds):
            return 0
        return fill_bitmasks(seqs, kinds, b.grammar_bitmask)

    def _history(self, b: _Buffers, seqs: list[Sequence], rows: np.ndarray, feed: list[int] | None) -> int:
        """Token histories of the rows with penalties; returns their total length.

        A penalised row fed from the step in flight ends its history with a slot (-1) for the token it is fed,
        which the host has not committed yet: the device writes that token there before it samples, so the
        row's penalties count it as a plain step's would (and a device that did not would skip the -1)."""
        R = len(seqs)
        pen = self._mirror.penalties[rows]
        if not pen.any():
            b.hist_start[: R + 1] = 0
            b.hist_prompt_len[:R] = 0
            return 0
        fed = [False] * R if feed is None else [src != FEED_HOST for src in feed]
        need = sum(s.num_tokens + f for s, p, f in zip(seqs, pen, fed) if p)
        if need > len(b.hist_tokens):  # rare: grow, and keep the larger size from now on
            b.hist_tokens = np.zeros(need * 2, np.int32)
        h = 0
        b.hist_start[0] = 0
        for r, (seq, p) in enumerate(zip(seqs, pen)):
            if p:
                n = seq.num_tokens
                b.hist_tokens[h : h + n] = self._mirror.entry(seq).history(seq)  # a copy in C, no per-token Python
                b.hist_prompt_len[r] = seq.num_prompt
                h += n
                if fed[r]:
                    b.hist_tokens[h] = -1
                    h += 1
            else:
                b.hist_prompt_len[r] = 0
            b.hist_start[r + 1] = h
        return h


    def _prompt_logprobs(self, b: _Buffers, seqs: list[Sequence], rows: np.ndarray, starts: list[int],
                         num_new: list[int], feed: list[int] | None) -> np.ndarray:
        """[3, R] prompt_lp_n, prompt_lp_count, prompt_lp_next: a host-fed row of a request with prompt_logprobs
        asks for its positions up to the prompt's second-to-last (the last predicts the output) while any of the
        prompt tokens they predict has no entry yet (a recompute after preemption asks again only past those)."""
        R = len(seqs)
        out = b.prompt_lp[:, :R]
        out[0], out[1], out[2] = -1, 0, -1
        for r in np.flatnonzero(self._mirror.prompt_lp[rows] >= 0):
            seq, start, k = seqs[r], starts[r], num_new[r]
            count = min(start + k, seq.num_prompt - 1) - start
            if count <= 0 or start + count < len(seq.prompt_entries) or (feed is not None and feed[r] != FEED_HOST):
                continue
            out[0, r], out[1, r] = seq.params.prompt_logprobs, count
            out[2, r] = seq.tokens[start + k] if count == k else -1
        return out

    def _pool(self, b: _Buffers, rows: np.ndarray) -> np.ndarray:
        """int32[R] POOL_* per row: an embeddings request's row never samples, and every chunk of it pools (the
        commit keeps what its kind needs: the sum, the last chunk's, the first chunk's)."""
        R = len(rows)
        out = b.pool[:R]
        self._mirror.pool.take(rows, out=out)
        if out.any():
            b.sample[:R][out != POOL_NONE] = False
        return out

    def _bias(self, b: _Buffers, seqs: list[Sequence], rows: np.ndarray) -> int:
        """The biased rows' logit_bias, end to end; returns the entries' count (0: no row biased)."""
        R = len(seqs)
        biased = self._mirror.biased[rows]
        b.bias_start[: R + 1] = 0
        if not biased.any():
            return 0
        entries = [self._mirror.entry(seq).bias if p else None for seq, p in zip(seqs, biased)]
        need = sum(len(e[0]) for e in entries if e is not None)
        if need > len(b.bias_ids):  # rare: grow, and keep the larger size from now on
            b.bias_ids, b.bias_values = np.zeros(need * 2, np.int32), np.zeros(need * 2, np.float32)
        n = 0
        for r, e in enumerate(entries):
            if e is not None:
                ids, values = e
                b.bias_ids[n : n + len(ids)] = ids
                b.bias_values[n : n + len(ids)] = values
                n += len(ids)
            b.bias_start[r + 1] = n
        return n


def sampling_row(seq: Sequence) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """A sequence's per-row sampling values, as the builder lays them out (computed once per sequence)."""
    p = seq.params
    floats = (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
    ints = (p.top_k if p.top_k > 0 else 0, seq.seed, -1 if p.logprobs is None else p.logprobs)
    return floats, ints

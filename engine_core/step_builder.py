"""Turns a scheduled step (sequences, token counts, masks) into a StepPlan in reused numpy buffers.

Most of a plan's cost would be converting Python ints to numpy. So each sequence's block table is a row of the
block pool's numpy table (its only copy, written in place as blocks come and go), its sampling values sit in the
same row of numpy arrays here (written once), its tokens are an int32 array numpy reads without a copy, and a plan
gathers its rows with a few `take`s; a step whose rows are all decodes computes its token arrays with whole-batch
numpy.
"""

from __future__ import annotations

from operator import add, is_

import numpy as np

from metrale.ipc.plan import FEED_HOST, MASK_GRAMMAR, POOL_NONE, StepPlan, pack_bitmask
from metrale.ipc.ticket_layout import PLAN_FIELDS

from .grammar import fill_bitmasks
from .kv_blocks import KvBlockPool
from .pipeline import NO_MASK, RowMask
from .sequence import Sequence
from .swap import SwapSpace

MAX_BAN_IDS = 64
_FED_SLOT = np.array([-1], np.int32).tobytes()  # a fed penalised row's last history entry (_history)
_NO_STATE = np.zeros(0, np.int32)  # the plans of a model without recurrent state carry no state slots
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BY_LENGTH = [(name, kind) for name, _, kind in PLAN_FIELDS if kind in ("T", "R", "R1")]  # plain views of a buffer


class _Buffers:
    """One set of plan arrays at full capacity, as ipc's PLAN_FIELDS lays a plan out; a plan is views of their first
    T / R entries. The float sampling fields are the rows of one [6, R] array, top_k / num_logprobs of one [2, R] and
    the prompt logprob fields of one [3, R], so one gather (or one write) fills each group."""

    GROUPS = {"floats": FLOAT_FIELDS, "int32s": ("top_k", "num_logprobs"),
              "prompt_lp": ("prompt_lp_n", "prompt_lp_count", "prompt_lp_next")}

    def __init__(self, max_tokens: int, max_rows: int, max_blocks: int, max_hist: int, words: int) -> None:
        shape = {"T": max_tokens, "R": max_rows, "R1": max_rows + 1, "RB": max_rows * max_blocks,  # RB: flat
                 "RK": (max_rows, MAX_BAN_IDS), "H": max_hist, "GW": (max_rows, words), "S": max_rows, "BI": 1024,
                 "PI": 1024}
        dtypes = {name: dtype for name, dtype, _ in PLAN_FIELDS}
        for group, names in self.GROUPS.items():
            rows = np.zeros((len(names), max_rows), dtypes[names[0]])
            setattr(self, group, rows)
            for name, row in zip(names, rows):
                setattr(self, name, row)
        for name, dtype, kind in PLAN_FIELDS:
            if kind in shape and not hasattr(self, name):
                setattr(self, name, np.zeros(shape[kind], dtype))


class _Rows:
    """The sampling values of each row of the block pool's table (a sequence's row in the batch), as numpy, written
    once when a sequence is first built in that row (its params never change), so a plan gathers them with a few
    `take`s; grown with the pool's table."""

    def __init__(self, vocab_size: int = 0) -> None:
        self.vocab_size = vocab_size
        self.owner: list[Sequence | None] = []
        self.floats = np.zeros((len(FLOAT_FIELDS), 0), np.float32)
        self.int32s = np.zeros((2, 0), np.int32)  # top_k, num_logprobs
        self.seeds = np.zeros(0, np.int64)
        self.penalties = np.zeros(0, np.bool_)
        self.prompt_lp = np.zeros(0, np.int32)  # prompt_logprobs asked (-1: none)
        self.pool = np.zeros(0, np.int32)  # an embeddings request's POOL_* (0: a generating request)
        self.lora = np.zeros(0, np.int32)  # the request's LoRA slot (-1: the base model)
        self.bias: list[tuple[np.ndarray, np.ndarray] | None] = []  # logit_bias as (int32 ids, float32 values)
        self.allowed: list[np.ndarray | None] = []  # allowed_token_ids as a packed bitmask (int32 words)
        self.allowing = np.zeros(0, np.bool_)  # the row has allowed_token_ids (one gather tells a step)
        self.pinned: list[np.ndarray | None] = []  # logprob_token_ids (int32)
        self.pinning = np.zeros(0, np.bool_)  # the row has logprob_token_ids

        self._last: tuple[list[Sequence], int, np.ndarray] = ([], -1, np.zeros(0, np.intp))  # seqs, row_moves, rows

    def rows(self, seqs: list[Sequence], num_rows: int, row_moves: int) -> np.ndarray:
        """Each sequence's row (intp[R], not to be written), its sampling values written if the row was another's.
        The last step's rows again when its sequences are these and no sequence got or gave back a row since
        (KvBlockPool.row_moves): the batch going on as it is costs no pass over its rows."""
        last, moves, last_rows = self._last
        if moves == row_moves and len(last) == len(seqs) and all(map(is_, last, seqs)):
            return last_rows
        rows = [s.kv.row for s in seqs]
        owner = self.owner
        if len(owner) < num_rows:
            self._grow(num_rows)
            owner = self.owner
        for seq, row in zip(seqs, rows):
            if owner[row] is not seq:
                self._write(seq, row)
        out = np.array(rows, np.intp)
        self._last = (list(seqs), row_moves, out)
        return out

    def _grow(self, n: int) -> None:
        extra = n - len(self.owner)
        self.owner += [None] * extra
        self.bias += [None] * extra
        self.allowed += [None] * extra
        self.pinned += [None] * extra
        for name in ("floats", "int32s", "seeds", "penalties", "prompt_lp", "pool", "lora", "allowing", "pinning"):
            a = getattr(self, name)
            setattr(self, name, np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)]))

    def _write(self, seq: Sequence, row: int) -> None:
        p = seq.params
        self.owner[row] = seq
        # Through float32 / int64 arrays first, as the per-step conversion did, so rounding and casts match.
        self.floats[:, row] = np.array([getattr(p, name) for name in FLOAT_FIELDS], dtype=np.float32)
        n = p.num_logprobs
        top_k, seed, num_logprobs = np.array((max(p.top_k, 0), seq.req.seed, -1 if n is None else n),
                                             dtype=np.int64)
        self.int32s[:, row] = top_k, num_logprobs
        self.seeds[row] = seed
        self.penalties[row] = p.has_penalties
        self.prompt_lp[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.pool[row] = seq.req.pool_kind
        self.lora[row] = seq.req.lora_slot
        bias = p.logit_bias
        self.bias[row] = (np.fromiter(bias.keys(), np.int32, len(bias)),
                          np.fromiter(bias.values(), np.float32, len(bias))) if bias else None
        allowed = p.allowed_token_ids
        self.allowed[row] = pack_bitmask(allowed, self.vocab_size) if allowed is not None else None
        self.allowing[row] = allowed is not None
        pinned = p.logprob_token_ids
        self.pinned[row] = np.array(pinned, np.int32) if pinned is not None else None
        self.pinning[row] = pinned is not None


class StepBuilder:
    """Builds StepPlans. Keeps a few buffer sets in rotation: a plan stays intact while later ones are built
    (a device may read a launched plan while the next is launched ahead of it)."""

    def __init__(
        self, pool: KvBlockPool, *, max_tokens: int, max_rows: int, max_model_len: int, swap: SwapSpace | None = None,
        depth: int = 3, vocab_size: int = 0, state_slots: bool = False,
    ):
        """vocab_size: the model's, for grammar rows' bitmasks (0: a builder that never meets one); state_slots:
        the model keeps recurrent state, so every plan carries each row's state slot."""
        self.block_size = block_size = pool.block_size
        self.state_slots = state_slots
        self.swap = swap or SwapSpace(0)
        self.max_blocks = -(-max_model_len // block_size) + 1
        self.max_tokens = max_tokens
        self.max_rows = max_rows
        self._hist_cap = max(4096, max_tokens)
        self._sets = [
            _Buffers(max_tokens, max_rows, self.max_blocks, self._hist_cap, -(-vocab_size // 32)) for _ in range(depth)
        ]
        self._turn = 0
        self.pool = pool
        self._rows = _Rows(vocab_size)
        self._arange = np.arange(max_rows + 1, dtype=np.int32)
        self._tokens = np.arange(max_tokens, dtype=np.int64)

    def build(
        self, seqs: list[Sequence], num_new: list[int], masks: list[RowMask], *, feed: list[int] | None = None,
        lookahead: int = 0, drafts: list[list[int]] | None = None, starts: list[int] | None = None,
    ) -> StepPlan:
        """A plan running num_new[r] tokens of seqs[r] from its num_launched (behind the step in flight, if any).

        feed: per row FEED_HOST, or the row of the previous step whose sampled token is this row's input (a row
        launched ahead: one token written at position num_launched, which always samples). None: every row
        host-fed.
        lookahead: the block tables also cover that many positions past the step's (a decode burst's).
        drafts: per row, draft tokens that follow its committed ones (a verify step, engine_core/speculative.py):
        the row runs its last token and its drafts (num_new = 1 + len(drafts)) and samples at each.
        starts: each row's num_launched, when the caller knows them already (ScheduledStep.goes_on); as an array,
        with one position per row.
        """
        b = self._sets[self._turn]
        self._turn = (self._turn + 1) % len(self._sets)
        R = len(seqs)
        T = sum(num_new)
        assert R <= self.max_rows and T <= self.max_tokens, "step larger than the builder's capacity"
        if starts is None:
            starts = [s.num_computed + s.num_inflight for s in seqs]
        end = int(starts.max()) + 1 if isinstance(starts, np.ndarray) else max(map(add, starts, num_new))
        width = max(1, -(-(end + lookahead) // self.block_size))
        src = self.pool.tables
        rows = self._rows.rows(seqs, len(src), self.pool.row_moves)
        tables = b.block_tables[: R * width].reshape(R, width)
        w = min(width, src.shape[1])  # a row's entries past its blocks are 0
        tables[:, :w] = src[rows, :w]
        tables[:, w:] = 0
        if num_new.count(1) == R:
            self._decode_tokens(b, seqs, starts, tables, feed)
        else:
            self._mixed_tokens(b, seqs, starts, num_new, tables, feed, drafts)
        g = self._sampling(b, seqs, rows, masks)
        if drafts is not None:
            b.num_drafts[:R] = [len(d) for d in drafts]
        h = self._history(b, seqs, rows, feed)
        n_bias = self._bias(b, rows)
        n_pinned = self._pinned(b, rows)
        self._prompt_logprobs(b, seqs, rows, starts, num_new, feed)
        self._pool(b, rows)
        swap_out, swap_in = self.swap.take_copies()
        state_slots = _NO_STATE
        if self.state_slots:  # state slot (recurrent models)
            state_slots = b.state_slots[:R]
            state_slots[:] = [s.state_slot for s in seqs]
        b.lora_slots[:R] = self._rows.lora[rows]
        length = {"T": T, "R": R, "R1": R + 1}
        return StepPlan(
            **{name: getattr(b, name)[: length[kind]] for name, kind in _BY_LENGTH},
            block_tables=tables,
            ban_ids=b.ban_ids[:R],
            hist_tokens=b.hist_tokens[:h],
            swap_out=swap_out,
            swap_in=swap_in,
            grammar_bitmask=b.grammar_bitmask[:g] if g else b.grammar_bitmask[:0, :0],
            state_slots=state_slots,
            bias_ids=b.bias_ids[:n_bias],
            bias_values=b.bias_values[:n_bias],
            pinned_ids=b.pinned_ids[:n_pinned],
        )

    def resample(self, seqs: list[Sequence], masks: list[RowMask], seq_lens: list[int],
                 samples: list[bool]) -> StepPlan:
        """A RESAMPLE plan (Device.resample) for a settled step's rows: their sampling values and masks as they are
        now, their history as committed (the fed token included), seq_lens the step's (they key the noise), the same
        rows sampling; one dummy token a row, which the device never reads."""
        b = self._sets[self._turn]
        self._turn = (self._turn + 1) % len(self._sets)
        R = len(seqs)
        rows = self._rows.rows(seqs, len(self.pool.tables), self.pool.row_moves)
        b.input_ids[:R] = 0
        b.positions[:R] = 0
        b.slot_mapping[:R] = 0
        b.block_tables[:R] = 0
        b.query_start[: R + 1] = self._arange[: R + 1]
        b.seq_lens[:R] = seq_lens
        b.sample[:R] = samples
        b.feed_from_row[:R] = FEED_HOST
        g = self._sampling(b, seqs, rows, masks)
        h = self._history(b, seqs, rows, None)
        n_bias, n_pinned = self._bias(b, rows), self._pinned(b, rows)
        b.prompt_lp[:, :R] = ((-1,), (0,), (-1,))
        b.pool[:R] = 0
        b.lora_slots[:R] = -1
        length = {"T": R, "R": R, "R1": R + 1}
        return StepPlan(
            **{name: getattr(b, name)[: length[kind]] for name, kind in _BY_LENGTH},
            block_tables=b.block_tables[:R].reshape(R, 1), ban_ids=b.ban_ids[:R], hist_tokens=b.hist_tokens[:h],
            grammar_bitmask=b.grammar_bitmask[:g] if g else b.grammar_bitmask[:0, :0],
            bias_ids=b.bias_ids[:n_bias], bias_values=b.bias_values[:n_bias], pinned_ids=b.pinned_ids[:n_pinned],
        )

    def _decode_tokens(self, b: _Buffers, seqs: list[Sequence], starts: list[int], tables: np.ndarray,
                       feed: list[int] | None) -> None:
        """Token and per-row arrays of a step whose every row runs one token, with whole-batch numpy."""
        R, bs = len(seqs), self.block_size
        pos = b.positions[:R]
        pos[:] = starts
        slots = b.slot_mapping[:R]
        np.multiply(tables[self._arange[:R], pos // bs], bs, out=slots, dtype=np.int64)
        slots += pos % bs
        np.add(pos, 1, out=b.seq_lens[:R])
        b.query_start[: R + 1] = self._arange[: R + 1]
        if feed is not None and FEED_HOST not in feed:  # the batch going on: every input is the device's, and samples
            b.input_ids[:R] = 0
            b.sample[:R] = True
            b.feed_from_row[:R] = feed
            return
        if feed is None:
            toks = [s.out.tokens for s in seqs]
            b.input_ids[:R] = [t[n] for t, n in zip(toks, starts)]
            b.sample[:R] = [n + 1 == len(t) for t, n in zip(toks, starts)]
            b.feed_from_row[:R] = FEED_HOST
            return
        # A fed row's input is the device's (0 here) and it samples; a host-fed row's input was committed.
        toks = [s.out.tokens for s in seqs]
        b.input_ids[:R] = [0 if src != FEED_HOST else t[n] for t, n, src in zip(toks, starts, feed)]
        b.sample[:R] = [src != FEED_HOST or n + 1 == len(t) for t, n, src in zip(toks, starts, feed)]
        b.feed_from_row[:R] = feed

    def _mixed_tokens(
        self, b: _Buffers, seqs: list[Sequence], starts: list[int], num_new: list[int], tables: np.ndarray,
        feed: list[int] | None, drafts: list[list[int]] | None = None,
    ) -> None:
        """Token and per-row arrays of a step with prefill chunks (or drafts): positions, slots, lengths and samples
        with whole-batch numpy; each row's first input in one gather; only the rows running several tokens copy
        their slices one by one (a step has few)."""
        R, bs = len(seqs), self.block_size
        starts = starts.tolist() if isinstance(starts, np.ndarray) else starts
        nn = np.array(num_new, np.int64)
        st = np.array(starts, np.int64)
        qs = b.query_start[: R + 1]
        qs[0] = 0
        np.cumsum(nn, out=qs[1:])
        T = int(qs[R])
        pos = b.positions[:T]
        np.add(np.repeat(st - qs[:R], nn), self._tokens[:T], out=pos, casting="unsafe")  # start + offset in row
        slots = b.slot_mapping[:T]
        np.multiply(tables[np.repeat(self._arange[:R], nn), pos // bs], bs, out=slots, dtype=np.int64)
        slots += pos % bs
        toks = [s.out.tokens for s in seqs]
        if feed is None:
            feed = [FEED_HOST] * R
            b.input_ids[qs[:R]] = [t[n] for t, n in zip(toks, starts)]
        else:  # a fed row's input is the device's (0 here); it runs one token
            b.input_ids[qs[:R]] = [0 if src != FEED_HOST else t[n] for t, n, src in zip(toks, starts, feed)]
        extra = np.array([len(d) for d in drafts], np.int64) if drafts is not None else 0  # tokens past the committed
        for r in np.flatnonzero(nn > 1).tolist():
            t, start, k = int(qs[r]), starts[r], num_new[r]
            n = k - (len(drafts[r]) if drafts is not None else 0)  # committed tokens, then the drafts
            b.input_ids[t : t + n] = toks[r][start : start + n]
            if n < k:
                b.input_ids[t + n : t + k] = drafts[r]
        ends = st + nn
        b.seq_lens[:R] = ends
        fed = np.array(feed, np.int32)
        b.sample[:R] = (fed != FEED_HOST) | (ends - extra == np.fromiter(map(len, toks), np.int64, R))
        b.feed_from_row[:R] = fed

    def _sampling(self, b: _Buffers, seqs: list[Sequence], rows: np.ndarray, masks: list[RowMask]) -> int:
        """Each row's sampling values (from the mirror) and mask; returns the bitmask rows (filled): a grammar row's
        (RowMask MASK_GRAMMAR) and an allowed_token_ids row's, which needs no row state (a plain row may have one,
        its bitmask the same every step, so it is fed ahead and bursts as any plain row)."""
        R, m = len(rows), self._rows
        m.floats.take(rows, axis=1, out=b.floats[:, :R])
        m.int32s.take(rows, axis=1, out=b.int32s[:, :R])
        m.seeds.take(rows, out=b.seeds[:R])
        b.ban_ids[:R] = -1
        b.num_drafts[:R] = 0
        allowing = m.allowing[rows]
        if masks.count(NO_MASK) == R:  # the usual step: no row constrained
            b.mask_kind[:R] = NO_MASK.kind
            b.force_token[:R] = NO_MASK.force_token
            if not allowing.any():
                return 0
            kinds = [NO_MASK.kind] * R
        else:
            kinds = [mask.kind for mask in masks]
            b.mask_kind[:R] = kinds
            b.force_token[:R] = [mask.force_token for mask in masks]
            for r, mask in enumerate(masks):
                if mask.ban:
                    ban = mask.ban[:MAX_BAN_IDS]
                    b.ban_ids[r, : len(ban)] = ban
            if not allowing.any() and not any(kind & MASK_GRAMMAR for kind in kinds):
                return 0
        b.mask_kind[:R][allowing] |= MASK_GRAMMAR
        allowed = [m.allowed[r] for r in rows.tolist()] if allowing.any() else [None] * R
        return fill_bitmasks(seqs, kinds, allowed, b.grammar_bitmask)

    def _history(self, b: _Buffers, seqs: list[Sequence], rows: np.ndarray, feed: list[int] | None) -> int:
        """Token histories of the rows with penalties; returns their total length.

        A penalised row fed from the step in flight ends its history with a slot (-1) for the token it is fed,
        which the host has not committed yet: the device writes that token there before it samples, so the
        row's penalties count it as a plain step's would (and a device that did not would skip the -1)."""
        R = len(seqs)
        pen = self._rows.penalties[rows]
        if not pen.any():
            b.hist_start[: R + 1] = 0
            b.hist_prompt_len[:R] = 0
            return 0
        which = np.flatnonzero(pen).tolist()
        toks = [seqs[r].out.tokens for r in which]
        counts = np.zeros(R, np.int64)
        counts[which] = list(map(len, toks))
        if feed is not None:  # a fed row's history ends with the slot its fed token is written to
            fed = [feed[r] != FEED_HOST for r in which]
            if any(fed):
                counts[which] += fed
                toks = [part for t, f in zip(toks, fed) for part in ((t, _FED_SLOT) if f else (t,))]
        b.hist_start[0] = 0
        np.cumsum(counts, out=b.hist_start[1 : R + 1])
        h = int(b.hist_start[R])
        if h > len(b.hist_tokens):  # rare: grow, and keep the larger size from now on
            b.hist_tokens = np.zeros(h * 2, np.int32)
        b.hist_tokens[:h] = np.frombuffer(b"".join(toks), np.int32)  # one copy in C, no per-token Python
        b.hist_prompt_len[:R] = 0
        b.hist_prompt_len[which] = [seqs[r].req.num_prompt for r in which]
        return h


    def _prompt_logprobs(self, b: _Buffers, seqs: list[Sequence], rows: np.ndarray, starts: list[int],
                         num_new: list[int], feed: list[int] | None) -> None:
        """prompt_lp_n, prompt_lp_count, prompt_lp_next per row: a host-fed row of a request with prompt_logprobs
        asks for its positions up to the prompt's second-to-last (the last predicts the output) while any of the
        prompt tokens they predict has no entry yet (a recompute after preemption asks again only past those)."""
        R = len(seqs)
        out = b.prompt_lp[:, :R]
        out[0], out[1], out[2] = -1, 0, -1
        for r in np.flatnonzero(self._rows.prompt_lp[rows] >= 0):
            seq, start, k = seqs[r], starts[r], num_new[r]
            count = min(start + k, seq.num_prompt - 1) - start
            if count <= 0 or start + count < len(seq.out.prompt_entries) or (feed is not None and feed[r] != FEED_HOST):
                continue
            out[0, r], out[1, r] = seq.params.prompt_logprobs, count
            out[2, r] = seq.tokens[start + k] if count == k else -1

    def _pool(self, b: _Buffers, rows: np.ndarray) -> None:
        """POOL_* per row: an embeddings request's row never samples, and every chunk of it pools (the
        commit keeps what its kind needs: the sum, the last chunk's, the first chunk's)."""
        R = len(rows)
        out = b.pool[:R]
        self._rows.pool.take(rows, out=out)
        if out.any():
            b.sample[:R][out != POOL_NONE] = False

    def _pinned(self, b: _Buffers, rows: np.ndarray) -> int:
        """The logprob_token_ids of the rows that have them, end to end; returns the entries' count (0: none)."""
        R = len(rows)
        b.pinned_start[: R + 1] = 0
        if not self._rows.pinning[rows].any():
            return 0
        entries = [self._rows.pinned[r] for r in rows.tolist()]
        need = sum(len(e) for e in entries if e is not None)
        if need > len(b.pinned_ids):  # rare: grow, and keep the larger size from now on
            b.pinned_ids = np.zeros(need * 2, np.int32)
        n = 0
        for r, e in enumerate(entries):
            if e is not None:
                b.pinned_ids[n : n + len(e)] = e
                n += len(e)
            b.pinned_start[r + 1] = n
        return n

    def _bias(self, b: _Buffers, rows: np.ndarray) -> int:
        """The biased rows' logit_bias, end to end; returns the entries' count (0: no row biased)."""
        R = len(rows)
        b.bias_start[: R + 1] = 0
        if self._rows.bias.count(None) == len(self._rows.bias):  # no row has ever had a bias: nothing to gather
            return 0
        entries = [self._rows.bias[r] for r in rows.tolist()]
        if entries.count(None) == R:
            return 0
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


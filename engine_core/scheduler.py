"""Continuous batching with a token budget: decodes first, then prefill chunks, preempting when dry."""

from __future__ import annotations

import heapq
import operator
import time

import numpy as np
from dataclasses import dataclass, field

from metrale.ipc.errors import ErrorCode, Refused
from metrale.ipc.plan import FEED_HOST, POOL_LAST, POOL_NONE, StepKind
from metrale.settings import DEFAULTS

from .kv_blocks import KvBlockPool
from .sequence import Sequence, SeqStatus
from .state_slots import StateSlots
from .swap import SwapSpace


class SchedulerBusy(Refused):
    """The waiting queue is full: the request is refused, nothing else changes."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.BUSY, message)


@dataclass(slots=True)
class SchedulerConfig:
    """The scheduler's share of the settings (metrale/settings.py's defaults) and the model's resolved length."""

    max_num_seqs: int = DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens
    max_model_len: int = 2048  # the model's length as resolved (ModelInfo), not the --max-model-len cap
    max_waiting: int = DEFAULTS.max_waiting
    # or "swap": KV to host blocks, recompute when they run out
    preemption_mode: str = DEFAULTS.preemption_mode
    # Prompt positions one step may ask prompt logprobs for (ipc.ticket_layout.prompt_logprob_rows: the ring's bound).
    max_prompt_logprob_rows: int = 1 << 30


@dataclass(slots=True)
class ScheduledStep:
    """One step: the sequences it runs, how many tokens each runs and where its input comes from (FEED_HOST, or
    the row of the step in flight whose device token it is fed), in scheduling order; and its kind (step_kinds.py
    turns an all-decode STEP into a BURST of `steps` or a VERIFY of `drafts` when the rows allow)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    fed_from: list[int] = field(default_factory=list)
    kind: StepKind = StepKind.STEP
    steps: int = 1  # a BURST's decode steps
    drafts: list[list[int]] | None = None  # a VERIFY's draft tokens per row (num_new = 1 + len(drafts[r]))
    prompt_lp_rows: int = 0  # tokens of rows still in a prompt that asks prompt logprobs (bounded: lp_chunk)
    # The batch going on as it is: its first rows are every running row, plain, each fed from its own row of the
    # step in flight (whose one position each it follows), so their masks are NO_MASK and their starts known.
    goes_on: bool = False
    starts: np.ndarray | None = None  # with goes_on: the num_launched of those first rows

    def add(self, seq: Sequence, k: int, src: int = FEED_HOST) -> None:
        if _wants_prompt_logprobs(seq):
            self.prompt_lp_rows += k
        self.seqs.append(seq)
        self.num_new.append(k)
        self.fed_from.append(src)

    @property
    def decode_only(self) -> bool:
        """True when every row is a single-token decode (the pipelined lane's kind of step)."""
        return all(k == 1 and s.is_decode for s, k in zip(self.seqs, self.num_new))

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass(slots=True)
class Scheduler:
    """Moves sequences between waiting and running, and picks each step's work."""

    config: SchedulerConfig
    pool: KvBlockPool
    swap: SwapSpace = field(default_factory=lambda: SwapSpace(0))
    state_slots: StateSlots = field(default_factory=StateSlots)  # recurrent models: one per running sequence
    running: list[Sequence] = field(default_factory=list)
    swapped: list[Sequence] = field(default_factory=list)  # by (priority, arrival)
    _waiting: list[tuple[int, int, Sequence]] = field(default_factory=list)  # heap by (priority, arrival)
    num_preemptions: int = 0
    _unsorted: bool = False  # a sequence joined running since it was last put in scheduling order
    _plain_live: bool = False  # retire_finished found every running row plain and unfinished (schedule_ahead reads it)
    # A running row may still be suspect (suspect_running, or a suspect joined): _may_start must look. Cleared when
    # its look finds none, so the usual admission does not scan every running row.
    _suspects: bool = False

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting(self) -> list[Sequence]:
        return [s for _, _, s in sorted(self._waiting)]

    def check_admissible(self, seq: Sequence) -> None:
        """Raise Refused (too_long) or SchedulerBusy (queue full) before a request is queued."""
        limit = min(self.config.max_model_len, self.pool.num_blocks * self.pool.block_size)
        if seq.num_tokens >= limit + bool(seq.req.pool_kind):  # an embeddings request needs no room for a new token
            raise Refused(
                ErrorCode.TOO_LONG,
                f"prompt has {seq.num_tokens} tokens; this server accepts at most {limit - 1} "
                f"(max_model_len {self.config.max_model_len}, KV capacity {self.pool.num_blocks * self.pool.block_size} tokens)"
            )
        if len(self._waiting) >= self.config.max_waiting:
            raise SchedulerBusy(f"server busy: {len(self._waiting)} requests waiting")

    def add(self, seq: Sequence) -> None:
        """Queue a new (or preempted) sequence."""
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, (seq.params.priority, seq.req.arrival, seq))

    def has_admissible(self) -> bool:
        """True when a swapped or waiting sequence could be admitted now (so the device should go quiet)."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        head = self._swapped_head() or (self._waiting[0][2] if self._waiting else None)
        if head is None:
            return False
        k = min(head.num_tokens - head.num_computed, self.config.max_num_batched_tokens)
        return self._may_start(head) and self._fits(head, head.num_computed + k)

    def _may_start(self, seq: Sequence) -> bool:
        """Whether seq may join the running batch at all: a suspect (a request running when the engine
        failed) runs alone until it is past the point of the failure, so a request that breaks the engine
        is found without failing the requests beside it."""
        if seq.suspect_until > seq.num_tokens and self.running:
            return False
        if self._suspects:
            self._suspects = any(s.suspect_until > s.num_tokens for s in self.running)
        return not self._suspects

    def _fits(self, seq: Sequence, num_tokens: int) -> bool:
        """The admission rule (swap-in, admit, and has_admissible ask it alike): seq's blocks for num_tokens
        fit, keeping one block spare while others run so their next decodes do not preempt at once."""
        watermark = 1 if self.running else 0
        return self.pool.blocks_needed(seq, num_tokens) <= self.pool.num_available - watermark

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self.running or self.swapped)

    def remove_waiting(self, seq: Sequence) -> None:
        """Drop a sequence (aborted) from the waiting queue."""
        self._waiting = [e for e in self._waiting if e[2] is not seq]
        heapq.heapify(self._waiting)

    def retire_finished(self, keep: list[Sequence] = ()) -> list[Sequence]:
        """Remove finished sequences from running and free their blocks (those in `keep`, a step still in
        flight, stay until it is settled). Its pass also tells the schedule_ahead that follows whether every running
        row is plain and unfinished (the batch may go on as it is: _goes_on)."""
        odd = [s for s in self.running if s.out.finish_reason is not None or not s.req.plain]
        self._plain_live = not odd
        done = [s for s in odd if s.out.finish_reason is not None]
        if done and keep:
            kept = set(map(id, keep))
            done = [s for s in done if id(s) not in kept]
        if done:
            gone = set(map(id, done))
            self.running = [s for s in self.running if id(s) not in gone]
            for seq in done:
                self.pool.free(seq)
                self._give_slot(seq)  # no step in flight holds seq any more
        return done

    def preempt(self, seq: Sequence) -> None:
        """Take seq off the device: swap its KV to host blocks (swap mode, while they last) or free it
        and queue it again with all its tokens to recompute."""
        self.running.remove(seq)
        self._give_slot(seq)  # recomputed from position 0 wherever it runs next
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.preemption_mode == "swap" and seq.num_computed > 0 and self._swap_out(seq):
            return
        self.pool.free(seq)
        seq.num_computed = 0
        self.add(seq)

    def _swap_out(self, seq: Sequence) -> bool:
        """Queue the copy of seq's computed blocks to host; False when the swap space is full."""
        self.pool.trim(seq, seq.num_computed)
        host = self.swap.take(seq.kv.num_blocks)
        if host is None:
            return False
        self.swap.queue_out(self.pool.blocks(seq), host)
        self.pool.free(seq)
        seq.host_blocks = host
        seq.status = SeqStatus.SWAPPED
        self.swapped.append(seq)
        self.swapped.sort(key=_order)
        return True

    def remove_swapped(self, seq: Sequence) -> None:
        """Drop a swapped sequence (aborted) and give its host blocks back."""
        self.swapped.remove(seq)
        self.swap.give_back(seq.host_blocks)
        seq.host_blocks = []

    def requeue_all(self) -> None:
        """Move every running and swapped sequence back to waiting (the device lost its KV and its host copies)."""
        for seq in list(self.running):
            self.running.remove(seq)
            self.pool.free(seq)
            self._give_slot(seq)
            seq.num_computed = 0
            self.add(seq)
        for seq in self.swapped:
            seq.host_blocks = []
            seq.num_computed = 0
            self.add(seq)
        self.swapped.clear()
        self.swap.forget()
        self.pool.reset_cache()

    def release(self, seq: Sequence) -> None:
        """Take seq off the device and out of every queue, its blocks and host blocks given back (a beam row the
        search re-seats: beam_groups.py). Nothing may be in flight for it."""
        assert not seq.num_inflight, "releasing a row with a step in flight"
        if seq.status == SeqStatus.IDLE:
            return
        if seq in self.running:  # a failed row may be finished and not retired yet
            self.running.remove(seq)
            self._give_slot(seq)
        elif seq.status == SeqStatus.SWAPPED:
            self.remove_swapped(seq)
        elif seq.status == SeqStatus.WAITING:
            self.remove_waiting(seq)
        self.pool.free(seq)
        seq.num_computed = 0
        if seq.status != SeqStatus.FINISHED:
            seq.status = SeqStatus.IDLE

    def hold(self, seq: Sequence) -> None:
        """A new beam row its search keeps in no queue until it needs it."""
        seq.status = SeqStatus.IDLE

    def seat_fork(self, seq: Sequence, parent: Sequence | None) -> None:
        """Seat a released beam row whose tokens continue parent's, running, when parent runs and a row is free: it
        shares parent's full blocks (reference counts) and gets a copy of its last, partial block, made on the
        device before the next plan's forward (SwapSpace.queue_copy), so it only decodes its last token; without a
        free block for the copy, it computes the rest of that block again. Else it waits, to be admitted (and find
        the shared prefix in the cache) as any request is."""
        done = 0 if parent is None or parent.status != SeqStatus.RUNNING else min(parent.num_computed, seq.num_tokens - 1)
        if not done or self.state_slots.enabled or len(self.running) >= self.config.max_num_seqs:
            self.add(seq)
            return
        pool = self.pool
        full = done // pool.block_size
        pool.share(seq, parent, full)
        seq.num_computed = full * pool.block_size
        if done > seq.num_computed and pool.allocate(seq, done):
            self.swap.queue_copy(int(pool.tables[parent.kv.row, full]), int(pool.tables[seq.kv.row, full]))
            seq.num_computed = done
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self._unsorted = True
        self._suspects |= seq.suspect_until > seq.num_tokens

    def schedule(self) -> ScheduledStep:
        """Pick this step's work: every running decode, then prefill chunks up to the token budget."""
        step = ScheduledStep()
        budget = self.config.max_num_batched_tokens
        self._sort_running()
        decodes = [s for s in self.running if s.is_decode]
        partial = [s for s in self.running if not s.is_decode]
        for seq in decodes + partial:
            if budget == 0:
                break
            if seq.status != SeqStatus.RUNNING:  # preempted as a victim earlier in this loop
                continue
            k = self._lp_chunk(seq, min(seq.num_tokens - seq.num_computed, budget), step)
            if k > 0 and self._grow_or_preempt(seq, seq.num_computed + k, step):
                step.add(seq, k)
                budget -= k
        self._fill(step, budget)
        while not step.seqs and (self._waiting or self._has_work_swapped()):
            # Nothing runs: every running row is a beam row waiting for its search, holding blocks that its
            # siblings (or anyone) need. Release them, latest first (their alternatives are in: nothing is lost but
            # their KV), until something is admitted.
            idle = next((s for s in reversed(self.running) if _idle_beam(s)), None)
            if idle is None:
                break
            self.release(idle)
            self._fill(step, budget)
        return step

    def _fill(self, step: ScheduledStep, budget: int) -> None:
        """Admit swapped, then waiting sequences into what is left of the token budget (swapped ones first)."""
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            head = self._swapped_head()
            if head is None or not self._swap_in(head, budget, step):
                break
            budget -= step.num_new[-1]
        while budget > 0 and self._waiting and not self._has_work_swapped() \
                and len(self.running) < self.config.max_num_seqs:
            if not self._admit(self._waiting[0][2], budget, step):
                break
            budget -= step.num_new[-1]

    def _swapped_head(self) -> Sequence | None:
        """The first swapped sequence with something to run: a beam row swapped out after its step, its alternatives
        in, has nothing until its search moves it (beam_groups.py), and must not hold up the rest."""
        return next((s for s in self.swapped if s.num_tokens > s.num_computed), None)

    def _has_work_swapped(self) -> bool:
        return self._swapped_head() is not None

    def schedule_ahead(self, inflight: list[Sequence], samples: list[bool], discard: list[bool], can_feed,
                       written: list[int] = (), num_new: list[int] = ()) -> ScheduledStep | None:
        """The step to launch while the step in flight (its rows, whether each samples, whether each was
        discarded; where each started and how many positions it runs) runs: each of its rows that will have a new
        token decodes, fed from that token (if can_feed(seq): a grammar row's next bitmask needs its commit, so it
        waits a step); a prefill goes on with its next chunk; running rows it did not run join with their committed
        input; then swapped and waiting requests are admitted into what is left. No preemption: None (nothing
        allocated that schedule() would not) when a running row's KV does not fit; the lane then settles first."""
        step = ScheduledStep()
        budget = self.config.max_num_batched_tokens
        self._sort_running()
        running = self.running
        # The usual case: the step in flight ran the running rows as they stand (row j feeds from row j).
        if len(inflight) == len(running) and all(map(operator.is_, inflight, running)) \
                and self._goes_on(step, samples, discard, written, num_new, budget):
            self._fill(step, budget - len(running))
            return step
        feeds = {id(s): j for j, (s, smp, gone) in enumerate(zip(inflight, samples, discard)) if smp and not gone}
        for seq in running:
            if budget == 0:
                break
            if seq.out.finish_reason is not None:
                continue
            launched = seq.num_computed + seq.num_inflight
            src = feeds.get(id(seq), FEED_HOST)
            if src != FEED_HOST:
                if not can_feed(seq):
                    continue
                k = 1
            else:
                k = self._lp_chunk(seq, min(len(seq.out.tokens) - launched, budget), step)
                if k <= 0:
                    continue
            if launched + k > seq.kv.num_blocks * self.pool.block_size and not self.pool.allocate(seq, launched + k):
                return None
            step.add(seq, k, src)
            budget -= k
        self._fill(step, budget)
        return step if step.seqs else None

    def _goes_on(self, step: ScheduledStep, samples: list[bool], discard: list[bool], written: list[int],
                 num_new: list[int], budget: int) -> bool:
        """Schedule every running row, fed from its own row of the step in flight, when that step decoded each of
        them (one position from `written`, sampled, none discarded) and each is plain and unfinished: the batch goes
        on as it is, with Python only for the rows that cross into a new KV block. False (nothing done) otherwise,
        and when such a row's block does not fit (the row by row path then says None)."""
        running = self.running
        R = len(running)
        plain_live, self._plain_live = self._plain_live, False  # as retire_finished found it just before: read once
        if not (plain_live and 0 < R <= budget and len(written) == R and num_new.count(1) == R and all(samples)
                and True not in discard):
            return False
        # Position written + 1 is each row's next; every position up to it is reserved, so a row needs a block only
        # when that position starts one.
        bs = self.pool.block_size
        ends = np.fromiter(written, np.int64, R) + 1
        for j in np.flatnonzero(ends % bs == 0).tolist():
            if not self.pool.allocate(running[j], int(ends[j]) + 1):
                return False
        step.seqs.extend(running)
        step.num_new.extend([1] * R)
        step.fed_from.extend(range(R))
        step.goes_on, step.starts = True, ends
        return True

    def _swap_in(self, seq: Sequence, budget: int, step: ScheduledStep) -> bool:
        """Resume the head of the swapped queue into fresh device blocks; False if they do not fit."""
        k = self._lp_chunk(seq, min(seq.num_tokens - seq.num_computed, budget), step)
        if not (k > 0 and self._may_start(seq) and self._fits(seq, seq.num_computed + k)):
            return False
        self.swapped.remove(seq)
        self.pool.allocate(seq, seq.num_computed + k)
        self.swap.queue_in(seq.host_blocks, self.pool.blocks(seq)[: len(seq.host_blocks)])
        seq.host_blocks = []
        self._start(seq, k, step)
        return True

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, step: ScheduledStep) -> bool:
        """Allocate seq's blocks for num_tokens, preempting the lowest-priority unscheduled others.

        False when seq itself had to go (preempted, or failed when nothing else can make room).
        """
        while not self.pool.allocate(seq, num_tokens):
            victims = [s for s in self.running if s is not seq and s not in step.seqs]
            if victims:
                victim = next((s for s in reversed(victims) if _idle_beam(s)), victims[-1])
                if _idle_beam(victim):  # its alternatives are in: it needs no recompute, only a row when it moves
                    self.release(victim)
                else:
                    self.preempt(victim)
                continue
            if len(self.running) == 1 and not step.seqs:
                seq.finish("error", f"the KV cache ({self.pool.num_blocks} blocks) cannot hold this request")
            else:
                self.preempt(seq)
            return False
        return True

    def _admit(self, seq: Sequence, budget: int, step: ScheduledStep) -> bool:
        """Start (or resume) the head of the waiting queue with a first chunk; False if it does not fit."""
        if not self._may_start(seq):
            return False
        # Prompt logprobs, and a mean or first-token embedding, need every prompt position computed.
        if seq.num_computed == 0 and not seq.kv.num_blocks and seq.params.prompt_logprobs is None \
                and seq.req.pool_kind in (POOL_NONE, POOL_LAST):
            seq.num_computed = self.pool.match_prefix(seq)
        k = self._lp_chunk(seq, min(seq.num_tokens - seq.num_computed, budget), step)
        if k <= 0 or not self._fits(seq, seq.num_computed + k):
            self.pool.free(seq)  # give back a prefix match; it is matched again next time
            seq.num_computed = 0
            return False
        heapq.heappop(self._waiting)
        if seq.num_cached_tokens is None:  # the first admission's hit counts (a recompute's does not)
            seq.num_cached_tokens = seq.num_computed
            seq.queued_s = time.monotonic() - seq.received_at
        self.pool.allocate(seq, seq.num_computed + k)
        self._start(seq, k, step)
        return True

    def _lp_chunk(self, seq: Sequence, k: int, step: ScheduledStep) -> int:
        """k, or the part of it that fits beside the step's other prompt-logprob positions (the ticket ring holds
        max_prompt_logprob_rows of them per step: a whole-vocabulary prompt_logprobs prefill runs in chunks)."""
        if not _wants_prompt_logprobs(seq):
            return k
        return min(k, self.config.max_prompt_logprob_rows - step.prompt_lp_rows)

    def _start(self, seq: Sequence, k: int, step: ScheduledStep) -> None:
        """Make seq running, in a new slot, with k tokens in this step."""
        seq.status = SeqStatus.RUNNING
        seq.state_slot = self.state_slots.take()  # its first step starts at position 0 and resets it
        self.running.append(seq)
        self._unsorted = True
        self._suspects |= seq.suspect_until > seq.num_tokens
        step.add(seq, k)

    def _sort_running(self) -> None:
        """Put running in scheduling order; a sequence's order never changes, so only after one joined."""
        if self._unsorted:
            self.running.sort(key=_order)
            self._unsorted = False

    def _give_slot(self, seq: Sequence) -> None:
        self.state_slots.give_back(seq.state_slot)
        seq.state_slot = -1

    def suspect_running(self, max_failures: int) -> list[Sequence]:
        """A tick failed: every running sequence is suspect until it is past the failing point (it then runs alone:
        _may_start); returns those that have now failed max_failures times."""
        for seq in self.running:
            seq.failures += 1
            seq.suspect_until = seq.num_tokens + 1
        self._suspects = bool(self.running)
        return [seq for seq in self.running if seq.failures >= max_failures]


def _order(seq: Sequence) -> tuple[int, int]:
    """Scheduling order: priority, then arrival."""
    return seq.params.priority, seq.req.arrival


def _idle_beam(seq: Sequence) -> bool:
    """A beam row with its step's alternatives in and nothing to run until its search moves it (beam_groups.py)."""
    return seq.req.beam is not None and seq.num_computed == seq.num_tokens and not seq.num_inflight \
        and seq.out.finish_reason is None


def _wants_prompt_logprobs(seq: Sequence) -> bool:
    """True while seq's next tokens are prompt positions it asks prompt logprobs for."""
    return seq.params.prompt_logprobs is not None and seq.num_launched < seq.num_prompt

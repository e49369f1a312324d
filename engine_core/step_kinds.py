"""Step kinds: whether an all-decode step runs as one STEP, a BURST of decode steps, or a VERIFY of drafts.

The scheduler's step is a STEP. When every running row decodes, `StepShaper.shape` may turn it into a VERIFY
(some plain row has drafts: speculative.py) or a BURST (every row plain and unwatched token by token), reserving
the KV either needs; the lane (decode_lane.py) launches and settles every kind the same way.

Decode bursts: several decode steps from one plan, for rows nobody watches token by token.

A tick costs the host a schedule, a plan, a launch and a commit whether it runs one decode step or
several. On a device that steps inline (the offline LLM on a CPU, where the host's tick cannot overlap
the model's step) that host work is a few per cent of every step; in `metrale serve` on a small box, the
engine core's and the frontend's work per step takes the cores the worker needs. So when every row of a
decode batch is plain (no mask, penalty or row state, so no pick depends on the host having seen the
one before) and either reports only at its finish (stream=False: up to decode_burst steps) or is
streamed every N tokens anyway (--stream-interval N: up to N steps), the tick plans once and the device
runs the burst, each row fed its own previous token. The tokens are those single steps would give:
each step samples from the same logits with the same (seed, position) key. A row that stops inside a
burst (EOS or a stop id) keeps running to the burst's end, and what it computes past its stop is
never committed; max_tokens and the model's length bound the burst, so they end rows at its last step.

A burst stays in flight until the next tick, which commits it and, when the batch may go on as it is,
launches the next one before the tick's outputs go out: the device waits only for the commit and the
next plan, not for the frontend (a burst is launched after its predecessor is committed, so unlike
the lane's steps it is never a guess).
"""

from __future__ import annotations

from metrale.ipc.plan import StepKind
from metrale.ipc.sampling import MAX_LOGPROBS

from .scheduler import ScheduledStep
from .sequence import Sequence
from .speculative import Speculator
from .step_io import StepIo


def burst_length(active: list[Sequence], final_limit: int, stream_limit: int, max_model_len: int) -> int:
    """How many decode steps the batch may run in one burst: up to final_limit for rows that report at
    their finish, stream_limit for streamed rows (their stream interval); 1 when a row must be seen
    after every token."""
    steps = max(final_limit, stream_limit)
    for s in active:
        if (s.params.num_logprobs or 0) > MAX_LOGPROBS:  # wide alternatives: the ticket ring holds one step of them
            return 1
        if not s.req.plain or s.finished:
            return 1
        steps = min(steps, stream_limit if s.req.stream else final_limit, s.params.max_tokens - s.num_output,
                    max_model_len - s.num_tokens)
        if steps <= 1:
            return 1
    return steps


class StepShaper:
    """Gives an all-decode step its kind: VERIFY when a row has drafts, BURST when the rows allow several
    steps, else STEP."""

    def __init__(self, burst_limits: tuple[int, int], speculator: Speculator | None, max_model_len: int,
                 max_tokens: int) -> None:
        self.burst_limits = burst_limits  # (rows that report at their finish, streamed rows); 1: no bursts
        self.speculator = speculator
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens  # a step's tokens at most (the plan builder's and the ticket ring's capacity)

    def shape(self, step: ScheduledStep, io: StepIo) -> ScheduledStep:
        """step as a VERIFY or a BURST when its rows (every running row, each decoding) allow one and the KV it
        needs is reserved; unchanged otherwise. Drafts whose KV does not fit are dropped (that row decodes
        plainly), and a burst the pool cannot cover is one step (blocks already reserved stay)."""
        seqs = step.seqs
        drafts = self.speculator.drafts(seqs) if self.speculator is not None else None
        if drafts is not None:
            room = self.max_tokens - len(seqs)  # the drafts' share of the step, first rows first
            for d in drafts:
                del d[max(room, 0):]
                room -= len(d)
            pool = io.pool
            for s, d in zip(seqs, drafts):
                if d and not pool.allocate(s, s.num_computed + 1 + len(d)):
                    d.clear()
            if any(drafts):
                step.kind, step.drafts, step.num_new = StepKind.VERIFY, drafts, [1 + len(d) for d in drafts]
            return step
        return self.burst(step, io)

    def burst(self, step: ScheduledStep, io: StepIo) -> ScheduledStep:
        """step as a BURST when its rows allow one and the pool covers it; unchanged otherwise."""
        seqs = step.seqs
        steps = self.burst_length(seqs)
        if steps > 1 and all(io.pool.allocate(s, s.num_computed + steps) for s in seqs):
            step.kind, step.steps = StepKind.BURST, steps
        return step

    def drafts_ready(self, seqs: list[Sequence]) -> bool:
        """True when a verify step could run for these rows (then neither a burst nor the lane runs ahead)."""
        return self.speculator is not None and self.speculator.drafts([s for s in seqs if not s.finished]) is not None

    def burst_length(self, seqs: list[Sequence]) -> int:
        """How many steps a burst of these rows may run (1: none; also when a verify step could run instead)."""
        final, streamed = self.burst_limits
        if final <= 1 and streamed <= 1 or self.drafts_ready(seqs):
            return 1
        return burst_length(seqs, final, streamed, self.max_model_len)

"""Decode bursts: several decode steps from one plan, for rows nobody watches token by token.

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

from dataclasses import dataclass

from metrale.ipc.plan import DeviceError, Ticket

from .commit import commit_tokens
from .decode_lane import fail_rows
from .pipeline import NO_MASK
from .sequence import Sequence
from .step_io import ReserveKv, StepIo


def burst_length(active: list[Sequence], final_limit: int, stream_limit: int, max_model_len: int) -> int:
    """How many decode steps the batch may run in one burst: up to final_limit for rows that report at
    their finish, stream_limit for streamed rows (their stream interval); 1 when a row must be seen
    after every token."""
    steps = max(final_limit, stream_limit)
    for s in active:
        if not s.plain or s.finished:
            return 1
        steps = min(steps, stream_limit if s.stream else final_limit, s.params.max_tokens - s.num_output,
                    max_model_len - s.num_tokens)
        if steps <= 1:
            return 1
    return steps


@dataclass(slots=True)
class Burst:
    """A launched burst: its ticket and its rows (in plan order)."""

    ticket: Ticket
    rows: list[Sequence]


def launch_burst(active: list[Sequence], steps: int, io: StepIo) -> Burst | None:
    """Launch `steps` decode steps of every row. None (nothing launched) when the KV pool cannot cover the
    burst (the caller steps once instead; blocks already reserved stay) or the launch failed (rows told)."""
    pool = io.pool
    if not all(io.apply(ReserveKv(s, steps)) for s in active if pool.blocks_needed(s, s.num_computed + steps)):
        return None
    n = len(active)
    plan = io.builder.build(active, [1] * n, [NO_MASK] * n, lookahead=steps - 1)
    try:
        return Burst(io.device.launch(plan, steps), list(active))
    except DeviceError as e:
        fail_rows(active, io, e)
        return None


def settle_burst(burst: Burst, io: StepIo) -> None:
    """Await a burst and commit its steps in order; a row that finished (a stop, or an abort while the
    burst ran) has the rest of its tokens dropped."""
    try:
        results = io.device.await_burst(burst.ticket)
    except DeviceError as e:
        fail_rows(burst.rows, io, e)
        return
    rows = burst.rows
    for result in results:
        stopped = [s.finished for s in rows]
        for s, gone in zip(rows, stopped):
            if not gone:
                s.num_computed += 1
        commit_tokens(io, rows, result.tokens, result, stopped)

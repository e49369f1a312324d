"""The pipelined decode lane: launch ahead, settle, validate, drain (a port of the seed, same names).

While the device computes step t+1 (fed from t's tokens on the device), the host commits t. Then t+1
is validated against the state t's commit produced: rows that finished, whose last token differs from
the token they were fed, or whose length moved are over-runs and are discarded.
"""

from __future__ import annotations

import logging

import numpy as np

from metrale.ipc.errors import ErrorCode
from metrale.ipc.plan import FEED_HOST, DeviceError, DeviceLost, FedAheadPolicy

from .commit import commit_tokens
from .host_sampler import host_sample
from .pipeline import Inflight, Pipeline, PipelineFaults, Settled, ahead_allowed, fed_sources, row_mask
from .sequence import Sequence
from .step_io import ReadLogits, ReserveKv, Rollback, StepIo

log = logging.getLogger(__name__)

POISONED = (
    "a decode step launched ahead was fed an input the host did not commit; "
    "the model's recurrent state cannot be rewound"
)


def step_decode_pipelined(active: list[Sequence], pipeline: Pipeline, io: StepIo) -> None:
    """The plain decode step of a tick when the lane can run ahead."""
    active.sort(key=lambda s: s.slot_idx)  # slot order, as the synchronous step establishes it
    inf = pipeline.inflight
    if inf is not None:
        can_go_ahead = (
            not inf.host_logits
            and not inf.discard_all
            and not any(inf.discard)  # its discarded rows' device tokens are not the host's
            and rows_match(inf, active)
            and ahead_allowed(active, io.toks, pipeline.faults)
            and reserve_all(active, io)
        )
        if can_go_ahead and launch_ahead(active, pipeline, io):
            # t+1 is in flight; t is committed against the state it was launched from.
            settle(active, pipeline, io)
            return
        if settle(active, pipeline, io) != Settled.REDO:
            return
    # Nothing in flight, or the last step was discarded: launch now, and keep the step in flight
    # only when the next tick may launch ahead of it. A redo's reservations were rolled back; when
    # the pool cannot give them again, the next tick schedules (and preempts) first.
    if not reserve_all(active, io):
        return
    hold = ahead_allowed(active, io.toks, pipeline.faults)
    if launch_plain(active, pipeline, io) and not hold:
        settle(active, pipeline, io)


def launch_plain(active: list[Sequence], pipeline: Pipeline, io: StepIo) -> bool:
    """Launch one host-fed decode for every row and hold it in flight. False if the launch failed."""
    t0 = io.clock()
    masks = [row_mask(s, io.toks, io.eos_ids) for s in active]
    plan = io.builder.build(active, [1] * len(active), masks)
    try:
        ticket = io.device.launch(plan)
    except DeviceError as e:
        fail_rows(active, io, e)
        return False
    for s in active:  # launch bookkeeping: the position is written
        s.num_computed += 1
    pipeline.inflight = Inflight(
        ticket=ticket,
        t0=t0,
        rows=[(s.slot_idx, s.num_computed - 1) for s in active],
        masks=masks,
        inputs=None,
        discard=[False] * len(active),
    )
    return True


def rows_match(inf: Inflight, active: list[Sequence]) -> bool:
    """True when the step's rows are exactly the active rows, in the same order."""
    return len(inf.rows) == len(active) and all(slot == s.slot_idx for (slot, _), s in zip(inf.rows, active))


def reserve_all(active: list[Sequence], io: StepIo) -> bool:
    """Reserve every row's next KV slot before a launch that runs ahead of the host.

    False (a dry pool) means no launch ahead this tick; blocks reserved for earlier rows stay allocated
    (the next plain launch uses them).
    """
    pool = io.pool
    return all(io.apply(ReserveKv(s)) for s in active if pool.blocks_needed(s, s.num_computed + 1))


def launch_ahead(active: list[Sequence], pipeline: Pipeline, io: StepIo) -> bool:
    """Launch t+1 fed from t's device tokens. False when the launch failed; the caller then only settles t."""
    t0 = io.clock()
    n = len(active)
    # The masks t+1 picks under, predicted for after t's (ordinary) token; validate checks them.
    masks = [row_mask(s, io.toks, io.eos_ids, ahead=1) for s in active]
    plan = io.builder.build(active, [1] * n, masks, fed=True)
    try:
        ticket = io.device.launch(plan)
    except DeviceError as e:
        log.warning("ahead decode launch declined, settling first: %s", e)
        return False
    pipeline.next = Inflight(
        ticket=ticket,
        t0=t0,
        rows=[(s.slot_idx, s.num_computed) for s in active],
        masks=masks,
        inputs=fed_sources(n),
        discard=[False] * n,
    )
    return True


def settle(active: list[Sequence], pipeline: Pipeline, io: StepIo) -> Settled:
    """Await and commit the step in flight, then validate the one launched ahead of it (if any)."""
    inf = pipeline.inflight
    if inf is None:
        return Settled.IDLE
    pipeline.inflight = None
    assert rows_match(inf, active), "pipelined step settled against a different batch"
    try:
        result = io.device.await_result(inf.ticket)
    except DeviceError as e:
        # Every row is told, as the synchronous step does. A step launched ahead is awaited so its
        # slot is released, and dropped with the rows.
        if pipeline.next is not None:
            _await_quietly(io, pipeline.next)
            pipeline.next = None
        fail_rows(active, io, e)
        return Settled.FAILED
    device_tokens = np.array(result.tokens, dtype=np.int64)  # a copy: the result's slot is reused
    if inf.inputs is not None:  # over-runs hand their reserved block back before anything else
        for i, s in enumerate(active):
            if inf.discard_all or inf.discard[i]:
                io.apply(Rollback(s))
    if inf.discard_all:
        assert pipeline.next is None, "no step is launched ahead of a redo"
        return Settled.REDO
    tokens = device_tokens
    if inf.host_logits:
        try:
            logits = io.apply(ReadLogits(inf.ticket))
        except DeviceError as e:
            fail_rows(active, io, e)
            return Settled.FAILED
        masks = [row_mask(s, io.toks, io.eos_ids) for s in active]
        tokens = host_sample(logits, active, masks)
    commit_tokens(io, active, tokens, result, inf.discard)
    nxt = pipeline.next
    if nxt is not None:
        pipeline.next = None
        poisoned = validate_next(nxt, active, device_tokens, io, pipeline.faults)
        for i in poisoned:
            # A RepickOnly model ran this row from an input the host did not commit; its recurrent
            # state cannot be rewound, so the row fails. The other rows are unaffected.
            log.error("%s (request %s)", POISONED, active[i].request_id)
            active[i].finish("error", POISONED)
        pipeline.inflight = nxt
    return Settled.DONE


def validate_next(nxt: Inflight, active: list[Sequence], prev_tokens: np.ndarray, io: StepIo, faults: PipelineFaults) -> list[int]:
    """Decide which rows of the step launched ahead are over-runs and give the rest their launch bookkeeping.

    Returns the rows that are poisoned (RepickOnly over-runs that did not finish).
    """
    assert nxt.inputs is not None, "a step launched ahead is fed"
    assert rows_match(nxt, active), "pipelined step validated against a different batch"
    repick_only = io.device.model().fed_ahead_policy == FedAheadPolicy.REPICK_ONLY
    poisoned = []
    prev = prev_tokens.tolist()
    keep_overrun = faults.keep_overrun
    for i, (s, src, (_, written)) in enumerate(zip(active, nxt.inputs, nxt.rows)):
        fed = prev[src] if src != FEED_HOST else -1
        over_run = s.finished or s.tokens[-1] != fed or s.num_computed != written
        nxt.discard[i] = over_run and not keep_overrun
        if repick_only and nxt.discard[i] and not s.finished:
            poisoned.append(i)
    # The masks were fixed at launch; if a survivor's mask has changed, its pick is stale.
    stale = any(
        not nxt.discard[i] and row_mask(s, io.toks, io.eos_ids) != nxt.masks[i] for i, s in enumerate(active)
    )
    if repick_only:
        nxt.host_logits = stale  # the forward stands (its input was right); the host repicks
    else:
        nxt.discard_all = stale
    if not nxt.discard_all:
        for i, s in enumerate(active):  # the launch bookkeeping, for the rows whose launch was valid
            if not nxt.discard[i]:
                s.num_computed += 1
    return poisoned


def drain(active: list[Sequence], pipeline: Pipeline, io: StepIo) -> None:
    """Settle everything in flight: what a tick that needs the device quiet calls before it goes on."""
    while pipeline.has_inflight():
        if settle(active, pipeline, io) != Settled.DONE:
            break  # failed, or a redo: its rows are launched again by the next tick


def discard_row(pipeline: Pipeline, seq: Sequence) -> None:
    """Drop whatever is in flight for seq (it was aborted): none of its tokens will be committed."""
    for inf in (pipeline.inflight, pipeline.next):
        if inf is not None:
            for i, (slot, _) in enumerate(inf.rows):
                if slot == seq.slot_idx:
                    inf.discard[i] = True


def fail_rows(active: list[Sequence], io: StepIo, error: Exception) -> None:
    """Tell every row of a failed step: it finishes with the device's error.

    Under recovery a lost device fails nobody: the engine requeues the rows once the tick ends.
    """
    io.last_error = str(error)
    if io.recover and isinstance(error, DeviceLost):
        log.warning("device lost, its requests will be recomputed: %s", error)
        io.device_lost = str(error)
        return
    log.error("decode step failed: %s", error)
    for s in active:
        s.finish("error", str(error), ErrorCode.WORKER_FAULT)


def _await_quietly(io: StepIo, inf: Inflight) -> None:
    try:
        io.device.await_result(inf.ticket)
    except DeviceError:
        pass

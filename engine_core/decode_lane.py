"""The pipelined lane: launch ahead, settle, validate, drain (the seed's names), under churn.

While the device computes step t+1, the host commits step t. Step t+1 is scheduled while t is in flight and may
differ from it: every row of t that samples decodes again, fed from t's token on the device (no host round
trip); rows that t finishes are over-runs and are discarded; a running prefill goes on with its next chunk,
newly admitted requests join with their first chunk, and rows that t did not run join with their committed
input, all host-fed. Once t is committed, t+1 is validated against the state the commit produced: a fed row
that finished, whose last token differs from the token it was fed, or whose length moved is an over-run (its
reserved KV goes back at once); a row whose mask changed is stale (Rewind: discarded and run again; RepickOnly:
the forward stands and the host samples). Survivors get their launch bookkeeping (num_computed += 1); host-fed
rows got theirs at launch, since their inputs were committed.
"""

from __future__ import annotations

import logging

import numpy as np

from metrale.ipc.errors import ErrorCode
from metrale.ipc.plan import FEED_HOST, DeviceError, DeviceLost, FedAheadPolicy

from .commit import commit_tokens
from .host_sampler import repick
from .pipeline import Inflight, Pipeline, Settled, row_mask
from .scheduler import ScheduledStep
from .sequence import Sequence
from .step_io import ReadLogits, Rollback, StepIo

log = logging.getLogger(__name__)

POISONED = (
    "a decode step launched ahead was fed an input the host did not commit; "
    "the model's recurrent state cannot be rewound"
)


def launch(step: ScheduledStep, pipeline: Pipeline, io: StepIo, *, ahead: bool = False) -> Inflight | None:
    """Launch a scheduled step (its fed rows take their input from the step in flight) and return it in
    flight; None when the launch failed (a step launched ahead is then simply not run; otherwise every row is
    told). Host-fed rows get their launch bookkeeping now; fed rows get theirs when validated."""
    t0 = io.clock()
    seqs, num_new, feed = step.seqs, step.num_new, step.fed_from
    # A fed row's mask is predicted for after t's (ordinary) token; validate checks it.
    masks = [row_mask(s, io.toks, io.eos_ids, ahead=int(src != FEED_HOST)) for s, src in zip(seqs, feed)]
    plan = io.builder.build(seqs, num_new, masks, feed=feed if ahead else None)
    try:
        ticket = io.device.launch(plan)
    except DeviceError as e:
        if ahead:
            log.warning("a step launched ahead was declined, settling first: %s", e)
        else:
            fail_rows(seqs, io, e)
        return None
    written = [s.num_computed for s in seqs]
    for s, k, src in zip(seqs, num_new, feed):
        if src == FEED_HOST:
            s.num_computed += k
    return Inflight(
        ticket=ticket,
        t0=t0,
        seqs=list(seqs),
        num_new=list(num_new),
        written=written,
        samples=[bool(x) for x in plan.sample],
        masks=masks,
        fed_from=list(feed),
        discard=[False] * len(seqs),
    )


def settle(pipeline: Pipeline, io: StepIo) -> Settled:
    """Await and commit the step in flight, then validate the one launched ahead of it (if any), which is
    then the step in flight."""
    inf = pipeline.inflight
    if inf is None:
        return Settled.IDLE
    pipeline.inflight = None
    nxt, pipeline.next = pipeline.next, None
    try:
        result = io.device.await_result(inf.ticket)
    except DeviceError as e:
        # Every row is told, as the synchronous step does. A step launched ahead is awaited so its
        # slot is released, and dropped with the rows.
        if nxt is not None:
            _await_quietly(io, nxt)
        fail_rows(_live(inf.seqs, nxt), io, e)
        return Settled.FAILED
    device_tokens = np.array(result.tokens, dtype=np.int64)  # a copy: the result's slot is reused
    tokens = device_tokens
    if inf.host_logits:
        try:
            logits = io.apply(ReadLogits(inf.ticket))
        except DeviceError as e:
            fail_rows(inf.seqs, io, e)
            return Settled.FAILED
        tokens = repick(logits, inf, result, io)  # RepickOnly repair: the pick under each row's mask as it is now
    commit_tokens(io, inf.seqs, tokens, result, inf.discard)
    if nxt is not None:
        poisoned = validate_next(nxt, device_tokens, io)
        for s in poisoned:
            # A RepickOnly model ran this row from an input the host did not commit; its recurrent
            # state cannot be rewound, so the row fails. The other rows are unaffected.
            log.error("%s (request %s)", POISONED, s.request_id)
            s.finish("error", POISONED)
        pipeline.inflight = nxt
    return Settled.DONE


def validate_next(nxt: Inflight, prev_tokens: np.ndarray, io: StepIo) -> list[Sequence]:
    """Decide which rows of the step launched ahead are over-runs or stale, give back their reserved KV, and
    give the fed survivors their launch bookkeeping. Returns the rows that are poisoned (RepickOnly over-runs
    that did not finish)."""
    repick_only = io.device.model().fed_ahead_policy == FedAheadPolicy.REPICK_ONLY
    poisoned = []
    fed_tokens = prev_tokens.tolist()
    stale = False
    for i, (s, src, written) in enumerate(zip(nxt.seqs, nxt.fed_from, nxt.written)):
        if src == FEED_HOST:
            nxt.discard[i] = s.finished  # its input was committed; only an abort or a stop ends it
            continue
        over_run = s.finished or s.tokens[-1] != fed_tokens[src] or s.num_computed != written
        if over_run:
            nxt.discard[i] = True
            if repick_only and not s.finished:
                poisoned.append(s)
        elif not s.plain and row_mask(s, io.toks, io.eos_ids) != nxt.masks[i]:  # picked under a mask now stale
            if repick_only:
                stale = True  # the forward stands (its input was right); the host repicks every row
            else:
                nxt.discard[i] = True  # it runs again, host-fed, with the mask it has now
        if nxt.discard[i]:
            # The device still writes this row's KV, into the reserved slot: given back now, it can only
            # be reused by a later step, which the device runs after this one.
            io.apply(Rollback(s))
        else:
            s.num_computed += 1
    nxt.host_logits = stale
    return poisoned


def drain(pipeline: Pipeline, io: StepIo) -> None:
    """Settle everything in flight: what a tick that needs the device quiet calls before it goes on."""
    while pipeline.has_inflight():
        if settle(pipeline, io) != Settled.DONE:
            break


def discard_row(pipeline: Pipeline, seq: Sequence) -> None:
    """Drop whatever is in flight for seq (it was aborted): none of its tokens will be committed."""
    for inf in (pipeline.inflight, pipeline.next):
        if inf is not None:
            for i, s in enumerate(inf.seqs):
                if s is seq:
                    inf.discard[i] = True


def fail_rows(seqs: list[Sequence], io: StepIo, error: Exception) -> None:
    """Tell every row of a failed step: it finishes with the device's error.

    Under recovery a lost device fails nobody: the engine requeues the rows once the tick ends.
    """
    io.last_error = str(error)
    if io.recover and isinstance(error, DeviceLost):
        log.warning("device lost, its requests will be recomputed: %s", error)
        io.device_lost = str(error)
        return
    log.error("decode step failed: %s", error)
    for s in seqs:
        s.finish("error", str(error), ErrorCode.WORKER_FAULT)


def _live(seqs: list[Sequence], nxt: Inflight | None) -> list[Sequence]:
    """The rows of a failed step and of the one launched behind it, each once."""
    if nxt is None:
        return seqs
    seen = set(map(id, seqs))
    return seqs + [s for s in nxt.seqs if id(s) not in seen]


def _await_quietly(io: StepIo, inf: Inflight) -> None:
    try:
        io.device.await_result(inf.ticket)
    except DeviceError:
        pass

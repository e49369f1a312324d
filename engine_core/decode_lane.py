"""The lane: one launch and one settle for every kind of step; launch ahead, validate, drain (the seed's names).

Every step (StepKind: a STEP of prefill chunks and decodes, a BURST of decode steps, a VERIFY of drafts) goes
through `launch` (masks, plan, device launch; its rows hold their positions in flight) and `settle` (await,
advance num_computed, commit); the synchronous loop is the same lane at depth 0 (settled in the tick that
launched it), the pipelined loop keeps a STEP in flight and launches the next one ahead of it.

While the device computes step t+1, the host commits step t. Step t+1 is scheduled while t is in flight and may
differ from it: every row of t that samples decodes again, fed from t's token on the device (no host round
trip); rows that t finishes are over-runs and are discarded; a running prefill goes on with its next chunk,
newly admitted requests join with their first chunk, and rows that t did not run join with their committed
input, all host-fed. Once t is committed, t+1 is validated against the state the commit produced: a fed row
that finished, whose last token differs from the token it was fed, or whose length moved is an over-run (its
reserved KV goes back at once); a row whose mask changed is stale (Rewind: discarded and run again; RepickOnly:
the forward stands and the device picks again from the logits it kept, under the masks as they are now). A
discarded row gives its positions in flight back at once and runs again host-fed from num_computed; a row's
num_computed moves only when its own step is settled.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from metrale.ipc.errors import ErrorCode
from metrale.ipc.plan import FEED_HOST, DeviceError, DeviceLost, FedAheadPolicy, StepKind

from .commit import commit_pooled, commit_prompt_logprobs, commit_tokens
from .pipeline import NO_MASK, Inflight, Pipeline, Settled, row_mask
from .scheduler import ScheduledStep
from .sequence import Sequence
from .step_io import StepIo

log = logging.getLogger(__name__)

POISONED = (
    "a decode step launched ahead was fed an input the host did not commit; "
    "the model's recurrent state cannot be rewound"
)


def launch(step: ScheduledStep, pipeline: Pipeline, io: StepIo, *, ahead: bool = False) -> Inflight | None:
    """Launch a step of any kind and return it in flight: the one launch path (depth 0 is the same launch,
    settled in the same tick). None when the launch failed (a step launched ahead is then simply not run;
    otherwise every row is told). Every row holds its positions in flight (num_inflight) until it is settled
    or discarded; num_computed moves only in settle."""
    seqs, num_new, feed, kind = step.seqs, step.num_new, step.fed_from, step.kind
    masks = [NO_MASK] * len(seqs)  # a plain row's always (burst rows are plain)
    starts = None
    if step.goes_on:  # its first rows are plain and their starts known; the rest were admitted behind them
        head = len(step.starts)
        starts = step.starts if head == len(seqs) else \
            step.starts.tolist() + [s.num_computed + s.num_inflight for s in seqs[head:]]
        for i in [i for i, s in enumerate(seqs[head:], head) if not s.req.plain]:
            masks[i] = row_mask(seqs[i], io.toks, io.eos_ids)
    elif kind != StepKind.BURST:
        # A fed row's mask is predicted for after t's (ordinary) token; validate checks it.
        for i in [i for i, s in enumerate(seqs) if not s.req.plain]:
            masks[i] = row_mask(seqs[i], io.toks, io.eos_ids, ahead=int(feed[i] != FEED_HOST))
    plan = io.builder.build(seqs, num_new, masks, feed=feed if ahead else None, lookahead=step.steps - 1,
                            drafts=step.drafts, starts=starts)
    try:
        ticket = io.device.launch(plan, kind, step.steps)
    except DeviceError as e:
        if ahead:
            log.warning("a step launched ahead was declined, settling first: %s", e)
        else:
            fail_rows(seqs, io, e)
        # The builder took the swap copies for this plan: the swap-outs (of sequences parked meanwhile) ride the
        # next plan; so do the swap-ins of rows that will run again (not of rows that just failed).
        keep_in = ahead or io.device_lost is not None
        io.builder.swap.put_back(plan.swap_out, plan.swap_in if keep_in else plan.swap_in[:0])
        return None
    # Each row's num_launched, which the plan's seq_lens are num_new past (its first step's).
    R = len(seqs)
    if num_new.count(1) == R:
        written = (plan.seq_lens - 1).tolist()
    else:
        written = [end - k for end, k in zip(plan.seq_lens.tolist(), num_new)]
    held = num_new if step.steps == 1 else [k * step.steps for k in num_new]
    for s, k in zip(seqs, held):
        s.num_inflight += k
    return Inflight(
        ticket=ticket,
        kind=kind,
        seqs=list(seqs),
        num_new=list(num_new),
        written=written,
        held=list(held),
        samples=plan.sample.tolist(),
        masks=masks,
        fed_from=list(feed),
        discard=[False] * len(seqs),
        drafts=step.drafts,
        prompt_lp=plan.prompt_lp_count.copy() if plan.prompt_lp_count.any() else None,
        pool=plan.pool.copy() if plan.pool.any() else None,
        goes_on=step.goes_on,
    )


def settle(pipeline: Pipeline, io: StepIo) -> Settled:
    """Await and commit the step in flight, then validate the one launched ahead of it (if any), which is
    then the step in flight."""
    inf = pipeline.inflight
    if inf is None:
        return Settled.IDLE
    # Awaited now, whatever follows; the step launched ahead stays in `next` until it is validated, so a failure
    # on the way (an exception the tick's containment catches) leaves it for abandon() to await and release.
    pipeline.inflight = None
    nxt = pipeline.next
    try:
        try:
            results = _await(io, inf)
        except DeviceError as e:
            # Every row is told, as the synchronous step does. A step launched ahead is awaited so its
            # slot is released, and dropped with the rows.
            pipeline.next = None
            if nxt is not None:
                _await_quietly(io, nxt)
                _release(nxt)
            fail_rows(_live(inf.seqs, nxt), io, e)
            return Settled.FAILED
        if inf.kind != StepKind.STEP:
            _commit_picks(inf, results, io)
            return Settled.DONE
        result = results[0]
        device_tokens = np.array(result.tokens, dtype=np.int64)  # a copy: the result's slot is reused
        tokens = device_tokens
        if inf.repick:  # nothing is launched ahead of a step to repick
            try:
                result = _repick(inf, result, io)
            except DeviceError as e:
                fail_rows(inf.seqs, io, e)
                return Settled.FAILED
            tokens = np.array(result.tokens, dtype=np.int64)
        # Settled: each row's positions leave num_inflight (a discarded row's already did) and, kept, join num_computed.
        for s, k, h, gone in zip(inf.seqs, inf.num_new, inf.held, inf.discard):
            s.num_inflight -= h
            if not gone:
                s.num_computed += k
        inf.held = [0] * len(inf.held)
        ended = commit_tokens(io, inf.seqs, tokens, result, inf.discard)
        if inf.prompt_lp is not None:
            commit_prompt_logprobs(inf.seqs, inf.written, inf.prompt_lp, result, inf.discard)
        if inf.pool is not None:
            commit_pooled(inf.seqs, inf.written, inf.pool, result, inf.discard)
    finally:
        _release(inf)  # its positions are settled or gone (a no-op once given back)
    if nxt is not None and nxt.goes_on and ended == 0 and True not in inf.discard and True not in nxt.discard \
            and [s.out.tokens[-1] for s in inf.seqs] == device_tokens.tolist():
        # Every row of t committed the token its successor was fed, none finished or was dropped: nothing of the
        # step launched ahead is an over-run or stale (its fed rows are plain; rows admitted behind them host-fed).
        pipeline.inflight, pipeline.next = nxt, None
    elif nxt is not None:
        poisoned = validate_next(nxt, device_tokens, io)
        for s in poisoned:
            # A RepickOnly model ran this row from an input the host did not commit; its recurrent
            # state cannot be rewound, so the row fails. The other rows are unaffected.
            log.error("%s (request %s)", POISONED, s.request_id)
            s.finish("error", POISONED)
        pipeline.inflight, pipeline.next = nxt, None
    return Settled.DONE


def _repick(inf: Inflight, result, io: StepIo):
    """A RepickOnly repair of a settled step: its sampling rows picked again by the device, from the logits it kept,
    under each row's mask as it is now (the commits before it changed some); the step's result with those picks
    (and their logprobs). Counted in io.repicks."""
    # A discarded row's pick is never committed: no mask (a finished grammar has no next tokens to ask for).
    masks = [NO_MASK if gone else row_mask(s, io.toks, io.eos_ids) for s, gone in zip(inf.seqs, inf.discard)]
    ends = [w + k for w, k in zip(inf.written, inf.num_new)]
    again = io.device.resample(inf.ticket, io.builder.resample(inf.seqs, masks, ends, inf.samples))
    io.repicks += sum(smp and not gone for smp, gone in zip(inf.samples, inf.discard))
    # A new result: the step's own (its prompt logprobs, pooled rows) with the repicked tokens and their logprobs.
    return dataclasses.replace(
        result, tokens=again.tokens, logprobs=again.logprobs, top_ids=again.top_ids, top_logprobs=again.top_logprobs
    )


def _commit_picks(inf: Inflight, results: list, io: StepIo) -> None:
    """Commit a BURST's steps, or a VERIFY's picks, in order: one position per pick; a row that stopped (a stop,
    an abort while it ran, or a VERIFY row out of picks) has the rest dropped. A VERIFY gives back the KV reserved
    for its rejected drafts (positions past num_computed) and records each row's committed picks."""
    rows = inf.seqs
    kept = np.zeros(len(rows), dtype=np.int64)
    for result in results:
        gone = [d or s.out.finish_reason is not None or tok < 0
                for s, d, tok in zip(rows, inf.discard, result.tokens.tolist())]
        for i, (s, g) in enumerate(zip(rows, gone)):
            if not g:
                s.num_computed += 1
                kept[i] += 1
        commit_tokens(io, rows, result.tokens, result, gone)
    if inf.kind == StepKind.VERIFY:
        for s, d in zip(rows, inf.drafts):
            if d:
                io.pool.trim(s, s.num_computed)
        inf.kept = kept.tolist()


def validate_next(nxt: Inflight, prev_tokens: np.ndarray, io: StepIo) -> list[Sequence]:
    """Decide which rows of the step launched ahead are over-runs or stale and give back their reserved KV and
    their positions in flight (they run again, host-fed, from num_computed). Returns the rows that are poisoned
    (RepickOnly over-runs that did not finish)."""
    repick_only = io.device.model().fed_ahead_policy == FedAheadPolicy.REPICK_ONLY
    poisoned = []
    fed_tokens = prev_tokens.tolist()
    stale = False
    for i, (s, src, written) in enumerate(zip(nxt.seqs, nxt.fed_from, nxt.written)):
        finished = s.out.finish_reason is not None
        if src == FEED_HOST:
            if finished:  # its input was committed; only an abort or a stop ends it
                _drop(nxt, i)
            continue
        if finished or s.out.tokens[-1] != fed_tokens[src] or s.num_computed != written:  # an over-run
            nxt.discard[i] = True
            if repick_only and not finished:
                poisoned.append(s)
        elif not s.req.plain and row_mask(s, io.toks, io.eos_ids) != nxt.masks[i]:  # picked under a mask now stale
            if repick_only:
                stale = True  # the forward stands (its input was right); the device repicks every row
            else:
                nxt.discard[i] = True  # it runs again, host-fed, with the mask it has now
        if nxt.discard[i]:
            # The device still writes this row's KV, into the reserved slot: given back now, it can only
            # be reused by a later step, which the device runs after this one.
            _drop(nxt, i)
            io.pool.trim(s, s.num_computed)
    nxt.repick = stale
    return poisoned


def drain(pipeline: Pipeline, io: StepIo) -> None:
    """Settle everything in flight: what a tick that needs the device quiet calls before it goes on."""
    while pipeline.has_inflight():
        if settle(pipeline, io) != Settled.DONE:
            break


def abandon(pipeline: Pipeline, io: StepIo | None) -> None:
    """Drop every step in flight, nothing committed: awaited first, so the device's slots are free again (io None:
    the device is gone with what it ran, nothing to await)."""
    for inf in (pipeline.inflight, pipeline.next):
        if inf is not None:
            if io is not None:
                _await_quietly(io, inf)
            _release(inf)
    pipeline.inflight = pipeline.next = None


def discard_row(pipeline: Pipeline, seq: Sequence) -> None:
    """Drop whatever is in flight for seq (it was aborted): none of its tokens will be committed."""
    for inf in (pipeline.inflight, pipeline.next):
        if inf is not None:
            for i, s in enumerate(inf.seqs):
                if s is seq:
                    _drop(inf, i)


def _drop(inf: Inflight, i: int) -> None:
    """Row i of inf is discarded: nothing of it is committed and its positions in flight are given back."""
    inf.discard[i] = True
    inf.seqs[i].num_inflight -= inf.held[i]
    inf.held[i] = 0


def _release(inf: Inflight) -> None:
    """inf is settled or dropped: its rows no longer hold positions in flight."""
    if inf.held.count(0) == len(inf.held):  # given back already (a settled STEP gives its rows' back as it commits)
        return
    for s, k in zip(inf.seqs, inf.held):
        s.num_inflight -= k
    inf.held = [0] * len(inf.held)


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


def _await(io: StepIo, inf: Inflight) -> list:
    """inf's results: one for a STEP, one per step for a BURST or a VERIFY."""
    return [io.device.await_result(inf.ticket)] if inf.kind == StepKind.STEP else io.device.await_burst(inf.ticket)


def _await_quietly(io: StepIo, inf: Inflight) -> None:
    """Await a step whose outcome no longer matters (its slot is free again); whatever it raises is dropped."""
    try:
        _await(io, inf)
    except Exception:  # noqa: BLE001 - the step is dropped either way
        pass

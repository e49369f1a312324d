"""Beam search in the engine: a request of beam_width rows that move together, forking KV blocks by reference.

A `BeamGroup` is one prompt's search (metrale/beam_search.py's `BeamSearch`, transformers' rules, which runs no
model) and its W beam rows: sequences the scheduler runs as it runs any, each request's `Request.beam` naming the
group. A live beam row decodes its last token with greedy params asking for the search's top alternatives; its
commit (commit.py) hands those to the group instead of appending the token, which leaves the row with nothing to
compute, so it idles until the group moves. When every live beam has its alternatives, `BeamSearch.advance` picks
the next beams, each continuing a parent row with one token:

- the first child of a parent takes the parent's row as it is (its blocks, its last partial block included) and
  appends its token: a decode, nothing recomputed;
- another child takes a row whose beam was dropped (or one not used yet): that row gives back its blocks, takes
  the parent's tokens and its token, and shares the parent's full blocks by reference count (the pool's, which
  the prefix cache uses too); the rest of the parent's last block is computed again as a small prefill chunk
  with the child's decode (Scheduler.seat_fork).

So every live beam of every search decodes in the same step beside other requests, pipelined or not: a beam row
is never fed ahead of its commit (its next input is the search's choice), it joins the step after. Preemption,
recovery and failure containment see beam rows as rows; a beam row preempted after its commit recomputes (the
same alternatives come again). The search ends as `BeamSearch` says; its one delta carries the hypotheses
(`RequestOutputDelta.beams`). An abort, or an error ending any of its rows, ends the whole search at once, every
row's blocks given back.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from metrale.beam_search import BeamSearch
from metrale.ipc.errors import ErrorCode
from metrale.ipc.messages import BeamHypothesis, RequestOutputDelta
from metrale.ipc.plan import StepResult

from .decode_lane import discard_row
from .pipeline import Pipeline
from .scheduler import Scheduler
from .sequence import Sequence, SeqStatus


@dataclass(eq=False)
class BeamGroup:
    """One prompt's beam search and its rows: rows[i] holds live beam i (search.beams[i]); spare rows after them."""

    request_id: str
    search: BeamSearch
    rows: list[Sequence] = field(default_factory=list)
    top_ids: np.ndarray = field(default=None)  # [W, k] this round's alternatives of each live beam
    top_logprobs: np.ndarray = field(default=None)
    got: list[bool] = field(default_factory=list)  # live beam i's alternatives are in
    num_got: int = 0

    def __post_init__(self) -> None:
        w, k = self.search.params.beam_width, self.search.num_logprobs
        self.top_ids = np.zeros((w, k), np.int64)
        self.top_logprobs = np.zeros((w, k), np.float32)
        self.got = [False] * w

    def take(self, seq: Sequence, result: StepResult, r: int) -> None:
        """Row r of a settled step was seq's decode: keep its top alternatives for this round (commit.py)."""
        i = self.rows.index(seq)
        k = self.search.num_logprobs
        if result.top_ids is None or result.top_logprobs is None:
            seq.finish("error", "the device returned no alternatives for a beam row", ErrorCode.INTERNAL)
            return
        self.top_ids[i] = result.top_ids[r, :k]
        self.top_logprobs[i] = result.top_logprobs[r, :k]
        if not self.got[i]:
            self.got[i] = True
            self.num_got += 1

    @property
    def ready(self) -> bool:
        return self.num_got == len(self.search.beams)


class BeamGroups:
    """The engine's beam searches: each tick, moves those whose live beams all committed, ends those that are done,
    aborted or failed."""

    def __init__(self, scheduler: Scheduler, pipeline: Pipeline) -> None:
        self.scheduler = scheduler
        self.pipeline = pipeline
        self.groups: dict[str, BeamGroup] = {}
        self._outputs: list[RequestOutputDelta] = []

    def add(self, group: BeamGroup) -> None:
        """Start a search: its first row (the prompt) queued as any request."""
        self.groups[group.request_id] = group
        self.scheduler.add(group.rows[0])

    def tick(self) -> list[RequestOutputDelta]:
        """Move every group whose beams are in, end those that finished or failed; the deltas of ended ones."""
        for g in list(self.groups.values()):
            failed = next((s for s in g.rows if s.finished), None)
            if failed is not None:
                self._end(g, failed.out.finish_reason, failed.out.error, failed.out.error_code)
            elif g.ready:
                self._advance(g)
        out, self._outputs = self._outputs, []
        return out

    def abort(self, request_id: str) -> bool:
        """End a search now (its delta says "abort"); False when no search has this id."""
        g = self.groups.get(request_id)
        if g is None:
            return False
        self._end(g, "abort")
        return True

    def fail_all(self, message: str, code: ErrorCode) -> None:
        """End every search with this error (the engine's fail_running)."""
        for g in list(self.groups.values()):
            self._end(g, "error", message, code)

    def _advance(self, g: BeamGroup) -> None:
        search, rows = g.search, g.rows
        n = len(search.beams)
        parents_rows = rows[:n]
        for s in parents_rows:
            self._quiet(s)
        beams = search.advance(g.top_ids[:n], g.top_logprobs[:n])
        g.got = [False] * len(g.got)
        g.num_got = 0
        if search.done:
            self._end(g, "stop")
            return
        parents = search.parents
        taken = [False] * n  # parent i's row went to its first child
        first = []
        for p in parents:
            first.append(not taken[p])
            taken[p] = True
        spare = [rows[i] for i in range(n) if not taken[i]] + rows[n:]
        new_rows: list[Sequence] = []
        heirs: list[tuple[Sequence, int]] = []
        for beam, p, own in zip(beams, parents, first):
            parent = parents_rows[p]
            if own:
                new_rows.append(parent)
                heirs.append((parent, beam.output_ids[-1]))
                continue
            seq = spare.pop(0)
            self.scheduler.release(seq)
            _retoken(seq, parent.out.tokens, beam.output_ids[-1])
            self.scheduler.seat_fork(seq, parent)
            new_rows.append(seq)
        for seq, tok in heirs:  # after the forks, which copied the parents' tokens
            seq.out.tokens.append(tok)
            if seq.status == SeqStatus.IDLE:  # released for room after its step: queued again, to compute it all
                self.scheduler.add(seq)
        for seq in spare:
            self.scheduler.release(seq)
        g.rows = new_rows + spare

    def _quiet(self, seq: Sequence) -> None:
        """Drop whatever is in flight for seq (a row recomputing after a preemption): the group is moving it."""
        if seq.num_inflight:
            discard_row(self.pipeline, seq)

    def _end(self, g: BeamGroup, reason: str, error: str | None = None, code: ErrorCode | None = None) -> None:
        """Finish every row (blocks given back now) and queue the search's one delta."""
        del self.groups[g.request_id]
        for seq in g.rows:
            self._quiet(seq)
            self.scheduler.release(seq)
            seq.finish("abort")
        first = g.rows[0]
        beams = None
        if reason == "stop":
            beams = [BeamHypothesis(s.output_ids, s.logprobs, s.cum_logprob, s.score, s.finish_reason)
                     for s in g.search.results()]
        self._outputs.append(RequestOutputDelta(
            g.request_id, [], reason, None, error, code.value if code is not None and reason == "error" else None,
            first.num_cached_tokens, None, None, first.queued_s, beams))


def _retoken(seq: Sequence, prefix, token: int) -> None:
    """seq's tokens become prefix (a parent's prompt and output) and token."""
    tokens = array("i", prefix)
    tokens.append(token)
    seq.out.tokens = tokens

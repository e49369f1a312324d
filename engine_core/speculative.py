"""Speculative decoding: draft tokens proposed on the host, verified by the model in one step (a StepKind.VERIFY,
shaped by step_kinds.py). The device samples each drafted position with the row's own rule and keeps the picks up to
the first that differs from the next draft, so greedy and seeded outputs equal decoding without drafts; the lane
commits them in order and gives back the rejected drafts' KV. Only plain rows are drafted. Drafts come from a
`Proposer`; `NgramProposer` is prompt lookup. docs/architecture.md, "Speculative decoding".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .pipeline import Inflight
from .sequence import Sequence


class Proposer(Protocol):
    """Proposes draft tokens for the next positions of a sequence."""

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k draft tokens to follow seq's committed tokens ([] for none)."""
        ...


@dataclass(slots=True)
class NgramProposer:
    """Prompt lookup: match the last n tokens (n from max_n down to min_n) at their latest earlier occurrence in
    the sequence's tokens and propose the k tokens that followed it."""

    max_n: int = 3
    min_n: int = 1

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.tokens
        length = len(tokens)
        window = min(length, 4096)  # the recent context: a lookup stays cheap on long sequences
        context = np.asarray(tokens[length - window :], dtype=np.int64)
        for n in range(min(self.max_n, window - 1), self.min_n - 1, -1):
            tail = context[window - n :]
            # Every earlier start of an n-gram that leaves at least one token to propose.
            grams = np.lib.stride_tricks.sliding_window_view(context[: window - 1], n)
            hits = np.flatnonzero((grams == tail).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return context[start : start + k].tolist()
        return []


@dataclass(slots=True)
class SpecStats:
    """Drafted and accepted tokens since start (the acceptance rate's parts)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0


class Speculator:
    """Drafts for a decode step and runs it as a verify step."""

    def __init__(self, proposer: Proposer, num_tokens: int, max_model_len: int,
                 disable_by_batch_size: int | None = None) -> None:
        self.proposer = proposer
        self.k = num_tokens
        self.max_model_len = max_model_len
        # A verify step's k + 1 rows per request cost more than a decode step's one: past this many running rows
        # the drafts no longer pay (None: speculate at any batch).
        self.disable_by_batch_size = disable_by_batch_size
        self.stats = SpecStats()

    def drafts(self, seqs: list[Sequence]) -> list[list[int]] | None:
        """Each row's drafts for a decode step of these rows; None when no row has one, or when the step has
        disable_by_batch_size rows or more."""
        if self.disable_by_batch_size is not None and len(seqs) >= self.disable_by_batch_size:
            return None
        out = [self._draft(s) for s in seqs]
        return out if any(out) else None

    def _draft(self, seq: Sequence) -> list[int]:
        """A plain row's drafts, within its max_tokens and the model's length (a draft past either is waste)."""
        if not seq.req.plain or seq.finished:
            return []
        room = min(self.k, seq.params.max_tokens - seq.num_output - 1, self.max_model_len - seq.num_tokens - 1)
        return self.proposer.propose(seq, room) if room > 0 else []

    def record(self, inf: Inflight) -> None:
        """Count a settled verify step: its drafts, and the ones kept (picks beyond each drafted row's first)."""
        self.stats.steps += 1
        for d, kept in zip(inf.drafts, inf.kept):
            if d:
                self.stats.drafted += len(d)
                self.stats.accepted += max(kept - 1, 0)

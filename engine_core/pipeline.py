"""The pipelined decode lane's state and policy: what is in flight, row masks, and when to run ahead.

The lane itself (launch ahead, settle, validate, drain) is in decode_lane.py, as in the seed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from metrale.ipc.plan import MASK_BAN, MASK_FORCE, MASK_GRAMMAR, MASK_GREEDY, MASK_NONE, Ticket

from .sequence import Sequence


class Settled(enum.Enum):
    DONE = "done"  # committed; the step launched ahead (if any) is now in flight
    FAILED = "failed"  # the device failed; every row was told
    IDLE = "idle"  # nothing was in flight
    REDO = "redo"  # the step was discarded whole: launch the rows again


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """Token ids that change a row's mask; None where the tokenizer has no such token."""

    think_start: int | None = None
    think_end: int | None = None
    code_fence: int | None = None
    tool_call_start: int | None = None
    tool_call_end: int | None = None


@dataclass(frozen=True, slots=True)
class RowMask:
    """What constrains a row's next pick: the MASK_* bits, the forced token, the banned ids, and for a grammar
    row the number of output tokens its matcher had accepted when its bitmask was made (grammar.py)."""

    kind: int = MASK_NONE
    force_token: int = -1
    ban: tuple[int, ...] = ()
    grammar_at: int = -1


NO_MASK = RowMask()


@dataclass(slots=True)
class PipelineFaults:
    """Faults a test injects to show which check makes the lane correct."""

    keep_overrun: bool = False  # commit over-run rows as if their launch had been valid
    ignore_ahead_allowed: bool = False  # launch ahead even when a mask could go stale
    # The host commits a token other than the device's: (request id, output index) gets token + 1.
    rewrite_commit: tuple[str, int] | None = None


@dataclass(slots=True)
class Inflight:
    """A launched step and what the host knew when it launched it."""

    ticket: Ticket
    t0: float
    rows: list[tuple[int, int]]  # (slot_idx, position written) per row, in slot order
    masks: list[RowMask]
    inputs: list[int] | None  # feed sources (FEED_HOST or a row of the previous step); None: host-fed
    discard: list[bool]
    discard_all: bool = False
    host_logits: bool = False


@dataclass(slots=True)
class Pipeline:
    """At most two steps in flight: the one being settled, and the one launched ahead of it."""

    inflight: Inflight | None = None
    next: Inflight | None = None
    faults: PipelineFaults = field(default_factory=PipelineFaults)

    def has_inflight(self) -> bool:
        return self.inflight is not None


def row_mask(seq: Sequence, toks: SpecialTokens, eos_ids: tuple[int, ...], ahead: int = 0) -> RowMask:
    """The mask of seq's next pick; ahead=1 asks for the pick after that, assuming an ordinary token."""
    if seq.plain:
        return NO_MASK
    p = seq.params
    if (
        p.max_thinking_tokens is not None
        and toks.think_end is not None
        and seq.in_think
        and seq.think_tokens + ahead >= p.max_thinking_tokens
    ):
        return RowMask(MASK_FORCE, toks.think_end)
    kind = MASK_NONE
    ban: tuple[int, ...] = ()
    if p.min_tokens and seq.num_output + ahead < p.min_tokens:
        kind |= MASK_BAN
        ban = tuple(dict.fromkeys((*eos_ids, *p.stop_token_ids)))
    if p.adaptive_sampling and (seq.in_fence or seq.in_tool):
        kind |= MASK_GREEDY
    # A grammar's bitmask is made from the matcher as it is: one launched ahead is made a token early (stale).
    grammar_at = -1
    if seq.grammar is not None:
        kind |= MASK_GRAMMAR
        grammar_at = seq.grammar.accepted
    return RowMask(kind, -1, ban, grammar_at) if kind else NO_MASK


def is_plain(seq: Sequence) -> bool:
    """True when seq's params make every mask NO_MASK, need no penalties and read no row state (so nothing
    mask_may_change looks at applies either)."""
    p = seq.params
    return not (p.has_penalties or p.min_tokens or p.adaptive_sampling or p.max_thinking_tokens is not None
                or p.structured_outputs is not None)


def mask_may_change(seq: Sequence, toks: SpecialTokens) -> bool:
    """True when the value of the token in flight could change seq's next mask (so no running ahead)."""
    p = seq.params
    if seq.grammar is not None:  # the next bitmask is the matcher's after that token
        return True
    if p.max_thinking_tokens is not None and (toks.think_start is not None or toks.think_end is not None):
        return True
    return p.adaptive_sampling and any(
        t is not None for t in (toks.code_fence, toks.tool_call_start, toks.tool_call_end)
    )


def ahead_allowed(active: list[Sequence], toks: SpecialTokens, faults: PipelineFaults) -> bool:
    """True when t+1 may be launched before t is committed: no row needs t's token on the host.

    Penalties need the row's full history (t's token included) and a thinking budget or adaptive
    sampling make the next mask depend on t's token; such rows settle before they launch again.
    """
    if faults.ignore_ahead_allowed:
        return True
    return not any(not s.plain and (s.params.has_penalties or mask_may_change(s, toks)) for s in active)


def update_row_state(seq: Sequence, token: int, toks: SpecialTokens) -> None:
    """Advance the per-row state behind the masks past a committed token (a plain row's is never read)."""
    if seq.plain:
        return
    if token == toks.think_start:
        seq.in_think, seq.think_tokens = True, 0
    elif token == toks.think_end:
        seq.in_think = False
    elif seq.in_think:
        seq.think_tokens += 1
    if token == toks.code_fence:
        seq.in_fence = not seq.in_fence
    elif token == toks.tool_call_start:
        seq.in_tool = True
    elif token == toks.tool_call_end:
        seq.in_tool = False


def init_row_state(seq: Sequence, toks: SpecialTokens) -> None:
    """Set the row state from the prompt (a template may open <think> or a fence for the model)."""
    seq.plain = is_plain(seq)
    seq.in_think = seq.in_fence = seq.in_tool = False
    seq.think_tokens = 0
    for i, token in enumerate(seq.tokens):
        update_row_state(seq, token, toks)
        if i < seq.num_prompt:
            seq.think_tokens = 0  # the budget counts generated thinking only


def fed_sources(n: int) -> list[int]:
    """Feed every row of a step launched ahead from the same row of the step before it."""
    return list(range(n))


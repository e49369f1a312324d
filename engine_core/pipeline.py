"""The pipelined decode lane's state and policy: what is in flight, row masks, and when to run ahead.

The lane itself (launch ahead, settle, validate, drain) is in decode_lane.py, as in the seed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from metrale.ipc.plan import MASK_BAN, MASK_FORCE, MASK_GRAMMAR, MASK_GREEDY, MASK_NONE, StepKind, Ticket

from .sequence import Sequence


class Settled(enum.Enum):
    DONE = "done"  # committed; the step launched ahead (if any) is now in flight
    FAILED = "failed"  # the device failed; every row was told
    IDLE = "idle"  # nothing was in flight


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """Token ids that change a row's mask; None where the tokenizer has no such token."""

    think_start: int | None = None
    think_end: int | None = None
    code_fence: int | None = None
    tool_call_start: int | None = None
    tool_call_end: int | None = None


def special_tokens_of(tokenizer) -> SpecialTokens:
    """The token ids the row masks watch for, from a tokenizer's vocabulary (frontend/tokenizer.py's token_id)."""
    return SpecialTokens(
        think_start=tokenizer.token_id("<think>"),
        think_end=tokenizer.token_id("</think>"),
        code_fence=tokenizer.token_id("```"),
        tool_call_start=tokenizer.token_id("<tool_call>"),
        tool_call_end=tokenizer.token_id("</tool_call>"),
    )


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
class Inflight:
    """A launched step of any kind and what the host knew when it launched it (per row, in plan order)."""

    ticket: Ticket
    kind: StepKind
    seqs: list[Sequence]
    num_new: list[int]
    written: list[int]  # num_launched at launch: where the row's first token is written
    held: list[int]  # KV positions the row holds in flight (its num_inflight share), 0 once given back
    samples: list[bool]  # the row produces a token
    masks: list[RowMask]
    fed_from: list[int]  # FEED_HOST, or the row of the step before whose device token is the input
    discard: list[bool]  # set by validation (over-run, stale) or an abort: nothing of the row is committed
    drafts: list[list[int]] | None = None  # a VERIFY's drafts per row
    repick: bool = False  # RepickOnly: a mask went stale, the device picks again from the logits it kept
    kept: list[int] | None = None  # a settled VERIFY's committed picks per row
    prompt_lp: np.ndarray | None = None  # positions per row whose prompt logprobs the step reports (None: none)
    pool: np.ndarray | None = None  # POOL_* per row whose pooled vector the step reports (None: no row pools)
    goes_on: bool = False  # scheduled as the batch going on as it is (ScheduledStep.goes_on)


@dataclass(slots=True)
class Pipeline:
    """At most two steps in flight: the one being settled (of any kind), and the one launched ahead of it (a STEP
    behind a STEP)."""

    inflight: Inflight | None = None
    next: Inflight | None = None

    def has_inflight(self) -> bool:
        return self.inflight is not None


def row_mask(seq: Sequence, toks: SpecialTokens, eos_ids: tuple[int, ...], ahead: int = 0) -> RowMask:
    """The mask of seq's next pick; ahead=1 asks for the pick after that, assuming an ordinary token."""
    if seq.req.plain:
        return NO_MASK
    p, st = seq.params, seq.row_state
    if (
        p.max_thinking_tokens is not None
        and toks.think_end is not None
        and st.in_think
        and st.think_tokens + ahead >= p.max_thinking_tokens
    ):
        return RowMask(MASK_FORCE, toks.think_end)
    kind = MASK_NONE
    ban: tuple[int, ...] = ()
    if p.min_tokens and seq.num_output + ahead < p.min_tokens:
        kind |= MASK_BAN
        ban = tuple(dict.fromkeys((*eos_ids, *p.stop_token_ids)))
    if p.bad_words_token_ids:
        words = bad_word_bans(seq, ahead)
        if words:
            kind |= MASK_BAN
            ban = tuple(dict.fromkeys((*ban, *words)))
    if p.adaptive_sampling and (st.in_fence or st.in_tool):
        kind |= MASK_GREEDY
    # A grammar's bitmask is made from the matcher as it is: one launched ahead is made a token early (stale).
    grammar_at = -1
    if st.grammar is not None:
        kind |= MASK_GRAMMAR
        grammar_at = st.grammar.accepted
    return RowMask(kind, -1, ban, grammar_at) if kind else NO_MASK


def bad_word_bans(seq: Sequence, ahead: int = 0) -> list[int]:
    """The ids bad_words ban from seq's next pick (vLLM's rule, over the output only): every one-token word, and a
    longer word's last token when the output ends with the tokens before it. ahead=1 (the pick after a token not yet
    known) bans the one-token words only: a longer word's prefix would end with that token, and validation compares
    the mask with the one made once it is committed."""
    out, n = seq.out.tokens, seq.num_output
    bans = []
    for word in seq.params.bad_words_token_ids:
        k = len(word) - 1
        if k == 0:
            bans.append(word[0])
        elif not ahead and k <= n and out[len(out) - k :].tolist() == word[:k]:
            bans.append(word[k])
    return bans


def can_feed(seq: Sequence) -> bool:
    """True when seq's next step may be fed from the device's token before the host has seen it: every row but a
    grammar row, whose bitmask is made by its matcher after that token (it waits for its commit), and a beam row,
    whose next input is its search's choice (beam_groups.py). A penalised row's history ends with a slot the device
    fills with the fed token (step_builder._history); a mask that the token could change is predicted and
    validated, not waited for."""
    return seq.row_state.grammar is None and seq.req.beam is None


def update_row_state(seq: Sequence, token: int, toks: SpecialTokens) -> None:
    """Advance the per-row state behind the masks past a committed token (a plain row's is never read)."""
    if seq.req.plain:
        return
    st = seq.row_state
    if token == toks.think_start:
        st.in_think, st.think_tokens = True, 0
    elif token == toks.think_end:
        st.in_think = False
    elif st.in_think:
        st.think_tokens += 1
    if token == toks.code_fence:
        st.in_fence = not st.in_fence
    elif token == toks.tool_call_start:
        st.in_tool = True
    elif token == toks.tool_call_end:
        st.in_tool = False


def init_row_state(seq: Sequence, toks: SpecialTokens) -> None:
    """Set the row state from the prompt (a template may open <think> or a fence for the model)."""
    for i, token in enumerate(seq.tokens):
        update_row_state(seq, token, toks)
        if i < seq.num_prompt:
            seq.row_state.think_tokens = 0  # the budget counts generated thinking only

"""A request's state inside the engine core, as one type per owner.

- `Request`: what was asked (ids, sampling params, prompt length, arrival); frozen once made.
- `Sequence`: its row in the engine: progress (num_computed, num_inflight), queue status and KV placement
  (`KvPlacement`: which row of the block pool's table holds its blocks). The scheduler and the lane write it.
- `Output`: its tokens (the prompt, then each committed one: the only copy) and what is not reported yet.
- `RowState`: what its next pick's mask depends on (pipeline.py).

tests/test_state_owners.py holds the table of which module writes which type and checks every write.
"""

from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from metrale.ipc.errors import ErrorCode
from metrale.ipc.messages import TokenLogprob
from metrale.ipc.pooling import PoolingParams
from metrale.ipc.sampling import SamplingParams

if TYPE_CHECKING:
    from .beam_groups import BeamGroup
    from .grammar import RowGrammar


class SeqStatus(enum.IntEnum):
    WAITING = 0  # queued; no KV blocks (or preempted: blocks freed, tokens kept)
    RUNNING = 1  # admitted: holds KV blocks, scheduled every step
    FINISHED = 2  # stopped; its blocks are freed when it is retired
    SWAPPED = 3  # preempted by swap: its KV waits in host blocks
    IDLE = 4  # a beam row its search holds in no queue (beam_groups.py): no blocks, nothing to run


@dataclass(frozen=True, slots=True)
class Request:
    """What was asked; made once by EngineCore.add_request (the prompt is Output.tokens[:num_prompt])."""

    request_id: str
    params: SamplingParams
    seed: int
    num_prompt: int
    arrival: int  # admission order tie-breaker (FCFS)
    stream: bool = True  # report committed tokens every tick; False: once, with its finish (offline use)
    cache_salt: str | None = None  # prefix-cache namespace: only requests with the same salt share blocks
    # Embeddings: the prompt is run and pooled as pool_kind (POOL_*) says; nothing is sampled.
    pooling: PoolingParams | None = None
    pool_kind: int = 0
    lora_slot: int = -1  # the device's LoRA slot of its adapter (-1: the base model)
    lora_key: int = -1  # its adapter's prefix-cache key (EngineCore.lora_keys: one per load)
    # No mask, penalty or row state can ever matter for it: the lane skips the per-row mask and row-state work.
    plain: bool = False
    # A beam row: one of a beam search's rows (beam_groups.py), whose commits feed that search, not an output.
    beam: BeamGroup | None = None
    # Where the commit must look closer (commit._check_stop): at this many tokens (max_tokens or the model's length),
    # or on one of these ids (EOS unless ignored, stop ids). The defaults look at every token.
    stop_at: int = 0
    stop_ids: frozenset[int] = frozenset()


def is_plain(p: SamplingParams) -> bool:
    """True when params make every mask NO_MASK, need no penalties and read no row state."""
    return not (p.has_penalties or p.min_tokens or p.adaptive_sampling or p.max_thinking_tokens is not None
                or p.structured_outputs is not None or bool(p.bad_words_token_ids))


@dataclass(slots=True)
class Output:
    """The committed tokens and what the engine has not reported yet (commit.py fills it, EngineCore takes it)."""

    tokens: array  # int32: the prompt, then every committed token; numpy reads it without a copy
    reported: int = 0  # tokens[:reported] are the prompt and what the deltas carried; the rest is pending
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # set once, by finish(); later commits for it are skipped
    error: str | None = None
    error_code: ErrorCode | None = None  # with finish_reason "error"
    reported_finish: bool = False
    # params.prompt_logprobs: entry i is prompt token i's (None for the first), appended as prefill chunks settle.
    prompt_entries: list[TokenLogprob | None] | None = None
    pool_total: np.ndarray | None = field(default=None, repr=False)  # an embeddings request's sum (or last) so far
    embedding: list[float] | None = field(default=None, repr=False)  # and its finished vector
    # The engine's outbox (id -> sequence): a sequence files itself there when it has tokens or a finish to
    # report, so collecting a tick's outputs visits those only, not every request.
    outbox: dict | None = field(default=None, repr=False)


@dataclass(slots=True)
class RowState:
    """The state behind a row's masks (pipeline.row_mask), advanced past each committed token."""

    in_think: bool = False
    think_tokens: int = 0
    in_fence: bool = False
    in_tool: bool = False
    grammar: RowGrammar | None = None  # structured outputs: its matcher, past the committed output (grammar.py)


@dataclass(slots=True)
class KvPlacement:
    """Where a sequence's KV lives: row `row` of its pool's block table (the table's only copy, kv_blocks.py), its
    first `num_blocks` entries; how many leading blocks are hashed for prefix caching, and the last one's hash."""

    row: int = -1
    num_blocks: int = 0
    hashed_blocks: int = 0
    prefix_hash: bytes = b""


@dataclass(slots=True, eq=False)  # identity: a sequence is itself, not its field values
class Sequence:
    """One request's row. tokens = prompt + committed output; num_computed of them have KV in the cache.

    A step runs tokens[num_launched:num_launched + k]; it samples a new token when that reaches the end of
    tokens. So a fresh prompt is a prefill (k up to its length) and a running request is a decode (k = 1).

    num_computed counts settled KV positions and advances only when a step is settled (decode_lane.settle);
    num_inflight counts the positions of launched steps not yet settled, so a step launched ahead starts where
    the one in flight ends.
    """

    req: Request
    out: Output
    row_state: RowState = field(default_factory=RowState)
    kv: KvPlacement = field(default_factory=KvPlacement)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    num_inflight: int = 0
    host_blocks: list[int] = field(default_factory=list)  # where its KV waits while SWAPPED
    state_slot: int = -1  # the device's recurrent state slot while running (state_slots.py; -1: none)
    num_preemptions: int = 0
    # Prompt tokens its first admission found in the prefix cache (usage's cached_tokens); None until admitted.
    num_cached_tokens: int | None = None
    received_at: float = field(default_factory=time.monotonic)  # when this engine core took it
    queued_s: float | None = None  # received_at to its first admission (vLLM's queue time); None until admitted
    # Engine failures while it ran (EngineCore.contain_failure); until it holds suspect_until tokens it runs alone.
    failures: int = 0
    suspect_until: int = 0

    @classmethod
    def of(cls, request_id: str, params: SamplingParams, seed: int, tokens, num_prompt: int, arrival: int, *,
           grammar: RowGrammar | None = None, outbox: dict | None = None, **request) -> Sequence:
        """A new waiting sequence of these tokens (prompt, then any output already made); `request`: the rest
        of the Request's fields."""
        plain = is_plain(params) and request.get("beam") is None  # a beam row is seen after every step
        req = Request(request_id, params, seed, num_prompt, arrival, plain=plain, **request)
        tokens = array("i", tokens)
        out = Output(tokens, len(tokens), outbox=outbox,
                     prompt_entries=None if params.prompt_logprobs is None else [None])
        return cls(req, out, RowState(grammar=grammar))

    # Read-only views of the parts, for brevity where they are read.
    request_id = property(lambda self: self.req.request_id)
    params = property(lambda self: self.req.params)
    num_prompt = property(lambda self: self.req.num_prompt)
    tokens = property(lambda self: self.out.tokens)
    finished = property(lambda self: self.out.finish_reason is not None)
    num_tokens = property(lambda self: len(self.out.tokens))
    num_output = property(lambda self: len(self.out.tokens) - self.req.num_prompt)
    last_token = property(lambda self: self.out.tokens[-1])
    output_ids = property(lambda self: self.out.tokens[self.req.num_prompt :].tolist())

    @property
    def num_launched(self) -> int:
        """Positions whose KV is settled or being computed: where the next step launched starts."""
        return self.num_computed + self.num_inflight

    @property
    def is_decode(self) -> bool:
        """True when the next step for this sequence is a single-token decode (never for an embeddings request,
        whose last token is the end of a prefill: no burst or verify step may take it)."""
        return len(self.out.tokens) - self.num_computed == 1 and not self.req.pool_kind

    def finish(self, reason: str, error: str | None = None, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        """Mark the sequence stopped (with reason "error": why, and its code); later commits for it are skipped."""
        out = self.out
        if out.finish_reason is None:
            self.status = SeqStatus.FINISHED
            out.finish_reason = reason
            out.error = error
            out.error_code = code if reason == "error" else None
            self.post()

    def post(self) -> None:
        """File this sequence in the engine's outbox: it has tokens or a finish to report."""
        if self.out.outbox is not None:
            self.out.outbox[id(self)] = self

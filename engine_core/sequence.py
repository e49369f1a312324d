"""A request's state inside the engine core: its tokens, how many are in the KV cache, its blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from metrale.ipc.errors import ErrorCode
from metrale.ipc.messages import TokenLogprob
from metrale.ipc.pooling import PoolingParams
from metrale.ipc.sampling import SamplingParams

if TYPE_CHECKING:
    from .grammar import RowGrammar


# One owner per piece of a request's state: the engine_core modules that may write each field (or call the
# method); a field not listed is set when the Sequence is made and never written again. tests/test_state_owners.py
# reads every engine_core module and fails on a write from anywhere else.
WRITERS: dict[str, frozenset[str]] = {
    name: frozenset(mods.split())
    for names, mods in (
        # progress: committed tokens by the commit, settled KV positions by the settle (reset by the scheduler when
        # a sequence leaves the device, set from a prefix hit when it joins), positions in flight by the lane
        ("tokens prompt_entries pool_total embedding", "commit"),
        ("num_computed", "decode_lane scheduler"),
        ("num_inflight", "decode_lane"),
        # the outbox: filled by the commit, taken by the engine
        ("pending pending_logprobs", "commit engine"),
        ("reported_finish", "engine"),
        # KV placement: the block pool, the state slots, the scheduler's swap and queue bookkeeping
        ("block_table hashed_blocks prefix_hash", "kv_blocks"),
        ("state_slot", "state_slots"),
        ("host_blocks status slot_idx num_preemptions num_cached_tokens", "scheduler"),
        # the row state behind masks (pipeline.py), the plan's cached sampling row, failure containment
        ("plain in_think think_tokens in_fence in_tool", "pipeline"),
        ("sampling_row", "step_builder"),
        ("failures suspect_until", "engine"),
        ("grammar", "engine"),
        # ending a request: a stop or a grammar's end (commit), a device error (the lane), an abort or a failure
        # (engine), a request the KV cache cannot hold (scheduler)
        ("finish()", "commit decode_lane engine scheduler"),
        ("post()", "commit"),
    )
    for name in names.split()
}


class SeqStatus(enum.IntEnum):
    WAITING = 0  # queued; no KV blocks (or preempted: blocks freed, tokens kept)
    RUNNING = 1  # admitted: holds KV blocks, scheduled every step
    FINISHED = 2  # stopped; its blocks are freed when it is retired
    SWAPPED = 3  # preempted by swap: its KV waits in host blocks


@dataclass(slots=True, eq=False)  # identity: a sequence is itself, not its field values
class Sequence:
    """One request. tokens = prompt + committed output; num_computed of them have KV in the cache.

    A step runs tokens[num_launched:num_launched + k]; it samples a new token when that reaches the
    end of tokens. So a fresh prompt is a prefill (k up to its length) and a running request is a
    decode (k = 1): one rule serves both, and chunked prefill is just a smaller k.

    num_computed counts settled KV positions and advances only when a step is settled (decode_lane.settle);
    num_inflight counts the positions of launched steps not yet settled (decode_lane.launch takes them, settle or
    a discard gives them back), so a step launched ahead starts where the one in flight ends.
    """

    request_id: str
    params: SamplingParams
    seed: int
    tokens: list[int]
    num_prompt: int
    arrival: int  # admission order tie-breaker (FCFS)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    num_inflight: int = 0
    block_table: list[int] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)  # where its KV waits while SWAPPED
    finished: bool = False  # set once, by finish() (read several times per row per tick: a field, not a property)
    finish_reason: str | None = None
    error: str | None = None
    error_code: ErrorCode | None = None  # with finish_reason "error"
    slot_idx: int = -1  # stable row order within a batch (the seed's slot index)
    state_slot: int = -1  # the device's recurrent state slot while running (state_slots.py; -1: none)
    # Committed since the last output was taken: what the next RequestOutputDelta carries.
    pending: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    reported_finish: bool = False
    stream: bool = True  # report committed tokens every tick; False: once, with its finish (offline use)
    # Row-mask state (pipeline.row_mask): thinking budget and adaptive sampling.
    in_think: bool = False
    think_tokens: int = 0
    in_fence: bool = False
    in_tool: bool = False
    num_preemptions: int = 0
    # Engine failures while it ran (EngineCore.contain_failure); until it holds suspect_until tokens it runs alone.
    failures: int = 0
    suspect_until: int = 0
    sampling_row: tuple = ()  # the step builder's cached layout of params (step_builder.sampling_row)
    # No mask, penalty or row state can ever matter for it (pipeline.is_plain, set on admission): the
    # decode lane skips the per-row mask and row-state work. False is always safe.
    plain: bool = False
    # Prefix caching (kv_blocks): how many leading blocks are hashed, and the last one's hash.
    hashed_blocks: int = 0
    prefix_hash: bytes = b""
    # Prompt tokens its first admission found in the prefix cache (usage's cached_tokens); None until admitted.
    num_cached_tokens: int | None = None
    # The engine's outbox (id -> sequence): a sequence files itself there when it has tokens or a finish to
    # report, so collecting a tick's outputs visits those only, not every request.
    outbox: dict | None = field(default=None, repr=False)
    cache_salt: str | None = None  # prefix-cache namespace: only requests with the same salt share blocks
    grammar: RowGrammar | None = None  # structured outputs: its matcher, past the committed output (grammar.py)
    # params.prompt_logprobs: entry i is prompt token i's (None for the first), appended as prefill chunks settle.
    prompt_entries: list[TokenLogprob | None] | None = None
    # Embeddings: an embeddings request runs its prompt and samples nothing; pool_kind (POOL_*) is what each of its
    # rows gives back, pool_total the sum (or the last vector) so far, embedding the finished vector it reports.
    pooling: PoolingParams | None = None
    pool_kind: int = 0
    pool_total: np.ndarray | None = field(default=None, repr=False)
    embedding: list[float] | None = field(default=None, repr=False)
    lora_slot: int = -1  # the device's LoRA slot of its adapter (-1: the base model)
    lora_key: int = -1  # its adapter's prefix-cache key (EngineCore.lora_keys: one per load)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_launched(self) -> int:
        """Positions whose KV is settled or being computed: where the next step launched starts."""
        return self.num_computed + self.num_inflight

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    @property
    def is_decode(self) -> bool:
        """True when the next step for this sequence is a single-token decode (never for an embeddings request,
        whose last token is the end of a prefill: no burst or verify step may take it)."""
        return self.num_tokens - self.num_computed == 1 and not self.pool_kind

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    def finish(self, reason: str, error: str | None = None, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        """Mark the sequence stopped (with reason "error": why, and its code); later commits for it are skipped."""
        if not self.finished:
            self.finished = True
            self.status = SeqStatus.FINISHED
            self.finish_reason = reason
            self.error = error
            self.error_code = code if reason == "error" else None
            self.post()

    def post(self) -> None:
        """File this sequence in the engine's outbox: it has tokens or a finish to report."""
        if self.outbox is not None:
            self.outbox[id(self)] = self

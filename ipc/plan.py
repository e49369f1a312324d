"""The engine core ↔ device boundary: a step's plan, its result, and the Device protocol.

A plan is flat numpy arrays (the layout the shared-memory tickets copy byte for byte):
T tokens across R rows; row r owns tokens query_start[r]:query_start[r+1]. A prefill chunk is a
row with many tokens, a decode is a row with one. Rows with sample[r] produce one token.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

FEED_HOST = -1  # feed_from_row value: the input token is in input_ids, written by the host

# mask_kind bits: what a committed token can change about the next pick (the seed's RowMask).
MASK_NONE = 0
MASK_BAN = 1  # ban the ids in ban_ids[r] (min_tokens not reached: EOS and stop ids; bad_words' next tokens)
MASK_FORCE = 2  # the pick is force_token[r] (thinking budget spent: the think-end token)
MASK_GREEDY = 4  # take the argmax whatever the temperature (adaptive sampling in a fence or tool call)
# Only the tokens of the row's bitmask (grammar_bitmask, one per such row in row order): a structured output's
# grammar, a request's allowed_token_ids, or both ANDed (engine_core/grammar.py fill_bitmasks).
MASK_GRAMMAR = 8

NO_SEED = -1

# pool values (StepPlan.pool): what a row's hidden states give back (embeddings; ModelInfo.pooling names the model's).
POOL_NONE = 0
POOL_LAST = 1  # the final-normed hidden state of the row's last token
POOL_SUM = 2  # the sum of the row's tokens' final-normed hidden states (mean pooling: the host adds chunks, divides)
POOL_FIRST = 3  # the first token's of the row (CLS pooling: the host keeps the chunk at position 0)
POOL_KINDS = {"last": POOL_LAST, "mean": POOL_SUM, "cls": POOL_FIRST}


class StepKind(enum.IntEnum):
    """What a ticket asks the device to run; it travels with the plan and the device dispatches on it."""

    STEP = 0  # one forward over the plan's tokens, one pick per sampling row (prefill, decode, mixed, fed ahead)
    BURST = 1  # `steps` decode steps of the same rows, each fed its own previous pick (await_burst)
    VERIFY = 2  # each row's last token and its drafts, picks kept up to the first rejected draft (await_burst)
    # A plan of a settled step's sampling rows under their masks now: picked again from the logits the device kept
    # of that step (Device.resample: a RepickOnly repair), answered as a STEP's result.
    RESAMPLE = 3
    LORA = 4  # no plan: load a LoRA adapter into a slot, or empty it (Device.load_lora; in order with the steps)


def check_ticket(kind: StepKind, steps: int, burst_limit: int) -> None:
    """ValueError unless a device that bursts up to burst_limit steps runs this ticket: a BURST of 1 to
    burst_limit steps, a STEP or a VERIFY of one (a RESAMPLE goes through Device.resample, a LORA carries no plan)."""
    if kind in (StepKind.RESAMPLE, StepKind.LORA) or kind not in StepKind.__members__.values():
        raise ValueError(f"a plan cannot be launched as {kind!r}")
    top = burst_limit if kind == StepKind.BURST else 1
    if not 1 <= steps <= top:
        raise ValueError(f"a {StepKind(kind).name} ticket of {steps} steps (this device runs 1 to {top})")


class FedAheadPolicy(enum.Enum):
    """What the device can do with a step launched ahead whose input turned out stale."""

    REWIND = "rewind"  # attention only: an over-run position is simply never used
    REPICK_ONLY = "repick_only"  # recurrent state: a launched step cannot be undone


class DeviceError(RuntimeError):
    """A step failed on the device, or the device (worker process) is gone."""


class DeviceLost(DeviceError):
    """The device itself is gone (the worker process died): its KV cache went with it."""


@dataclass(frozen=True, slots=True)
class Ticket:
    """A launched step: the ring slot it occupies and its sequence number."""

    slot: int
    seq: int


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Facts about the model and its KV cache that the engine core plans with."""

    name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_kv_blocks: int
    block_size: int
    dtype: str
    fed_ahead_policy: FedAheadPolicy = FedAheadPolicy.REWIND
    num_swap_blocks: int = 0  # host blocks for swapping KV out (0: swap preemption unavailable)
    # Per-sequence recurrent state slots (a model with recurrent layers; 0: none). Each running sequence
    # holds one (StepPlan.state_slots); such a model is REPICK_ONLY and serves without prefix caching.
    num_state_slots: int = 0
    # The worker's kernels: on a CPU the instruction-set class its native kernels run (metrale/cpu_isa.py), or
    # "torch" without them; on an accelerator its kind ("cuda").
    kernels: str = ""
    # Embeddings: the pooled vector's width (the hidden size), the model's pooling ("last", "mean" or "cls", as its
    # sentence-transformers config says; "last" for a plain decoder), whether it normalises, and whether it was
    # trained for truncated vectors (`dimensions`).
    hidden_size: int = 0
    pooling: str = "last"
    pooling_normalize: bool = True
    matryoshka: bool = False
    max_loras: int = 0  # LoRA adapter slots (0: the device serves no adapters)


@dataclass(slots=True)
class StepPlan:
    """One forward step: the tokens to run, where their KV goes, and how each row samples."""

    # Per token (T).
    input_ids: np.ndarray  # int32[T]; a fed row's entry is ignored (see feed_from_row)
    positions: np.ndarray  # int32[T]
    slot_mapping: np.ndarray  # int64[T]: block_table[pos // block_size] * block_size + pos % block_size
    # Per row (R).
    query_start: np.ndarray  # int32[R+1]: cumulative token counts
    seq_lens: np.ndarray  # int32[R]: KV length of the row once this step's tokens are written
    block_tables: np.ndarray  # int32[R, B]: physical block ids, padded with 0
    sample: np.ndarray  # bool[R]: the row produces a token (a decode, or a prompt's last chunk)
    feed_from_row: np.ndarray  # int32[R]: FEED_HOST, or take the input from the previous step's row i
    temperature: np.ndarray  # float32[R]
    top_k: np.ndarray  # int32[R] (0 disables)
    top_p: np.ndarray  # float32[R]
    min_p: np.ndarray  # float32[R]
    repetition_penalty: np.ndarray  # float32[R]
    presence_penalty: np.ndarray  # float32[R]
    frequency_penalty: np.ndarray  # float32[R]
    seeds: np.ndarray  # int64[R]: every row has a seed (the engine draws one when the request has none)
    mask_kind: np.ndarray  # uint8[R]: MASK_* bits
    force_token: np.ndarray  # int32[R]
    ban_ids: np.ndarray  # int32[R, K]: -1 padded
    num_logprobs: np.ndarray  # int32[R]: -1 none, 0 the sampled token's only, N top-N too
    # Token history for penalties, only for rows that have penalties (others have empty ranges).
    hist_tokens: np.ndarray  # int32[H]
    hist_start: np.ndarray  # int32[R+1]
    hist_prompt_len: np.ndarray  # int32[R]: the first n history tokens of the row are its prompt
    # KV copies before the forward: first swap_out (device block, host block), then swap_in (host, device). A swap_in
    # pair whose host block is negative, (-1 - b, d), copies device block b to device block d (a forked beam's last,
    # partial block: engine_core/beam_groups.py), before the host → device pairs.
    swap_out: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int32))
    swap_in: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int32))
    # Structured outputs: the allowed next tokens of each MASK_GRAMMAR row, in row order, as packed bits (token
    # i allowed iff bit i % 32 of word i // 32 is set, xgrammar's layout); [0, 0] when no row has a grammar.
    grammar_bitmask: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int32))  # int32[G, W]
    # Speculative decoding: a row with d > 0 drafts runs its last token and the d draft tokens (its last d + 1
    # tokens), samples at each of them, and keeps the picks up to the first that differs from the next draft.
    num_drafts: np.ndarray | None = None  # int32[R]; None: no drafts (all zeros)
    # int32[R]: each row's recurrent state slot (a row whose tokens start at position 0 finds it reset);
    # empty for a model without recurrent state, so its plans carry nothing more.
    state_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    # logit_bias: row r adds bias_values[i] to token bias_ids[i]'s logit for i in bias_start[r]:bias_start[r+1],
    # before every other stage (the same ids and values in every step of a request).
    bias_start: np.ndarray | None = None  # int32[R+1]; None: no row biased (all zeros)
    bias_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # int32[BI]
    bias_values: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))  # float32[BI]
    # Prompt logprobs: row r reports, at each of its first prompt_lp_count[r] positions, the log-probability of
    # the token that follows it (the row's next input token; after its last input, prompt_lp_next[r]) and the
    # top prompt_lp_n[r] alternatives, under the raw distribution (StepResult.prompt_logprobs).
    prompt_lp_n: np.ndarray | None = None  # int32[R]: -1 none; None: no row asks (all -1, counts 0)
    prompt_lp_count: np.ndarray | None = None  # int32[R]
    prompt_lp_next: np.ndarray | None = None  # int32[R]: the token after the row's last input (-1: not needed)
    # Embeddings: a POOL_* value per row (a pooled row never samples); StepResult.pooled has one vector per such row.
    pool: np.ndarray | None = None  # int32[R]; None: no row pools (all POOL_NONE)
    # Multi-LoRA: each row's adapter slot (-1: the base model alone), the slots the device loaded (--lora-modules).
    lora_slots: np.ndarray | None = None  # int32[R]; None: no row has an adapter (all -1)
    # logprob_token_ids: row r's alternatives (StepResult.top_ids[r, :k]) are pinned_ids[pinned_start[r]:
    # pinned_start[r+1]] (k of them, k <= num_logprobs[r]) in that order, with their raw log-probabilities, in place
    # of its top k; a row with none lists its top num_logprobs[r].
    pinned_start: np.ndarray | None = None  # int32[R+1]; None: no row pins (all zeros)
    pinned_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # int32[PI]

    def __post_init__(self) -> None:
        if self.num_drafts is None:
            self.num_drafts = np.zeros(len(self.seq_lens), dtype=np.int32)
        if self.bias_start is None:
            self.bias_start = np.zeros(len(self.seq_lens) + 1, dtype=np.int32)
        if self.prompt_lp_n is None:
            r = len(self.seq_lens)
            self.prompt_lp_n = np.full(r, -1, dtype=np.int32)
            self.prompt_lp_count = np.zeros(r, dtype=np.int32)
            self.prompt_lp_next = np.full(r, -1, dtype=np.int32)
        if self.pool is None:
            self.pool = np.zeros(len(self.seq_lens), dtype=np.int32)
        if self.lora_slots is None:
            self.lora_slots = np.full(len(self.seq_lens), -1, dtype=np.int32)
        if self.pinned_start is None:
            self.pinned_start = np.zeros(len(self.seq_lens) + 1, dtype=np.int32)

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def unpack_bitmask(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [..., vocab_size] from packed grammar bitmask rows (bit i % 32 of word i // 32 is token i)."""
    bits = np.unpackbits(np.ascontiguousarray(words, dtype=np.int32).view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


def pack_bitmask(ids: list[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """int32 [ceil(vocab_size / 32)]: the packed bitmask (unpack_bitmask's layout) with the bits of ids set."""
    bits = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
    bits[np.asarray(ids, dtype=np.int64)] = True
    return np.packbits(bits, bitorder="little").view(np.int32)


_NO_SWAP = np.zeros((0, 2), dtype=np.int32)


def moved_on(plan: StepPlan, k: int, block_size: int) -> StepPlan:
    """A decode plan k positions on, every row fed its own previous token: a decode burst's k-th step.

    The plan's block tables must already cover the new positions; its swap copies belong to its own step."""
    each_row = np.arange(plan.num_rows, dtype=np.int32)
    positions = plan.positions + k
    slots = plan.block_tables[each_row, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return dataclasses.replace(
        plan, positions=positions, seq_lens=plan.seq_lens + k, slot_mapping=slots, feed_from_row=each_row,
        swap_out=_NO_SWAP, swap_in=_NO_SWAP,
    )


@dataclass(slots=True)
class StepResult:
    """What a step produced, row for row. tokens[r] is -1 where the row did not sample."""

    tokens: np.ndarray  # int32[R]
    logprobs: np.ndarray | None = None  # float32[R]: log-prob of the sampled token (raw distribution)
    top_ids: np.ndarray | None = None  # int32[R, N]
    top_logprobs: np.ndarray | None = None  # float32[R, N]
    # Prompt logprobs (StepPlan.prompt_lp_*): P = the rows' prompt_lp_count summed, row after row, position after
    # position; N = the largest prompt_lp_n (a row's own n first).
    prompt_logprobs: np.ndarray | None = None  # float32[P]: the log-probability of the token after each position
    prompt_top_ids: np.ndarray | None = None  # int32[P, N]
    prompt_top_logprobs: np.ndarray | None = None  # float32[P, N]
    # Embeddings (StepPlan.pool): one vector per pooled row, in row order (float32 [Q, hidden_size]).
    pooled: np.ndarray | None = None
    timings: dict[str, float] = field(default_factory=dict)  # optional figures for benchmarks


class Device(Protocol):
    """The model as the engine core sees it. Implementations: LocalDevice, WorkerDevice, FakeDevice.

    What it can run: one step of any plan (StepKind.STEP), a verify step (a plan with drafts: StepKind.VERIFY,
    answered as a burst), a decode burst of up to `burst_limit` steps (StepKind.BURST; 1: none), and the picks of a
    settled step made again under new masks (resample).
    """

    burst_limit: int  # the most decode steps one ticket may ask for (1: the device runs no bursts)

    def launch(self, plan: StepPlan, kind: StepKind = StepKind.STEP, steps: int = 1) -> Ticket:
        """Start a ticket of this kind (a BURST of `steps`) without waiting for it. Tickets run in launch order."""
        ...

    def await_result(self, ticket: Ticket) -> StepResult:
        """Wait for a launched step; DeviceError if it failed or the device died."""
        ...

    def await_burst(self, ticket: Ticket) -> list[StepResult]:
        """Wait for a burst's steps, or a verify step's picks: one result per step."""
        ...

    def resample(self, ticket: Ticket, plan: StepPlan) -> StepResult:
        """The settled step of ticket picked again from the logits the device kept of it (a RepickOnly repair: its
        forward stands, a mask went stale): plan has the step's rows, the same rows sampling, with the sampling
        arrays as they are now (masks, bitmasks, history; seq_lens the step's, which key the noise); its token
        arrays are unused. A result as the step's (tokens, logprobs when asked); DeviceError when the logits are
        no longer kept. Nothing may be in flight behind the step."""
        ...

    def load_lora(self, slot: int, path: str) -> None:
        """Load the PEFT adapter at path into LoRA slot (after every step launched before; "" empties the slot);
        DeviceError naming what failed. A device that is replaced loads the same adapters again."""
        ...

    def model(self) -> ModelInfo:
        """Facts about the model, fixed for the device's life."""
        ...

    def close(self) -> None:
        """Release the device; launched steps are abandoned."""
        ...

"""The model runner: executes a StepPlan on the model and its paged KV cache, and samples.

One `execute(plan)` is one step: copy the plan's token arrays to the device, take fed rows' inputs
from the previous step's sampled tokens (still on the device: no host round trip), run the forward,
compute logits at the sampling positions (a row's last token; a drafted row's last d + 1), sample them in one
pass, and return the tokens (a verify step: the picks each row keeps, by the device's acceptance). Every kind of
ticket runs through `_step`: the one executor.
The runner is not thread-safe: one caller at a time (LocalDevice and the worker loop each own one).
"""

from __future__ import annotations

import math
import pathlib
import time
from collections import deque
from dataclasses import dataclass

import logging

import numpy as np
import torch

from metrale.gpu_worker.errors import PlanError
from metrale.gpu_worker.graph_runner import DecodeGraphs
from metrale import cpu_isa
from metrale.gpu_worker.layers import cpu_kernels, kernel_choice
from metrale.gpu_worker.layers.attention_backends import select_backend
from metrale.gpu_worker.layers.attention_metadata import AttentionMetadata, build_metadata
from metrale.gpu_worker.layers.kv_cache import PagedKVCache
from metrale.gpu_worker.layers.parallel import SINGLE, ParallelGroup
from metrale.gpu_worker.layers.recurrent_state import RecurrentState, StateStep, build_state_step
from metrale.gpu_worker.layers.lora import LoraSlots
from metrale.gpu_worker.loader import load_model
from metrale.gpu_worker.pooler import check_pool, pool_hidden
from metrale.gpu_worker.kv_swap import KvSwapSpace
from metrale.gpu_worker.result_copy import PendingResult, ResultCopier
from metrale.gpu_worker.sampler import Sampler
from metrale.gpu_worker.step_staging import StepStaging
from metrale.model_facts import STATE_RECURRENT, ModelError, resolve_model
from metrale.config import lora_pairs
from metrale.settings import DEFAULTS
from metrale.ipc.plan import MASK_GRAMMAR, FedAheadPolicy, ModelInfo, StepPlan, StepResult, moved_on
from metrale.ipc.sampling import logprobs_cap

CPU_KV_CACHE_BYTES = 512 << 20  # default KV budget on a CPU: enough for tests and demos
GPU_KV_CACHE_FRACTION = 0.8  # of the memory free after loading, when no budget is given
GPU_RESERVED_BYTES = 1 << 30  # left for activations, logits and the sampler's scratch
LOGITS_KEPT = 2  # steps whose logits read_logits and resample can still use (the settled one and one ahead)
_PROMPT_LOGITS_SLICE = 256  # prompt positions whose vocabulary-wide logits are made at once

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(slots=True)
class _StepLogits:
    """One executed step's logits, kept on the device until read or replaced."""

    step: int
    logits: torch.Tensor  # [S, V] in the model's dtype
    rows: np.ndarray  # int64 [S]: the plan rows they belong to
    num_rows: int  # R


@dataclass(slots=True)
class _Positions:
    """Where a step samples: one position per sampling row (its last token), or for a row with d drafts its last
    d + 1 tokens (a verify step), each a pick."""

    token: np.ndarray  # int64 [P]: the step's token index of each pick
    of_row: np.ndarray  # int64 [P]: its plan row
    drafted: bool  # some row has drafts (P > S)
    within: np.ndarray | None = None  # int64 [P]: j of pick j of its row (drafted steps only)
    last: np.ndarray | None = None  # int64 [P]: its row's last j (d)
    keys: np.ndarray | None = None  # int64 [P]: the position its noise is keyed by (its KV length with its token in)
    next_draft: np.ndarray | None = None  # int64 [P]: the draft after its token (-1 after the row's last)

    @classmethod
    def of(cls, plan: StepPlan, rows: np.ndarray) -> _Positions:
        """The sampling positions of rows (the plan's sampling rows)."""
        ends = plan.query_start[rows + 1].astype(np.int64)
        counts = plan.num_drafts[rows].astype(np.int64) + 1
        if int(counts.sum()) == len(rows):
            return cls(ends - 1, rows, False)
        of_row = np.repeat(rows, counts)
        firsts = np.cumsum(counts) - counts
        within = np.arange(int(counts.sum())) - np.repeat(firsts, counts)
        last = np.repeat(counts - 1, counts)
        token = np.repeat(ends - counts, counts) + within
        keys = plan.seq_lens[of_row].astype(np.int64) - last + within
        next_draft = np.where(within < last, plan.input_ids[np.minimum(token + 1, plan.num_tokens - 1)], -1)
        return cls(token, of_row, True, within, last, keys, next_draft.astype(np.int64))


@dataclass(slots=True)
class _Prepared:
    """A plan's tensors on the device, ready for the forward."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    token_seq_lens: torch.Tensor | None  # each token's row seq_len, when the rotary needs it this step
    state: StateStep | None  # the rows' state slots (a model with recurrent layers)


class ModelRunner:
    """A loaded model, its paged KV cache and its sampler; executes StepPlans one at a time."""

    def __init__(
        self,
        model_dir: str | pathlib.Path,
        *,
        dtype: str | torch.dtype = DEFAULTS.dtype,
        quantization: str | None = DEFAULTS.quantization,
        device: str | torch.device | None = DEFAULTS.device,
        num_kv_blocks: int | None = DEFAULTS.num_kv_blocks,
        kv_cache_memory: int | None = DEFAULTS.kv_cache_memory,
        block_size: int = DEFAULTS.block_size,
        max_num_seqs: int = DEFAULTS.max_num_seqs,
        show_progress: bool = DEFAULTS.show_progress,
        swap_space: int = 0,
        max_model_len: int | None = DEFAULTS.max_model_len,
        group: ParallelGroup = SINGLE,
        decode_graphs: bool | None = None,
        enable_lora: bool = DEFAULTS.enable_lora,
        lora_modules: list[str] = DEFAULTS.lora_modules,
        max_loras: int = DEFAULTS.max_loras,
        max_lora_rank: int = DEFAULTS.max_lora_rank,
        max_logprobs: int = DEFAULTS.max_logprobs,
    ):
        """Load the model, allocate the KV cache (num_kv_blocks, or as many as kv_cache_memory bytes hold)
        and swap_space bytes of host blocks for swap preemption.

        group: this rank's tensor-parallel group; the model holds this rank's shards and its KV cache this
        rank's KV heads, and every rank of the group agrees on the number of blocks.
        decode_graphs: run decode steps through the bucketed persistent buffers (graph_runner.py), captured as
        CUDA graphs on CUDA; None = on CUDA only (on a CPU the native fused step is faster uncaptured), False =
        eager everywhere (`--enforce-eager`).
        enable_lora: LoRA slots (max_loras of rank max_lora_rank) on every projection, lora_modules' adapters
        (NAME=PATH) loaded into slots 0, 1, ... in order: a plan's lora_slots name them per row."""
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model_dir = pathlib.Path(model_dir)
        self.facts = resolve_model(model_dir, max_model_len)
        self.group = group
        # The native CPU kernels (layers/cpu_kernels.py): decode attention reading keys stored
        # head-dim-major (see layers/kv_cache.py), the KV write, RMSNorm, rotary, SiLU and the greedy argmax.
        self._native = self.device.type == "cpu" and cpu_kernels.available()
        self.model = load_model(
            self.facts, dtype=dtype, device=self.device, native=self._native,
            attention=select_backend(self.device, native=self._native), show_progress=show_progress,
            quantization=quantization, group=group,
        )
        if self._native and self.model.dtype == torch.bfloat16 and not cpu_isa.has_native_bf16(cpu_kernels.isa()):
            log.info("bfloat16 weights (half the bytes a decode step reads) on %s kernels, which have no bfloat16 "
                     "product: the linear layers widen them to float32 and multiply in float32", cpu_kernels.isa())
        # A model with recurrent layers keeps their state in one slot per running sequence (max_num_seqs of them,
        # allocated before the KV cache takes what memory is left); the engine core assigns the slots. A step
        # launched ahead then cannot be undone: RepickOnly.
        recurrent = self.facts.state_kind == STATE_RECURRENT
        if recurrent != (self.model.state_shape is not None):
            raise ModelError(f"{self.facts.path}: its facts say state kind {self.facts.state_kind!r}, "
                             f"but its {self.facts.architecture} model {'keeps no' if recurrent else 'keeps'} recurrent state")
        self.state = None
        if recurrent:
            self.state = RecurrentState(self.model.state_shape, max(max_num_seqs, 1), dtype=self.model.dtype, device=self.device)
        kv = self.model.kv_shape
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        num_blocks = group.min_int(self._choose_num_blocks(num_kv_blocks, kv_cache_memory))
        graphs = self._graphs_wanted(decode_graphs)
        # Keys head-dim-major only when some layer's decode runs the native kernel (its layout).
        self.kv_cache = PagedKVCache(
            kv.num_layers, num_blocks, block_size, kv.num_kv_heads, kv.head_dim,
            dtype=self.model.dtype, device=self.device, transposed_keys=self.model.uses_transposed_keys,
            scratch_block=graphs,
        )
        per_block = PagedKVCache.bytes_per_block(kv.num_layers, block_size, kv.num_kv_heads, kv.head_dim, self.model.dtype)
        self.swap = KvSwapSpace(self.kv_cache, KvSwapSpace.blocks_for(swap_space, per_block))
        self.max_logprobs = logprobs_cap(max_logprobs, self.facts.vocab_size)  # a plan may ask no more
        self.info = ModelInfo(
            name=self.model_dir.name,
            vocab_size=self.facts.vocab_size,
            max_model_len=self.facts.max_model_len,
            eos_token_ids=self.facts.eos_token_ids,
            num_kv_blocks=num_blocks,
            block_size=block_size,
            dtype=_DTYPE_NAMES[self.model.dtype],
            fed_ahead_policy=FedAheadPolicy.REPICK_ONLY if recurrent else FedAheadPolicy.REWIND,
            num_swap_blocks=self.swap.num_blocks,
            num_state_slots=self.state.num_slots if self.state is not None else 0,
            kernels=(kernel_choice.describe() if self._native else "torch") if self.device.type == "cpu" else self.device.type,
            hidden_size=self.facts.hidden_size,
            pooling=self.facts.pooling.kind,
            pooling_normalize=self.facts.pooling.normalize,
            matryoshka=self.facts.pooling.matryoshka,
            max_loras=max_loras if enable_lora else 0,
        )
        self.lora: LoraSlots | None = None
        if enable_lora:
            self.lora = LoraSlots(self.model, max_loras=max_loras, max_lora_rank=max_lora_rank, group=group)
            for slot, (_, path) in enumerate(lora_pairs(lora_modules)):
                self.lora.load(slot, path)
        self.sampler = Sampler(self.facts.vocab_size, self.device)
        self._copier = ResultCopier(self.device)
        self._staging = StepStaging(self.device)
        self.graphs: DecodeGraphs | None = None
        if graphs:
            try:
                self.graphs = DecodeGraphs(
                    self.model, self.kv_cache, self._staging, max_num_seqs=max_num_seqs,
                    max_model_len=self.facts.max_model_len, capture=self.device.type == "cuda",
                )
            except Exception as exc:  # noqa: BLE001 - a forward that cannot be captured here runs eager
                log.warning("decode graphs off: building them failed (%s: %s)", type(exc).__name__, exc)
        self._last_tokens = torch.full((max(max_num_seqs, 1),), -1, dtype=torch.int64, device=self.device)
        self._arange = np.arange(max(max_num_seqs, 1), dtype=np.int32)  # feed_from_row of an all-self-fed step
        self._last_sample: np.ndarray | None = None  # bool [R] of the last executed step; None = no source
        self._last_picks: PendingResult | None = None  # the last executed step's picks on their way to the host
        self._logits: deque[_StepLogits] = deque(maxlen=LOGITS_KEPT)
        self.steps_executed = 0

    # ---- public --------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step and sample; tokens[r] is -1 for rows that do not sample."""
        return self.launch(plan).result()

    def launch(self, plan: StepPlan) -> PendingResult:
        """Queue one step and its sampling on the device and start copying its tokens back: its result once
        they land (at once on a CPU). The next step may be launched first — fed on the device from this one."""
        self._check(plan)
        return self._step(plan)

    def execute_burst(self, plan: StepPlan, steps: int) -> list[StepResult]:
        """`steps` decode steps from one plan (see launch_burst)."""
        return [pending.result() for pending in self.launch_burst(plan, steps)]

    def launch_burst(self, plan: StepPlan, steps: int) -> list[PendingResult]:
        """`steps` decode steps from one plan: the plan's, then each row fed its own last token, one position on.

        The plan is a decode step (one token per row, every row sampling, no penalty history) whose block
        tables already cover each row's seq_len + steps - 1 positions; each later step is the same plan
        moved one position on, so sampling (keyed by seed and position) picks exactly what single steps
        would. The first and last steps are checked: every step's positions and slots lie between theirs.
        """
        r = plan.num_rows
        if plan.num_tokens != r or not plan.sample.all() or len(plan.hist_tokens):
            raise PlanError("a decode burst needs one token per row, every row sampling, no penalty history")
        later = [moved_on(plan, k, self.block_size) for k in range(1, steps)]
        self._check(plan)
        if later:
            self._check(later[-1])
        greedy = self.sampler.plain_greedy(plan)  # the same rows and parameters in every step
        return [self._step(p, greedy) for p in (plan, *later)]  # all queued before any result is waited for

    def execute_verify(self, plan: StepPlan) -> list[StepResult]:
        """A verify step's results (see launch_verify)."""
        return [pending.result() for pending in self.launch_verify(plan)]

    def launch_verify(self, plan: StepPlan) -> list:
        """Queue a verify step (speculative decoding): a row with d drafts runs its last token and the d drafts and
        picks at each of those d + 1 positions, noise keyed by each position, so pick j is what a plain decode would
        pick there; the row keeps its picks up to the first that differs from the next draft. The step's forward and
        sampler pass are any step's (_step); its pending results are one per pick index, as a burst's (tokens -1
        where a row kept fewer)."""
        self._check(plan)
        if not plan.num_drafts.any():
            raise PlanError("a verify step without drafts")
        return self._step(plan)

    def load_lora(self, slot: int, path: str) -> None:
        """Load the PEFT adapter at path into LoRA slot ("" empties it), between steps; ValueError naming what is
        wrong (LoRA not enabled, the slot, the adapter)."""
        if self.lora is None:
            raise ValueError("this runner serves no LoRA adapters (enable_lora, --enable-lora)")
        if path:
            self.lora.load(slot, path)
        else:
            self.lora.unload(slot)

    def forward_only(self, plan: StepPlan, *, sync: bool = True) -> torch.Tensor:
        """The same step without feeds or sampling: [S, V] logits of the sampling rows (the model's dtype).

        The forward-only floor for benchmarks (the plan's input_ids are used as they are). It writes
        the KV cache like execute does, and leaves execute's feed state alone.
        """
        self._check(plan)
        with torch.inference_mode():
            self._staging.begin()
            hidden = self._run_model(plan, self._staging.put("input_ids", plan.input_ids))
            logits = self._logits_of(plan, hidden, _Positions.of(plan, np.flatnonzero(plan.sample)))
            self._staging.end()
        if sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return logits

    def read_logits(self, step: int | None = None) -> np.ndarray:
        """float32 [R, V] raw logits of an executed step (default: the last); zero rows did not sample.

        `step` counts executed steps from 0; the last LOGITS_KEPT steps are kept. KeyError if gone.
        """
        for kept in reversed(list(self._logits)):  # a snapshot: LocalDevice may be appending
            if step is None or kept.step == step:
                out = np.zeros((kept.num_rows, self.info.vocab_size), dtype=np.float32)
                out[kept.rows] = kept.logits.float().cpu().numpy()
                return out
        raise KeyError(f"logits of step {step} are no longer kept")

    def resample(self, step: int, plan: StepPlan) -> PendingResult:
        """Executed step `step` picked again from its kept logits under plan's sampling arrays (a RESAMPLE ticket:
        a RepickOnly repair, its masks as they are now); plan's rows are the step's and the same rows sample. The
        sampler is the step's, so a row whose mask did not change picks what it picked. Nothing is fed from it: the
        engine launches nothing ahead of a repaired step. KeyError when the logits are gone, PlanError for rows
        that are not the step's."""
        kept = next((k for k in self._logits if k.step == step), None)
        if kept is None:
            raise KeyError(f"logits of step {step} are no longer kept")
        rows = np.flatnonzero(plan.sample)
        if plan.num_rows != kept.num_rows or not np.array_equal(rows, kept.rows):
            raise PlanError(f"a resample of step {step} for other rows than it sampled")
        self._check_sampling(plan)
        start = time.perf_counter()
        self._last_sample = self._last_picks = None
        with torch.inference_mode():
            self._staging.begin()
            out = self.sampler(kept.logits, plan, torch.from_numpy(rows))
            self._staging.end()
            return self._copier.start(plan.num_rows, rows, out, start)

    # ---- the step ------------------------------------------------------------------------------

    def _step(self, plan: StepPlan, greedy: bool | None = None):
        """Queue one checked step and its sampling (greedy: the sampler's plain-greedy test, when already known): its
        PendingResult, or for a step with drafts (a verify step) one pending result per pick index.

        A step samples at k positions of each sampling row: k = 1 (its last token) but for a row with d drafts,
        which samples at its last d + 1 tokens. One logits gather, one sampler pass over every position (each keyed
        by its own position), and for drafts the acceptance as tensor ops (_accepted): each row's count of kept
        picks, with no host round trip before the copies."""
        start = time.perf_counter()
        step = self.steps_executed
        self.steps_executed += 1
        prev_sample, self._last_sample = self._last_sample, None  # a failure leaves no feed source
        prev_picks, self._last_picks = self._last_picks, None
        with torch.inference_mode():
            self.swap.apply(plan)  # swapped-out blocks leave before this step may reuse them
            self._staging.begin()
            hidden = self._run_model(plan, self._inputs(plan, prev_sample))
            prompt = self._prompt_logprobs(plan, hidden) if plan.prompt_lp_count.any() else None
            pooled = pool_hidden(plan, hidden, self.model.model.norm, self._staging.put) if plan.pool.any() else None
            rows = np.flatnonzero(plan.sample)
            if len(rows) == 0:
                self._staging.end()
                self._last_tokens[: plan.num_rows].fill_(-1)
                self._last_sample = plan.sample.copy()
                return self._copier.start(plan.num_rows, rows, None, start, prompt, pooled)
            self._fill_fed_history(plan, prev_picks)
            at = _Positions.of(plan, rows)
            logits = self._logits_of(plan, hidden, at)
            if at.drafted:
                # Nothing is fed from a verify step (the host commits its picks), and its logits are never asked for
                # again (a model that could need a repair never speculates).
                out = self.sampler(logits, plan, torch.from_numpy(at.of_row), keys=at.keys)
                accepted = self._accepted(plan, at, out.tokens)
                self._staging.end()
                return self._copier.start_verify(plan.num_rows, at.of_row, at.within, out, accepted, start)
            # The sampler reads the rows on the host: hand it a host tensor, so it needs no device sync. When
            # every row samples, a greedy pick goes straight where the next step's feeds read it.
            kept = self._kept(plan.num_rows) if len(rows) == plan.num_rows else None
            out = self.sampler(logits, plan, torch.from_numpy(rows), greedy, out=kept)
            self._keep_tokens(plan, rows, out.tokens)
            self._staging.end()
            self._logits.append(_StepLogits(step, logits, rows, plan.num_rows))
            self._last_picks = self._copier.start(plan.num_rows, rows, out, start, prompt, pooled)
            return self._last_picks

    def _accepted(self, plan: StepPlan, at: _Positions, picks: torch.Tensor) -> torch.Tensor:
        """int64 [R] on the device: each row's kept picks (0 for a row that does not sample): up to and including
        its first pick that differs from the draft after it, all d + 1 when none does."""
        drafts = self._staging.put("verify_drafts", at.next_draft)
        last = self._staging.put("verify_last", at.last)
        within = self._staging.put("verify_within", at.within)
        wrong = (picks != drafts) & (within < last)  # a draft position whose pick rejects the draft
        stop = torch.where(wrong, within, last)  # where each pick would end its row's kept run
        accepted = torch.zeros(plan.num_rows, dtype=torch.int64, device=self.device)
        accepted.scatter_reduce_(0, self._staging.put("verify_rows", at.of_row), stop, "amin", include_self=False)
        return accepted.add_(self._staging.put("verify_sampling", plan.sample, torch.bool).long())

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> tuple:
        """The rows' prompt logprobs (StepPlan.prompt_lp_*): at each asked position the raw log-probability of the
        token after it, and the top N (the largest n asked) alternatives; device tensors float32 [P], int64 [P, N]
        and float32 [P, N] (None, None when N is 0). The vocabulary's logits are made a slice of positions at a
        time, so a long prompt chunk never holds [P, V] at once."""
        rows = np.flatnonzero(plan.prompt_lp_count > 0)
        counts = plan.prompt_lp_count[rows].astype(np.int64)
        firsts = plan.query_start[rows].astype(np.int64)
        before = np.cumsum(counts) - counts  # where each row's positions start in the output
        at = np.repeat(firsts - before, counts) + np.arange(int(counts.sum()))  # the positions' token indices
        after = at + 1
        inside = after < np.repeat(plan.query_start[rows + 1], counts)
        targets = np.where(inside, plan.input_ids[np.minimum(after, plan.num_tokens - 1)],
                           np.repeat(plan.prompt_lp_next[rows], counts)).astype(np.int64)
        n = max(int(plan.prompt_lp_n[rows].max()), 0)
        at_t, targets_t = self._staging.put("prompt_lp_at", at), self._staging.put("prompt_lp_targets", targets)
        lp = torch.empty(len(at), dtype=torch.float32, device=self.device)
        ids = torch.empty(len(at), n, dtype=torch.int64, device=self.device) if n else None
        top = torch.empty(len(at), n, dtype=torch.float32, device=self.device) if n else None
        for a in range(0, len(at), _PROMPT_LOGITS_SLICE):
            b = min(a + _PROMPT_LOGITS_SLICE, len(at))
            raw = torch.log_softmax(self.model.compute_logits(hidden[at_t[a:b]]).float(), dim=-1)
            lp[a:b] = raw.gather(1, targets_t[a:b, None]).squeeze(1)
            if n:
                best = torch.topk(raw, n, dim=-1, sorted=True)
                ids[a:b], top[a:b] = best.indices, best.values
        return lp, ids, top


    @staticmethod
    def _fill_fed_history(plan: StepPlan, prev: PendingResult | None) -> None:
        """Write each fed penalised row's fed token into the last slot of its history (step_builder._history),
        so its penalties count the token the host had not committed when it built the plan. The picks come from
        the previous step's copy to the host, whose event comes before this step's forward on the device: after
        that forward is queued, waiting for it never idles the device."""
        fed = np.flatnonzero(plan.feed_from_row >= 0)
        if not len(fed) or not len(plan.hist_tokens):
            return
        ends = plan.hist_start[fed + 1]
        fed, ends = fed[ends > plan.hist_start[fed]], ends[ends > plan.hist_start[fed]]
        if not len(fed):
            return
        if prev is None:
            raise PlanError(f"rows {fed.tolist()} are fed with penalties, and no step before them sampled")
        plan.hist_tokens[ends - 1] = prev.picks()[plan.feed_from_row[fed]]

    def _check(self, plan: StepPlan) -> None:
        """PlanError for a malformed plan or an index outside the model or the cache: caught here on
        the host, since on a GPU an out-of-range index is a device-side assert that ends the CUDA context."""
        t, r = plan.num_tokens, plan.num_rows
        if t == 0 or len(plan.query_start) != r + 1 or int(plan.query_start[-1]) != t:
            raise PlanError(f"invalid plan: {t} tokens, {r} rows, query_start ending {plan.query_start[-1:]}")
        q_lens = np.diff(plan.query_start)
        if int(q_lens.min()) < 1 or (plan.seq_lens < q_lens).any():
            raise PlanError("invalid plan: a row with no tokens, or a seq_len below its token count")
        host_fed = np.ones(t, dtype=bool)
        host_fed[plan.query_start[:-1][plan.feed_from_row >= 0]] = False
        if _outside(plan.input_ids[host_fed], self.info.vocab_size):
            raise PlanError("invalid plan: an input id outside the vocabulary")
        if _outside(plan.positions, self.info.max_model_len):
            raise PlanError("invalid plan: a position outside the model's context")
        if _outside(plan.slot_mapping, self.kv_cache.num_blocks * self.block_size):
            raise PlanError("invalid plan: a slot outside the KV cache")
        if _outside(plan.block_tables, self.kv_cache.num_blocks):
            raise PlanError("invalid plan: a block id outside the KV cache")
        if -(-int(plan.seq_lens.max()) // self.block_size) > plan.block_tables.shape[1]:
            raise PlanError("invalid plan: block_tables narrower than the longest row's seq_len needs")
        counts = plan.prompt_lp_count
        if counts.any():
            if (counts < 0).any() or (counts > q_lens).any() or (plan.prompt_lp_n[counts > 0] > self.max_logprobs).any():
                raise PlanError("invalid plan: prompt logprobs for more positions than a row runs, or over "
                                f"{self.max_logprobs} alternatives (--max-logprobs)")
            if _outside(plan.prompt_lp_next[(counts > 0) & (counts == q_lens)], self.info.vocab_size):
                raise PlanError("invalid plan: a row's prompt logprobs end past its tokens without a next token")
        check_pool(plan)
        if (plan.lora_slots >= 0).any() and (self.lora is None or _outside(plan.lora_slots[plan.lora_slots >= 0],
                                                                          len(self.lora.adapters))):
            raise PlanError("invalid plan: a row's LoRA slot is not one this runner holds")
        self._check_sampling(plan)
        if self.state is not None:
            slots = plan.state_slots
            if len(slots) != r or _outside(slots, self.state.num_slots):
                raise PlanError(f"invalid plan: a recurrent model needs a state slot in [0, {self.state.num_slots}) per row")
            if len(np.unique(slots)) != r:
                raise PlanError("invalid plan: two rows share a state slot")
            if plan.num_drafts.any():  # the engine core never speculates for such a model (engine._for_state_slots)
                raise PlanError("invalid plan: draft tokens for a recurrent model (its state cannot drop rejected ones)")

    def _check_sampling(self, plan: StepPlan) -> None:
        """PlanError for sampling arrays the sampler cannot read: grammar rows without as many bitmasks."""
        grammar_rows = int(np.count_nonzero(plan.mask_kind & MASK_GRAMMAR))
        if grammar_rows and (plan.grammar_bitmask.shape[0] != grammar_rows
                             or 32 * plan.grammar_bitmask.shape[1] < self.info.vocab_size):
            raise PlanError(f"invalid plan: {grammar_rows} grammar rows need as many bitmasks of the vocabulary, "
                            f"got {plan.grammar_bitmask.shape}")

    def _prepare(self, plan: StepPlan, input_ids: torch.Tensor) -> _Prepared:
        """Copy the plan's (checked) positions and slots to the device and build the attention metadata."""
        positions = self._staging.put("positions", plan.positions)
        slot_mapping = self.kv_cache.slot_index(self._staging.put("slot_mapping", plan.slot_mapping))
        meta = build_metadata(
            plan.query_start,
            plan.seq_lens,
            plan.block_tables,
            slot_mapping,
            block_size=self.block_size,
            windows=self.model.windows,
            device=self.device,
            dtype=self.model.dtype,
            native=self.model.uses_native_decode,
            masks=self.model.uses_masked_decode,
            varlen=self.model.uses_varlen_prefill,
            rows=self.model.uses_row_prefill,
            put=self._staging.put,
        )
        token_seq_lens = None
        threshold = self.model.rope_seq_len_threshold
        if threshold is not None and int(plan.seq_lens.max()) > threshold:
            token_seq_lens = self._staging.put("token_seq_lens", np.repeat(plan.seq_lens, np.diff(plan.query_start)))
        state = None
        if self.state is not None:  # resets the slots of rows that start at position 0
            state = build_state_step(self.state, plan.query_start, plan.positions, plan.state_slots, put=self._staging.put)
        return _Prepared(input_ids, positions, meta, token_seq_lens, state)

    def _inputs(self, plan: StepPlan, prev: np.ndarray | None) -> torch.Tensor:
        """The step's input ids on the device: the plan's, except that a fed row takes the previous step's
        sampled token of row feed_from_row[r].

        prev is the previous step's sample mask (None if it failed or there was none).
        """
        r = plan.num_rows
        if len(self._arange) < r:
            self._arange = np.arange(2 * r, dtype=np.int32)
        if plan.num_tokens == r and np.array_equal(plan.feed_from_row, self._arange[:r]):
            # Every row fed from itself (a decode step launched ahead, a burst's step): the kept tokens are the
            # inputs as they are; this step's picks overwrite them only after the forward has read them.
            if prev is None or len(prev) < r or not prev[:r].all():
                raise PlanError(f"rows 0..{r - 1} are fed from themselves: not all sampled in the previous step")
            return self._last_tokens[:r]
        input_ids = self._staging.put("input_ids", plan.input_ids)
        fed = np.flatnonzero(plan.feed_from_row >= 0)
        if len(fed) == 0:
            return input_ids
        src = plan.feed_from_row[fed]
        if prev is None or int(src.max()) >= len(prev) or not prev[src].all():
            raise PlanError(f"rows {fed.tolist()} are fed from rows {src.tolist()}: not all sampled in the previous step")
        if not (np.diff(plan.query_start)[fed] == 1).all():
            raise PlanError("a fed row must have exactly one token")
        token_idx = self._staging.put("fed_tokens", plan.query_start[fed])
        input_ids[token_idx] = self._last_tokens[self._staging.put("fed_src", src)]
        return input_ids

    def _run_model(self, plan: StepPlan, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of the step: a decode step through the decode graphs when they serve it (and
        no row has an adapter: a graph holds no LoRA product)."""
        adapted = self._adapted(plan)
        if self.graphs is not None and not adapted and self.graphs.serves(plan):
            return self.graphs.run(plan, input_ids)
        return self._eager(plan, input_ids, adapted)

    def _adapted(self, plan: StepPlan) -> bool:
        """Whether some row of the (checked) plan runs with a LoRA adapter (never, on a runner without LoRA)."""
        return self.lora is not None and bool((plan.lora_slots >= 0).any())

    def _eager(self, plan: StepPlan, input_ids: torch.Tensor, adapted: bool) -> torch.Tensor:
        """Hidden states [T, hidden] of the step through the model's layers, each row's adapter added (adapted: some
        row has one)."""
        if not adapted:
            return self._forward(self._prepare(plan, input_ids))
        self.lora.begin_step(np.repeat(plan.lora_slots, np.diff(plan.query_start)))
        try:
            return self._forward(self._prepare(plan, input_ids))
        finally:
            self.lora.end_step()

    def _forward(self, p: _Prepared) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's tokens."""
        if p.state is None:
            return self.model(p.input_ids, p.positions, self.kv_cache, p.meta, p.token_seq_lens)
        return self.model(p.input_ids, p.positions, self.kv_cache, p.meta, p.token_seq_lens, state=p.state)

    def _logits_of(self, plan: StepPlan, hidden: torch.Tensor, at: _Positions) -> torch.Tensor:
        """[P, V] logits (the model's dtype) at each sampling position."""
        if len(at.token) == plan.num_tokens:  # every token samples (a decode step): all of hidden
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[self._staging.put("sample_at", at.token)])

    def _kept(self, r: int) -> torch.Tensor:
        """The first r entries of the kept tokens (grown first when r exceeds them)."""
        if r > self._last_tokens.shape[0]:
            self._last_tokens = torch.empty(2 * r, dtype=torch.int64, device=self.device)
        return self._last_tokens[:r]

    def _keep_tokens(self, plan: StepPlan, rows: np.ndarray, tokens: torch.Tensor) -> None:
        """Remember this step's sampled tokens on the device: the next step's feeds read them."""
        r = plan.num_rows
        kept = self._kept(r)
        if len(tokens) == r:  # every row sampled (a decode step): one copy, none if the pick wrote them there
            if tokens.data_ptr() != kept.data_ptr():
                kept.copy_(tokens)
        else:
            kept.fill_(-1)
            self._last_tokens[self._staging.put("rows", rows)] = tokens
        self._last_sample = plan.sample.copy()

    # ---- setup ---------------------------------------------------------------------------------

    def _graphs_wanted(self, decode_graphs: bool | None) -> bool:
        """Whether decode steps go through DecodeGraphs: as asked (default: on CUDA), where the model allows."""
        want = self.device.type == "cuda" if decode_graphs is None else decode_graphs
        if not want:
            return False
        if not self.model.graph_safe:
            log.info("decode graphs off: %s's forward depends on host-side data", self.facts.architecture)
            return False
        if self.device.type == "cuda" and not self.model.graph_capturable:
            log.info("decode graphs off: an attention backend here cannot be captured (%s)",
                     ", ".join(sorted(self.model.attention_backends)))
            return False
        return True

    def _choose_num_blocks(self, num_kv_blocks: int | None, kv_cache_memory: int | None) -> int:
        """Blocks as asked, or as many as the byte budget holds (default: a share of free memory,
        capped at what max_num_seqs sequences of max_model_len could use)."""
        if num_kv_blocks is not None:
            return int(num_kv_blocks)
        kv = self.model.kv_shape
        # max(1): a model of recurrent layers only keeps no KV, but the engine still plans with blocks.
        per_block = max(1, PagedKVCache.bytes_per_block(kv.num_layers, self.block_size, kv.num_kv_heads, kv.head_dim, self.model.dtype))
        if kv_cache_memory is not None:
            return max(1, int(kv_cache_memory) // per_block)
        cap = self.max_num_seqs * math.ceil(self.facts.max_model_len / self.block_size) + 1
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * GPU_KV_CACHE_FRACTION) - GPU_RESERVED_BYTES
        else:
            budget = CPU_KV_CACHE_BYTES
        return max(1, min(cap, budget // per_block))


def _outside(values: np.ndarray, end: int) -> bool:
    """True when some value lies outside [0, end)."""
    return values.size > 0 and (int(values.min()) < 0 or int(values.max()) >= end)

"""FakeDevice: a deterministic toy model behind the Device protocol, with fault injection.

Its "KV cache" stores the token written at each slot, and every sampling row reads its whole context
back through its block table, so a wrong slot mapping, block table or prefix-cache hit changes the
output (and reading a never-written slot fails the step loudly). The next-token logits are a hash of
the row's last three tokens and its length; picks follow host_sampler.py's rules (the device sampler's).

With num_state_slots it is also a recurrent model (RepickOnly): each state slot holds the tokens its rows
have run since a row started it at position 0, every step advances it (over-runs included, as a real
recurrent state is), and a row whose slot does not hold exactly its context fails the step loudly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from metrale.ipc.plan import (
    FEED_HOST, POOL_FIRST, POOL_LAST, DeviceError, DeviceLost, FedAheadPolicy, ModelInfo, StepKind, StepPlan, StepResult, Ticket, check_ticket,
    moved_on,
)

from metrale.testing.host_sampler import SamplingRow, logprob_of, sample_row

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def uniform_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """float64[vocab] in (0, 1): a splitmix64 hash of (seed, position, token id) (the toy model's logits)."""
    with np.errstate(over="ignore"):
        x = np.uint64(seed) * _GOLDEN + np.uint64(position) * _M2 + np.arange(vocab, dtype=np.uint64) * _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        x = x ^ (x >> np.uint64(31))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


FAKE_HIDDEN = 8  # the toy model's hidden size (its pooled vectors' width)


def fake_hidden(context: np.ndarray | list[int]) -> np.ndarray:
    """The toy model's final hidden state at the last token of context: a function of every token before it and
    its place, as a causal model's is (float64 [FAKE_HIDDEN])."""
    tokens = np.asarray(context, dtype=np.float64)
    places = np.arange(1, len(tokens) + 1, dtype=np.float64)
    dims = np.arange(1, FAKE_HIDDEN + 1, dtype=np.float64)
    return np.cos(np.outer((tokens + 1.0) * places * 0.013, dims)).sum(axis=0) / len(tokens)

@dataclass(slots=True)
class FakeClock:
    """An injected clock that only moves when told to."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


@dataclass(slots=True)
class FakeFaults:
    """What goes wrong, by step number (0-based, in launch order)."""

    fail_steps: set[int] = field(default_factory=set)  # these steps raise DeviceError when awaited
    dead: bool = False  # the worker is gone: every launch and await fails
    poison_seq_len: int | None = None  # a plan with a row this long raises ValueError at launch (a host-side bug)


@dataclass(slots=True)
class StepRecord:
    """What one step ran: its rows' token counts and whether each sampled."""

    q_lens: list[int]
    sampled: list[bool]
    fed: bool


class FakeDevice:
    """A toy model that executes each step at launch, in order, and answers awaits from its results.

    deferred=True: a step runs only when it (or a later one) is awaited, as a real device runs behind the
    host: the host has built and launched the steps after it by then, so a plan the host changes after its
    launch (a buffer reused too soon) shows in the output.
    """

    def __init__(
        self,
        *,
        vocab_size: int = 48,
        num_kv_blocks: int = 256,
        block_size: int = 4,
        max_model_len: int = 1024,
        eos_token_ids: tuple[int, ...] = (1,),
        policy: FedAheadPolicy = FedAheadPolicy.REWIND,
        clock: FakeClock | None = None,
        step_cost: float = 0.0,
        faults: FakeFaults | None = None,
        num_swap_blocks: int = 0,
        max_burst: int = 1,
        deferred: bool = False,
        repetitive: bool = False,
        num_state_slots: int = 0,
        pooling: str = "last",
        matryoshka: bool = False,
        max_loras: int = 0,
    ):
        """max_burst > 1: the device also runs decode bursts (launch(plan, steps), await_burst);
        repetitive: the logits depend on the last token only (a model whose greedy output soon cycles, so
        prompt lookup's drafts are often right); num_state_slots > 0: a recurrent model (see the module
        docstring); pooling, matryoshka: how the toy model's embeddings are pooled (ModelInfo)."""
        self.info = ModelInfo(
            name="fake",
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            eos_token_ids=eos_token_ids,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            dtype="int",
            fed_ahead_policy=policy,
            num_swap_blocks=num_swap_blocks,
            num_state_slots=num_state_slots,
            hidden_size=FAKE_HIDDEN,
            pooling=pooling,
            matryoshka=matryoshka,
            max_loras=max_loras,
        )
        self.loras: dict[int, str] = {}
        self.state: list[list[int]] = [[] for _ in range(num_state_slots)]
        self.clock = clock or FakeClock()
        self.step_cost = step_cost
        self.faults = faults or FakeFaults()
        self.kv = np.full(num_kv_blocks * block_size, -1, dtype=np.int64)
        self.host_kv = np.full(num_swap_blocks * block_size, -1, dtype=np.int64)
        self.prev_tokens = np.zeros(0, dtype=np.int64)
        self.records: list[StepRecord] = []
        self.burst_limit = max_burst
        self._results: dict[int, StepResult | list[StepResult] | DeviceError] = {}
        self._logits: dict[int, np.ndarray] = {}
        self._launched = 0
        self.deferred = deferred
        self.repetitive = repetitive
        self._queued: list[tuple[int, StepPlan, StepKind, int]] = []  # launched, not yet run (deferred)
        self._failed = False  # a step failed and the host has not awaited it yet

    # ---- Device protocol ------------------------------------------------------------

    def launch(self, plan: StepPlan, kind: StepKind = StepKind.STEP, steps: int = 1) -> Ticket:
        if self.faults.dead:
            raise DeviceLost("the worker process is gone")
        check_ticket(kind, steps, self.burst_limit)
        assert (kind == StepKind.VERIFY) == bool(plan.num_drafts.any()), f"a {kind.name} ticket whose plan has drafts: {plan.num_drafts.any()}"
        poison = self.faults.poison_seq_len
        if poison is not None and len(plan.seq_lens) and int(plan.seq_lens.max()) >= poison:
            raise ValueError(f"poisoned plan: a row reaches {poison} tokens")
        n = self._launched
        self._launched += 1
        if self.deferred:
            self._queued.append((n, plan, kind, steps))
        else:
            self._run(n, plan, kind, steps)
        self.clock.advance(self.step_cost * steps)
        return Ticket(slot=0, seq=n)

    def _run(self, n: int, plan: StepPlan, kind: StepKind, steps: int) -> None:
        """Execute ticket n (a step, a verify step's picks, or a burst's steps) and keep its result."""
        try:
            if kind != StepKind.BURST:
                self._results[n] = self._execute(n, plan)
            else:
                bs = self.info.block_size
                self._results[n] = [self._execute(n, moved_on(plan, k, bs) if k else plan) for k in range(steps)]
        except DeviceError as e:
            self._results[n] = e
            self._failed = True

    def await_result(self, ticket: Ticket) -> StepResult:
        return self._await(ticket)

    def await_burst(self, ticket: Ticket) -> list[StepResult]:
        return self._await(ticket)

    def _await(self, ticket: Ticket):
        if self.faults.dead:
            self._results.pop(ticket.seq, None)
            raise DeviceLost("the worker process is gone")
        while ticket.seq not in self._results:  # deferred: run what was launched, in order, up to this one
            self._run(*self._queued.pop(0))
        result = self._results.pop(ticket.seq)
        if isinstance(result, DeviceError):
            self._failed = any(isinstance(r, DeviceError) for r in self._results.values())
            raise result
        return result

    def resample(self, ticket: Ticket, plan: StepPlan) -> StepResult:
        """The settled step of ticket picked again from the logits it kept, under plan's sampling arrays."""
        if self.faults.dead:
            raise DeviceLost("the worker process is gone")
        logits_all = self._logits.get(ticket.seq)
        if logits_all is None or len(logits_all) != plan.num_rows:
            raise DeviceError(f"step {ticket.seq}'s logits are not kept for {plan.num_rows} rows")
        picks = np.full((1, plan.num_rows), -1, dtype=np.int64)
        for r in np.flatnonzero(plan.sample):
            picks[0, r] = sample_row(logits_all[r], SamplingRow.of_plan(plan, r))
        return self._picked(plan, picks, logits_all)[0]

    def load_lora(self, slot: int, path: str) -> None:
        """Record the slot's adapter (the toy model's picks do not change with it)."""
        if not 0 <= slot < self.info.max_loras:
            raise DeviceError(f"LoRA slot {slot} outside this device's {self.info.max_loras}")
        if path:
            self.loras[slot] = path
        else:
            self.loras.pop(slot, None)

    def model(self) -> ModelInfo:
        return self.info

    def close(self) -> None:
        self._results.clear()
        self._queued.clear()

    def kill(self) -> None:
        """The worker dies: launched steps are lost."""
        self.faults.dead = True

    def revive(self) -> None:
        """A new worker: empty KV, nothing in flight."""
        self.faults.dead = False
        self._results.clear()
        self._queued.clear()
        self._failed = False
        self.kv.fill(-1)
        self.prev_tokens = np.zeros(0, dtype=np.int64)
        self.state = [[] for _ in self.state]

    @property
    def in_flight(self) -> int:
        """Launched steps nobody has awaited yet (a leak if non-zero at the end)."""
        return len(self._results) + len(self._queued)

    # ---- the toy model --------------------------------------------------------------

    def _execute(self, n: int, plan: StepPlan) -> StepResult | list[StepResult]:
        """Write the step's tokens into the fake KV, then pick a token for every sampling row (a verify step: at
        each of a drafted row's positions up to its first pick that differs from the next draft, one result
        per pick, as a burst's)."""
        if n in self.faults.fail_steps:
            raise DeviceError(f"injected failure of step {n}")
        if self._failed:
            # Launched behind a failure the host has not seen yet: its inputs never existed.
            raise DeviceError("an earlier step failed")
        self._swap(plan)
        input_ids = plan.input_ids.astype(np.int64)
        fed = bool((plan.feed_from_row != FEED_HOST).any())
        for r in np.nonzero(plan.feed_from_row != FEED_HOST)[0]:
            input_ids[plan.query_start[r]] = self.prev_tokens[plan.feed_from_row[r]]
            if plan.hist_start[r + 1] > plan.hist_start[r]:  # a penalised row's history ends with its fed token's slot
                plan.hist_tokens[plan.hist_start[r + 1] - 1] = self.prev_tokens[plan.feed_from_row[r]]
        self.kv[plan.slot_mapping] = input_ids
        R = plan.num_rows
        if self.state:
            self._advance_state(plan, input_ids)
        logits_all = np.zeros((R, self.info.vocab_size), dtype=np.float32)
        q_lens = np.diff(plan.query_start).tolist()
        drafts = plan.num_drafts.tolist()
        picks = np.full((max(drafts, default=0) + 1, R), -1, dtype=np.int64)
        for r in range(R):
            seq_len = int(plan.seq_lens[r])
            positions = plan.positions[plan.query_start[r] : plan.query_start[r + 1]]
            assert (positions == np.arange(seq_len - q_lens[r], seq_len)).all(), "positions do not end at seq_len"
            if not plan.sample[r]:
                continue
            if self.state:
                # The slot ran every token the row wrote, drafts included (a recurrent state cannot drop a
                # rejected draft again, which is why the engine never speculates for such a model).
                slot = self.state[plan.state_slots[r]]
                assert slot == self._read_context(plan.block_tables[r], seq_len).tolist(), (
                    f"row {r}'s state slot does not hold its context"
                )
            row = SamplingRow.of_plan(plan, r)
            d = drafts[r]
            for j in range(d + 1):  # j > 0: the j-th draft's position; stop at the first pick it contradicts
                length = seq_len - d + j
                logits = self._logits_for(self._read_context(plan.block_tables[r], length))
                logits_all[r] = logits
                row.position = length
                picks[j, r] = sample_row(logits, row)
                if j < d and picks[j, r] != input_ids[plan.query_start[r] + 1 + j]:
                    break
        self.prev_tokens = picks[0].copy()
        self._logits[n] = logits_all
        self._logits.pop(n - 4, None)
        self.records.append(StepRecord(q_lens, plan.sample.tolist(), fed))
        results = self._picked(plan, picks, logits_all)
        if plan.prompt_lp_count.any():
            self._prompt_logprobs(plan, input_ids, results[0])
        if plan.pool.any():
            results[0].pooled = self._pooled(plan)
        return results if any(drafts) else results[0]

    def _picked(self, plan: StepPlan, picks: np.ndarray, logits_all: np.ndarray) -> list[StepResult]:
        """One result per pick index (picks [J, R]; J > 1 for a verify step), with the logprobs the plan asks for."""
        R, tokens = plan.num_rows, picks[0]
        lp = np.zeros(R, dtype=np.float32) if (plan.num_logprobs >= 0).any() else None
        results = [StepResult(tokens=row.astype(np.int32), logprobs=lp) for row in picks]
        n = min(int(plan.num_logprobs.max(initial=0)), self.info.vocab_size)
        if n > 0 and len(picks) == 1:  # the raw distribution's top n, as the device sampler reports them (a beam's)
            z = logits_all.astype(np.float64)
            z -= z.max(axis=1, keepdims=True)
            logp = (z - np.log(np.exp(z).sum(axis=1, keepdims=True))).astype(np.float32)
            top = np.argsort(-logp, axis=1, kind="stable")[:, :n]
            for r in np.flatnonzero(plan.pinned_start[1:] > plan.pinned_start[:-1]):  # logprob_token_ids' rows
                ids = plan.pinned_ids[plan.pinned_start[r] : plan.pinned_start[r + 1]]
                top[r, : len(ids)] = ids
            results[0].top_ids = top.astype(np.int32)
            results[0].top_logprobs = np.take_along_axis(logp, top, axis=1)
            results[0].logprobs = np.take_along_axis(logp, np.maximum(tokens, 0)[:, None], axis=1)[:, 0]
        return results

    def _prompt_logprobs(self, plan: StepPlan, input_ids: np.ndarray, result: StepResult) -> None:
        """The toy model's prompt logprobs (StepPlan.prompt_lp_*): at each asked position, the log-probability of
        the token after it under the logits its context gives, and the top N."""
        n = max(int(plan.prompt_lp_n.max()), 0)
        lps, ids, tops = [], [], []
        for r in np.flatnonzero(plan.prompt_lp_count > 0):
            start, end = int(plan.query_start[r]), int(plan.query_start[r + 1])
            first = int(plan.positions[start])
            for j in range(int(plan.prompt_lp_count[r])):
                target = int(input_ids[start + j + 1]) if start + j + 1 < end else int(plan.prompt_lp_next[r])
                context = self._read_context(plan.block_tables[r], first + j + 1)
                lp = logprob_of(self._logits_for(context), target, n, self.info.vocab_size)
                lps.append(lp.logprob)
                ids.append(lp.top_ids)
                tops.append(lp.top_logprobs)
        result.prompt_logprobs = np.array(lps, dtype=np.float32)
        if n:
            result.prompt_top_ids = np.array(ids, dtype=np.int32).reshape(len(lps), n)
            result.prompt_top_logprobs = np.array(tops, dtype=np.float32).reshape(len(lps), n)

    def _pooled(self, plan: StepPlan) -> np.ndarray:
        """The pooled rows' vectors (StepPlan.pool) from the toy model's hidden states (fake_hidden of each token's
        context as the KV cache holds it)."""
        out = []
        for r in np.flatnonzero(plan.pool).tolist():
            start, end = int(plan.query_start[r]), int(plan.query_start[r + 1])
            first, kind = int(plan.positions[start]), int(plan.pool[r])
            at = {POOL_LAST: [end - start - 1], POOL_FIRST: [0]}.get(kind, range(end - start))
            contexts = [self._read_context(plan.block_tables[r], first + j + 1) for j in at]
            out.append(np.sum([fake_hidden(c) for c in contexts], axis=0))
        return np.array(out, dtype=np.float32)

    def _advance_state(self, plan: StepPlan, input_ids: np.ndarray) -> None:
        """Run each row's tokens through its state slot: reset at position 0, else continue exactly where the
        slot stands (anything else is a state the engine lost track of)."""
        assert len(plan.state_slots) == plan.num_rows, "a recurrent model's plan lacks its state slots"
        assert len(set(plan.state_slots.tolist())) == plan.num_rows, "two rows share a state slot"
        for r, slot in enumerate(plan.state_slots.tolist()):
            start, end = int(plan.query_start[r]), int(plan.query_start[r + 1])
            first = int(plan.positions[start])
            if first == 0:
                self.state[slot] = []
            assert len(self.state[slot]) == first, f"row {r} continues at {first}, its slot holds {len(self.state[slot])} tokens"
            self.state[slot].extend(input_ids[start:end].tolist())

    def _swap(self, plan: StepPlan) -> None:
        """Copy blocks out to host, then in. A swapped-out device block keeps its content, as a real device's
        does: another sequence may still share it (a prefix block), and one that reuses it writes it first."""
        bs = self.info.block_size
        for d, h in plan.swap_out.tolist():
            self.host_kv[h * bs : (h + 1) * bs] = self.kv[d * bs : (d + 1) * bs]
        for h, d in plan.swap_in.tolist():
            if h < 0:  # a device copy (ipc/plan.py)
                self.kv[d * bs : (d + 1) * bs] = self.kv[(-1 - h) * bs : (-h) * bs]
                continue
            self.kv[d * bs : (d + 1) * bs] = self.host_kv[h * bs : (h + 1) * bs]
            self.host_kv[h * bs : (h + 1) * bs] = -1

    def _read_context(self, block_table: np.ndarray, seq_len: int) -> np.ndarray:
        """The tokens of a row's KV, read back through its block table."""
        bs = self.info.block_size
        pos = np.arange(seq_len)
        slots = block_table[pos // bs].astype(np.int64) * bs + pos % bs
        context = self.kv[slots]
        assert (context >= 0).all(), "a step read KV that was never written"
        return context

    def _logits_for(self, context: np.ndarray) -> np.ndarray:
        """Peaked pseudo-random logits that depend on the last three tokens and the length."""
        recent = context[-1:] if self.repetitive else context[-3:]
        key = hash((tuple(recent.tolist()), 0 if self.repetitive else len(context))) & (2**63 - 1)
        return (uniform_noise(key, 0, self.info.vocab_size) * 8.0).astype(np.float32)

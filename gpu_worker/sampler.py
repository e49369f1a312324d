"""The device-side sampler: penalties, masks, temperature, top-k/top-p/min-p, seeded picks and logprobs.

Everything is batched over the S sampling rows; the only per-row Python is numpy over the plan's small
per-row arrays. Semantics follow vLLM: logit_bias is added first (to a copy: logprobs stay the raw logits'),
penalties (and bans) change the logits every pick sees, greedy
rows take the argmax of those, sampled rows divide by the temperature, then top-k, top-p (over the
top-k survivors) and min-p mask tokens out, and the pick is a Gumbel-max draw.

Batch invariance: a row's noise is a splitmix64 hash of (seed, position, vocab index), computed with
integer torch ops, so a row's token depends on its own logits and parameters only — never on the other
rows nor on a shared generator — and every filter is a row-local operation whose result is unchanged
for rows that do not ask for it.

Agreement: the noise's logs, min-p's log and top-p's weights are not torch's log and exp but the rules
ipc/sampling_rules.py defines (log32, exp_weights: IEEE + - * / in a fixed order), computed here
op for op, so the device, the native kernels and the numpy sampler (metrale/testing) give the same bits on every CPU and
vector unit; top-p compares exact integer masses.

On a CPU where the native kernels are loaded, the picks are one fused kernel per row
(layers/cpu_sampling.cpp: penalties over the history's cells, top-k and top-p without a sort of the
vocabulary, noise only where a token survived), the same picks as the torch path below, which stays the
path of every other device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from metrale.gpu_worker.layers import cpu_kernels
from metrale.ipc import sampling_rules as rules
from metrale.ipc.plan import MASK_BAN, MASK_FORCE, MASK_GRAMMAR, MASK_GREEDY, StepPlan
from metrale.ipc.sampling_rules import GREEDY_EPS, NOISE_BITS, row_keys

# Elements hashed per chunk (whole rows): bounds the integer scratch whatever S is. On CPU the size
# barely matters; on an accelerator a big chunk keeps kernel launches few (scratch 2 x 128 + 2 x 64 MiB at most).
NOISE_CHUNK_CPU = 1 << 17
NOISE_CHUNK_DEVICE = 1 << 24

# The shared rules' float32 constants (ipc/sampling_rules.py) as Python floats (exact) for torch's scalars.
_LG1, _LG2, _LG3, _LG4 = (float(c) for c in (rules.LG1, rules.LG2, rules.LG3, rules.LG4))
_LN2_HI, _LN2_LO = float(rules.LN2_HI), float(rules.LN2_LO)
_LOG2E, _C1, _C2 = float(rules.LOG2E), float(rules.C1), float(rules.C2)
_P = tuple(float(c) for c in rules.P)


def _as_int64(x: int) -> int:
    """The signed int64 with the same bits as the unsigned 64-bit x (what torch holds)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix64_(z: torch.Tensor, tmp: torch.Tensor) -> None:
    """splitmix64's finaliser in place over int64 torch values; tmp is scratch of z's shape.

    torch's int64 multiply wraps like uint64's does; its right shift is arithmetic, so each shifted
    value is masked to the bits a logical shift would keep.
    """
    for shift, mult in ((30, rules.MIX1), (27, rules.MIX2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)
        z.bitwise_xor_(tmp)
        if mult is not None:
            z.mul_(_as_int64(mult))


def _log32_(x: torch.Tensor, scratch: tuple[torch.Tensor, ...]) -> None:
    """x = log32(x) in place for positive normal float32 x: sampling_rules.log32, operation for operation (the
    same bits on any device). scratch: five float32 tensors of x's shape (any strides)."""
    a, b, c, d, e = scratch
    xi, ai, bi, ci, di = (t.view(torch.int32) for t in (x, a, b, c, d))
    torch.bitwise_and(xi, 0x7FFFFF, out=bi)  # the mantissa
    torch.add(bi, 0x4AFB20, out=ci)
    ci.bitwise_and_(0x800000)  # set where the mantissa is >= sqrt(2): it is halved
    torch.bitwise_right_shift(xi, 23, out=ai)
    ai.add_(-127)
    torch.bitwise_right_shift(ci, 23, out=di)
    ai.add_(di)  # the exponent
    ci.bitwise_xor_(0x3F800000)
    bi.bitwise_or_(ci)
    x.copy_(ai)  # dk
    b.sub_(1.0)  # f
    torch.add(b, 2.0, out=c)
    torch.div(b, c, out=c)  # s
    torch.mul(c, c, out=a)  # z
    torch.mul(a, a, out=d)  # w
    torch.mul(d, _LG3, out=e)
    e.add_(_LG1).mul_(a)  # t2
    torch.mul(d, _LG4, out=a)
    a.add_(_LG2).mul_(d)  # t1
    e.add_(a)  # r
    torch.mul(b, 0.5, out=a)
    a.mul_(b)  # hfsq
    e.add_(a).mul_(c)
    torch.mul(x, _LN2_LO, out=d)
    e.add_(d)
    a.sub_(e).sub_(b)
    x.mul_(_LN2_HI).sub_(a)


def _exp_weights(t: torch.Tensor) -> torch.Tensor:
    """int32 floor(e^t * 2^30) for float32 t <= 0: sampling_rules.exp_weights, operation for operation."""
    t = t.clamp_min(-64.0)
    n = torch.mul(t, _LOG2E).add_(0.5).floor_()
    r = torch.sub(t, torch.mul(n, _C1)).sub_(torch.mul(n, _C2))
    p = torch.mul(r, _P[0]).add_(_P[1])
    for c in _P[2:]:
        p.mul_(r).add_(c)
    p.mul_(r * r).add_(r).add_(1.0)
    scale = n.to(torch.int32).add_(157).bitwise_left_shift_(23).view(torch.float32)  # 2^(n + 30)
    return p.mul_(scale).to(torch.int32)


def log32(values: np.ndarray) -> np.ndarray:
    """log32 of a few host float32 values (min-p's bounds), through the torch rule on the CPU."""
    x = torch.from_numpy(np.array(values, dtype=np.float32))
    _log32_(x, tuple(torch.empty_like(x) for _ in range(5)))
    return x.numpy()


def argmax(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's argmax (the first index among ties), int64, written into out when given.

    On a CPU where the model runner loaded the native kernels, one vectorised pass per row (about 3x
    faster than torch's); otherwise max().indices, itself ~3x faster than torch.argmax on CPU.
    """
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and cpu_kernels.loaded():
        return cpu_kernels.argmax_rows(x.contiguous(), out)
    indices = x.max(dim=-1).indices
    return indices if out is None else out.copy_(indices)


@dataclass(slots=True)
class SamplerOutput:
    """One step's picks for the S sampling rows, and their logprobs when any row asked."""

    tokens: torch.Tensor  # int64 [S]
    logprobs: torch.Tensor | None  # float32 [S]: the pick's log-prob under the raw model distribution
    top_ids: torch.Tensor | None  # int64 [S, N], N = max num_logprobs (None when N == 0)
    top_logprobs: torch.Tensor | None  # float32 [S, N], sorted descending


@dataclass(slots=True)
class _Batch:
    """The sampling rows' parameters, gathered on the host, with the batch-wide decisions they imply."""

    rows: np.ndarray  # int64 [S]: plan row of each sampling row
    greedy: np.ndarray  # bool [S]
    penalised: np.ndarray  # bool [S]
    banned: np.ndarray  # bool [S]
    forced: np.ndarray  # bool [S]
    grammar: np.ndarray  # bool [S]: the pick is limited to the row's grammar bitmask
    biased: np.ndarray  # bool [S]: the row has a logit_bias
    top_k_on: np.ndarray  # bool [S]
    top_p_on: np.ndarray  # bool [S]
    min_p_on: np.ndarray  # bool [S]
    max_logprobs: int  # -1 when no row wants logprobs
    pinned: np.ndarray  # bool [S]: the row's alternatives are its logprob_token_ids (plan.pinned_*)
    keys: np.ndarray  # int [S]: the position each pick's noise is keyed by (its KV length once its token is in)


def _gather(plan: StepPlan, rows: np.ndarray, vocab_size: int, keys: np.ndarray | None = None) -> _Batch:
    """Read the sampling rows' parameters from the plan and decide which stages the step needs."""
    mask = plan.mask_kind[rows]
    greedy = (plan.temperature[rows] < GREEDY_EPS) | ((mask & MASK_GREEDY) != 0)
    top_k = plan.top_k[rows]
    num_logprobs = plan.num_logprobs[rows]
    return _Batch(
        rows=rows,
        greedy=greedy,
        penalised=(plan.repetition_penalty[rows] != 1.0)
        | (plan.presence_penalty[rows] != 0.0)
        | (plan.frequency_penalty[rows] != 0.0),
        banned=(mask & MASK_BAN) != 0,
        forced=(mask & MASK_FORCE) != 0,
        grammar=(mask & MASK_GRAMMAR) != 0,
        biased=plan.bias_start[rows + 1] > plan.bias_start[rows],
        top_k_on=~greedy & (top_k > 0) & (top_k < vocab_size),
        top_p_on=~greedy & (plan.top_p[rows] < 1.0),
        min_p_on=~greedy & (plan.min_p[rows] > 0.0),
        max_logprobs=int(num_logprobs.max()) if len(rows) else -1,
        pinned=plan.pinned_start[rows + 1] > plan.pinned_start[rows],
        keys=plan.seq_lens[rows] if keys is None else keys,
    )


def _plain_greedy(plan: StepPlan, rows: np.ndarray | None) -> bool:
    """True when a plain argmax of the logits is the whole answer: every sampling row greedy (by temperature
    or mask), with no ban, forced token, penalty, logit_bias or logprobs. rows None: every row of the plan
    (whole-array reductions, no gather)."""
    pick = (lambda a: a) if rows is None else (lambda a: a[rows])
    mask = pick(plan.mask_kind)
    biased = len(plan.bias_ids) and (pick(plan.bias_start[1:]) > pick(plan.bias_start[:-1])).any()
    return bool(
        not biased
        and not (mask & (MASK_BAN | MASK_FORCE | MASK_GRAMMAR)).any()
        and ((pick(plan.temperature) < GREEDY_EPS) | ((mask & MASK_GREEDY) != 0)).all()
        and pick(plan.num_logprobs).max(initial=-1) < 0
        and (pick(plan.repetition_penalty) == 1.0).all()
        and not pick(plan.presence_penalty).any()
        and not pick(plan.frequency_penalty).any()
    )


class Sampler:
    """Picks one token per sampling row from its logits, as the plan's per-row parameters say."""

    def __init__(self, vocab_size: int, device: torch.device):
        """Prepare the vocab-wide constants; the [S, V] scratch grows to the largest S seen."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        with np.errstate(over="ignore"):
            steps = (np.arange(1, vocab_size + 1, dtype=np.uint64) * np.uint64(rules.GOLDEN)).view(np.int64)
        self._vocab_steps = torch.from_numpy(steps).to(self.device)  # splitmix64's stream increments
        self._capacity = 0
        self._work = self._hash = self._scratch = self._noise = self._mask = None
        self._bit_shifts: torch.Tensor | None = None
        self._params_f = self._params_i = None  # the native kernel's per-row parameters (see _native_params)

    def __call__(
        self, logits: torch.Tensor, plan: StepPlan, rows: torch.Tensor, greedy: bool | None = None, out: torch.Tensor | None = None,
        keys: np.ndarray | None = None,
    ) -> SamplerOutput:
        """Sample one token for each of the S rows of logits (plan row rows[i] for logits[i]).

        greedy: plain_greedy's answer for these rows when the caller knows it already (a decode burst).
        out: int64 [S] where a plain greedy pick may write its tokens (other picks return their own).
        keys: the position each pick's noise is keyed by, where it is not its row's seq_len (a verify step picks
        at several positions of one row)."""
        # Pass rows on the CPU: the plan's arrays are host numpy, and a device rows tensor costs a sync.
        rows_np = rows.numpy() if rows.device.type == "cpu" else rows.cpu().numpy()
        rows_np = rows_np.astype(np.int64, copy=False)
        if greedy is None:
            greedy = _plain_greedy(plan, None if len(rows_np) == plan.num_rows else rows_np)
        if greedy:
            return SamplerOutput(argmax(logits, out), None, None, None)
        batch = _gather(plan, rows_np, self.vocab_size, keys)
        raw = logits
        if batch.biased.any():
            logits = self._with_bias(logits, plan, batch)
        if self._native(logits):
            tokens = self._pick_native(logits, plan, batch)
        else:
            work = self._scratch_rows(len(rows_np))
            work.copy_(logits)
            if batch.penalised.any():
                self._apply_penalties(work, plan, batch)
            if batch.grammar.any():
                self._apply_grammar(work, plan, batch)
            if batch.banned.any():
                self._apply_bans(work, plan, batch)
            tokens = self._pick(work, plan, batch)
        if batch.forced.any():
            forced = self._to_device(plan.force_token[batch.rows].astype(np.int64))
            tokens = torch.where(self._to_device(batch.forced), forced, tokens)
        return self._with_logprobs(raw, tokens, plan, batch)

    @staticmethod
    def plain_greedy(plan: StepPlan) -> bool:
        """True when every row of the plan picks by a plain argmax (see _plain_greedy)."""
        return _plain_greedy(plan, None)

    def noise(self, seeds: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Gumbel noise float32 [S, V] for rows keyed by (seed, position): a new tensor, for tests (the native
        kernel's where it would sample)."""
        out = torch.zeros(len(seeds), self.vocab_size, dtype=torch.float32, device=self.device)
        if self._native(out):
            cpu_kernels.ops().gumbel_noise(torch.from_numpy(row_keys(seeds, positions)), out)
        else:
            self._add_noise(out, seeds, positions)
        return out

    def _add_noise(self, work: torch.Tensor, seeds: np.ndarray, positions: np.ndarray) -> None:
        """Add each row's Gumbel noise to work, a few rows at a time so the integer scratch stays small.

        Every op is element-wise, so a row's noise is the same bits whichever chunk it falls in.
        """
        keys = self._to_device(row_keys(seeds, positions))
        z_all, tmp_all, g_all, extra = self._noise_scratch()
        step = z_all.shape[0]
        for first in range(0, len(keys), step):
            n = min(step, len(keys) - first)
            z, tmp, g = z_all[:n], tmp_all[:n], g_all[:n]
            torch.add(keys[first : first + n, None], self._vocab_steps[None, :], out=z)
            _mix64_(z, tmp)
            torch.bitwise_right_shift(z, 64 - NOISE_BITS, out=tmp)
            tmp.bitwise_and_((1 << NOISE_BITS) - 1)
            g.copy_(tmp)
            # u = (k + 0.5) / 2**23 lies strictly inside (0, 1), so -log(-log(u)) is always finite. The hash's
            # integer scratch is free now: its halves serve log32 as float32 scratch.
            g.add_(0.5).mul_(2.0**-NOISE_BITS)
            v = self.vocab_size
            halves = (z.view(torch.float32), tmp.view(torch.float32))
            scratch = (halves[0][:, :v], halves[0][:, v:], halves[1][:, :v], halves[1][:, v:], extra[:n])
            _log32_(g, scratch)
            g.neg_()
            _log32_(g, scratch)
            g.neg_()
            work[first : first + n].add_(g)

    def _noise_scratch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The hash scratch (two int64 and two float32 [chunk, V]), made on first use and kept."""
        if self._hash is None:
            budget = NOISE_CHUNK_CPU if self.device.type == "cpu" else NOISE_CHUNK_DEVICE
            shape = (max(1, budget // self.vocab_size), self.vocab_size)
            self._hash = torch.empty(shape, dtype=torch.int64, device=self.device)
            self._scratch = torch.empty(shape, dtype=torch.int64, device=self.device)
            self._noise = torch.empty((2, *shape), dtype=torch.float32, device=self.device)
        return self._hash, self._scratch, self._noise[0], self._noise[1]

    def _native(self, x: torch.Tensor) -> bool:
        """True when x's rows are picked by the native kernel: a CPU sampler whose process loaded the kernels
        (the model runner does, on CPU) with the sampling unit, and float32 or bfloat16 [S, V] rows."""
        return (
            self.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16)
            and cpu_kernels.loaded() and cpu_kernels.has("sample_rows")
        )

    def _pick_native(self, logits: torch.Tensor, plan: StepPlan, batch: _Batch) -> torch.Tensor:
        """The picks of every row in one native call (layers/cpu_sampling.cpp), the torch path's tokens. Grammar
        and bans first set their -inf in a float32 copy (penalties leave -inf as it is, so their order holds)."""
        n = len(batch.rows)
        x = logits if logits.is_contiguous() else logits.contiguous()
        if batch.grammar.any() or batch.banned.any():
            x = self._scratch_rows(n)
            x.copy_(logits)
            if batch.grammar.any():
                self._apply_grammar(x, plan, batch)
            if batch.banned.any():
                self._apply_bans(x, plan, batch)
        fparams, iparams = self._native_params(plan, batch)
        tokens = torch.empty(n, dtype=torch.int64)
        cpu_kernels.ops().sample_rows(x, fparams, iparams, torch.from_numpy(plan.hist_tokens), tokens)
        return tokens

    def _native_params(self, plan: StepPlan, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' parameters as sample_rows reads them: float32 [6, S] (temperature, 0 for greedy rows; top_p,
        1 when off; log32(min_p), -inf when off; repetition, frequency, presence) and int64 [5, S] (top_k, 0 when
        off; noise key; history start and length, 0 without penalties; prompt length), in buffers kept between
        steps."""
        rows, n = batch.rows, len(batch.rows)
        if self._params_f is None or self._params_f.shape[1] < n:
            self._params_f = np.empty((6, max(n, 64)), dtype=np.float32)
            self._params_i = np.empty((5, max(n, 64)), dtype=np.int64)
        f = self._params_f.reshape(-1)[: 6 * n].reshape(6, n)
        i = self._params_i.reshape(-1)[: 5 * n].reshape(5, n)
        f[0] = np.where(batch.greedy, 0.0, plan.temperature[rows])
        f[1] = np.where(batch.top_p_on, plan.top_p[rows], 1.0)
        f[2] = self._log_min_p(plan, batch)
        f[3] = plan.repetition_penalty[rows]
        f[4] = plan.frequency_penalty[rows]
        f[5] = plan.presence_penalty[rows]
        i[0] = np.where(batch.top_k_on, plan.top_k[rows], 0)
        i[1] = row_keys(plan.seeds[rows], batch.keys)
        i[2] = plan.hist_start[rows]
        i[3] = np.where(batch.penalised, plan.hist_start[rows + 1] - i[2], 0)
        i[4] = plan.hist_prompt_len[rows]
        return torch.from_numpy(f), torch.from_numpy(i)

    @staticmethod
    def _log_min_p(plan: StepPlan, batch: _Batch) -> np.ndarray:
        """float32 [S]: log32(min_p) of min-p rows (the bound on x - max), -inf for the others."""
        if not batch.min_p_on.any():
            return np.full(len(batch.rows), -np.inf, dtype=np.float32)
        min_p = np.where(batch.min_p_on, plan.min_p[batch.rows], 1.0)
        return np.where(batch.min_p_on, log32(min_p), -np.inf).astype(np.float32)

    def _scratch_rows(self, n: int) -> torch.Tensor:
        """The float32 [n, V] work buffer (and the bool mask beside it), grown when n exceeds the capacity."""
        if n > self._capacity:
            shape = (n, self.vocab_size)
            self._work = torch.empty(shape, dtype=torch.float32, device=self.device)
            self._mask = torch.empty(shape, dtype=torch.bool, device=self.device)
            self._capacity = n
        return self._work[:n]

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """A small host array as a tensor on the sampler's device, copied without a device sync."""
        host = torch.from_numpy(np.ascontiguousarray(a))
        if self.device.type == "cpu":
            return host
        # Through (cached) pinned memory so the copy is truly asynchronous: the host never waits on
        # the kernels queued ahead of it.
        return host.pin_memory().to(self.device, non_blocking=True)

    def _with_bias(self, logits: torch.Tensor, plan: StepPlan, batch: _Batch) -> torch.Tensor:
        """A float32 copy of the logits with each biased row's logit_bias added (one float32 addition a cell, as
        the host sampler's), the stage before every other; ids outside the vocabulary are skipped."""
        rows = batch.rows
        starts = plan.bias_start[rows].astype(np.int64)
        lens = np.where(batch.biased, plan.bias_start[rows + 1] - starts, 0)
        total = int(lens.sum())
        within = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
        at = np.repeat(starts, lens) + within
        ids = plan.bias_ids[at].astype(np.int64)
        valid = (ids >= 0) & (ids < self.vocab_size)
        cells = (np.repeat(np.arange(len(rows)), lens) * self.vocab_size + ids)[valid]
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        out.copy_(logits)
        out.view(-1).index_add_(0, self._to_device(cells), self._to_device(plan.bias_values[at][valid]))
        return out

    def _apply_penalties(self, work: torch.Tensor, plan: StepPlan, batch: _Batch) -> None:
        """vLLM's penalties, touching only the (row, token) cells that occur in a row's history.

        Repetition over prompt and output (divide positive logits, multiply negative ones), then
        frequency (times the output count) and presence (once) over output tokens only.
        """
        rows, vocab = batch.rows, self.vocab_size
        starts = plan.hist_start[rows].astype(np.int64)
        lens = np.where(batch.penalised, plan.hist_start[rows + 1] - starts, 0)
        total = int(lens.sum())
        if total == 0:
            return
        first = np.cumsum(lens) - lens  # where each row's history begins in the gathered list
        within = np.arange(total) - np.repeat(first, lens)
        tokens = plan.hist_tokens[np.repeat(starts, lens) + within].astype(np.int64)
        row_of = np.repeat(np.arange(len(rows)), lens)
        is_output = within >= np.repeat(plan.hist_prompt_len[rows], lens)
        valid = (tokens >= 0) & (tokens < vocab)
        cells = row_of[valid] * vocab + tokens[valid]
        seen = np.unique(cells)
        out_cells, out_counts = np.unique(cells[is_output[valid]], return_counts=True)

        flat = work.view(-1)
        seen_dev = self._to_device(seen)
        rep = self._to_device(plan.repetition_penalty[rows][seen // vocab].astype(np.float32))
        x = flat[seen_dev]
        flat[seen_dev] = torch.where(x > 0, x / rep, x * rep)
        if len(out_cells):
            out_rows = rows[out_cells // vocab]
            out_dev = self._to_device(out_cells)
            freq_times_count = plan.frequency_penalty[out_rows] * out_counts.astype(np.float32)
            x = flat[out_dev]
            x -= self._to_device(freq_times_count.astype(np.float32))
            x -= self._to_device(plan.presence_penalty[out_rows].astype(np.float32))
            flat[out_dev] = x

    def _apply_grammar(self, work: torch.Tensor, plan: StepPlan, batch: _Batch) -> None:
        """Set every token outside a grammar row's bitmask to -inf (structured outputs), before any other stage:
        penalties aside, the pick is the unconstrained one among the tokens the grammar allows."""
        bitmask_of = np.cumsum((plan.mask_kind & MASK_GRAMMAR) != 0) - 1  # plan row -> its grammar_bitmask row
        at = np.flatnonzero(batch.grammar)
        words = self._to_device(plan.grammar_bitmask[bitmask_of[batch.rows[at]]])  # int32 [n, W]
        if self._bit_shifts is None:
            self._bit_shifts = torch.arange(32, dtype=torch.int32, device=self.device)
        bits = (words[:, :, None] >> self._bit_shifts) & 1  # [n, W, 32]: bit b of word w is token 32 w + b
        refused = (bits.view(len(at), -1)[:, : self.vocab_size] == 0)
        idx = self._to_device(at.astype(np.int64))
        work[idx] = work[idx].masked_fill_(refused, -math.inf)

    def _apply_bans(self, work: torch.Tensor, plan: StepPlan, batch: _Batch) -> None:
        """Set the banned ids of MASK_BAN rows to -inf, for greedy and sampled picks alike."""
        ids = plan.ban_ids[batch.rows].astype(np.int64)
        keep = (ids >= 0) & (ids < self.vocab_size) & batch.banned[:, None]
        cells = (np.arange(len(batch.rows))[:, None] * self.vocab_size + ids)[keep]
        if len(cells):
            work.view(-1).index_fill_(0, self._to_device(cells), -math.inf)

    def _pick(self, work: torch.Tensor, plan: StepPlan, batch: _Batch) -> torch.Tensor:
        """Greedy rows take the argmax; the others a seeded Gumbel-max draw from their filtered logits."""
        greedy_tokens = argmax(work) if batch.greedy.any() else None
        if batch.greedy.all():
            return greedy_tokens
        rows = batch.rows
        temperature = np.where(batch.greedy, 1.0, plan.temperature[rows]).astype(np.float32)
        work.div_(self._to_device(temperature)[:, None])
        if batch.top_k_on.any() or batch.top_p_on.any():
            self._apply_top_k_top_p(work, plan, batch)
        if batch.min_p_on.any():
            self._apply_min_p(work, plan, batch)
        self._add_noise(work, plan.seeds[rows], batch.keys)
        sampled = argmax(work)
        if greedy_tokens is None:
            return sampled
        return torch.where(self._to_device(batch.greedy), greedy_tokens, sampled)

    def _apply_top_k_top_p(self, work: torch.Tensor, plan: StepPlan, batch: _Batch) -> None:
        """Mask every token below its row's cutoff: the k-th largest value, raised to the nucleus's smallest.

        Both filters keep all tokens at or above a value, so ties with the boundary token stay (vLLM's
        top-k rule), and the result does not depend on how a sort orders equal values.
        """
        n, vocab = work.shape
        rows = batch.rows
        top_k = np.where(batch.top_k_on, plan.top_k[rows], vocab).astype(np.int64)
        largest = self._largest(work, batch, top_k)  # [n, W]: each row's W largest values, descending
        kth = largest.gather(1, self._to_device(top_k.clip(max=largest.shape[1]) - 1)[:, None])
        cutoff = torch.where(self._to_device(batch.top_k_on)[:, None], kth, -math.inf)
        if batch.top_p_on.any():
            # The nucleus is the tokens whose strictly larger neighbours weigh less than top_p of what top-k
            # left (vLLM's "drop while the ascending cumsum <= 1 - top_p"), in host_sampler's integer weights:
            # exact sums, so the same set on every device.
            weight = _exp_weights(largest - largest[:, :1]).long().masked_fill_(largest < cutoff, 0)
            cumulative = weight.cumsum_(dim=-1)
            before = torch.nn.functional.pad(cumulative[:, :-1], (1, 0)).double()
            top_p = self._to_device(np.where(batch.top_p_on, plan.top_p[rows], 1.0).astype(np.float64))
            inside = (before < top_p[:, None] * cumulative[:, -1:].double()).sum(dim=-1, keepdim=True)
            smallest_kept = largest.gather(1, inside.clamp_(min=1) - 1)  # the largest token always stays
            cutoff = torch.where(self._to_device(batch.top_p_on)[:, None], smallest_kept, cutoff)
        torch.lt(work, cutoff, out=self._mask[:n])
        work.masked_fill_(self._mask[:n], -math.inf)

    def _largest(self, work: torch.Tensor, batch: _Batch, top_k: np.ndarray) -> torch.Tensor:
        """Each row's largest values in descending order: enough of them to place both cutoffs.

        Top-k alone needs the k_max largest. Top-p needs every token top-k keeps: when each top-p row
        also has a top-k, the k_max + 1 largest suffice unless a tie at the k-th value runs past them
        (checked on the host, so only on CPU where it costs no device sync); otherwise a full sort.
        """
        vocab = work.shape[1]
        k_max = int(top_k[batch.top_k_on].max()) if batch.top_k_on.any() else vocab
        if not batch.top_p_on.any():
            return torch.topk(work, k_max, dim=-1, sorted=True).values
        if self.device.type == "cpu" and not (batch.top_p_on & ~batch.top_k_on).any() and 8 * k_max < vocab:
            largest = torch.topk(work, k_max + 1, dim=-1, sorted=True).values
            kth = largest.gather(1, self._to_device(top_k.clip(max=k_max) - 1)[:, None])
            tie_runs_past = (largest[:, -1:] == kth)[self._to_device(batch.top_p_on)]
            if not bool(tie_runs_past.any()):
                return largest
        return torch.sort(work, dim=-1, descending=True).values

    def _apply_min_p(self, work: torch.Tensor, plan: StepPlan, batch: _Batch) -> None:
        """Mask tokens whose probability is below min_p times the row's largest (p / p_max = e^(l - max))."""
        n = work.shape[0]
        log_min_p = self._log_min_p(plan, batch)
        relative = work - work.amax(dim=-1, keepdim=True)
        torch.lt(relative, self._to_device(log_min_p)[:, None], out=self._mask[:n])
        work.masked_fill_(self._mask[:n], -math.inf)

    def _with_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, plan: StepPlan, batch: _Batch) -> SamplerOutput:
        """Attach the picks' log-probs and the top-N under the raw (unprocessed) distribution: a row's allowed
        tokens, bias or penalties change its pick, not these. A row with logprob_token_ids lists those ids instead
        of its top-N (in their order, the rest of its N columns its top ones, which the commit never reads)."""
        max_logprobs = batch.max_logprobs
        if max_logprobs < 0:
            return SamplerOutput(tokens, None, None, None)
        raw = torch.log_softmax(logits.float(), dim=-1)
        picked = raw.gather(1, tokens[:, None]).squeeze(1)
        if max_logprobs == 0:
            return SamplerOutput(tokens, picked, None, None)
        top = torch.topk(raw, min(max_logprobs, self.vocab_size), dim=-1, sorted=True)
        ids, values = top.indices, top.values
        if batch.pinned.any():
            at = self._to_device(np.flatnonzero(batch.pinned))
            pinned = self._to_device(self._pinned_ids(plan, batch, ids.shape[1]))  # int64 [P, N]
            ids[at] = pinned
            values[at] = raw[at].gather(1, pinned)
        return SamplerOutput(tokens, picked, ids, values)

    @staticmethod
    def _pinned_ids(plan: StepPlan, batch: _Batch, width: int) -> np.ndarray:
        """int64 [P, width]: each pinning row's logprob_token_ids (plan.pinned_*, at least one), padded with its
        last id."""
        at = batch.rows[batch.pinned]
        starts, ends = plan.pinned_start[at].astype(np.int64), plan.pinned_start[at + 1].astype(np.int64)
        columns = np.minimum(starts[:, None] + np.arange(width), ends[:, None] - 1)
        return plan.pinned_ids[columns].astype(np.int64)

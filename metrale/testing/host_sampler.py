"""The device sampler's rules (gpu_worker/sampler.py), stage for stage, in numpy: FakeDevice's sampler.

FakeDevice picks as the device would, so the lane's tests on it exercise the device's rules: logit_bias (added in
float32 before anything else), penalties (repetition over prompt and output, then frequency times the count and
presence over the output), a row's bitmask (its grammar matcher's allowed tokens, and/or its allowed_token_ids),
bans, forced tokens, greedy rows (by temperature or mask), temperature, top-k, top-p over the top-k survivors,
min-p, and the Gumbel-max draw keyed by (seed, position) — the same float32 values at each step, the same
splitmix64 noise bits, the same tie rules (a cutoff keeps every token at or above it; an argmax takes the first
index). The transcendental steps are defined in ipc/sampling_rules.py, not borrowed from a library: `log32` (the
noise's two logs, min-p's log) and `exp_weights` (top-p's integer weights) are IEEE + - * / and bit operations in a
fixed order, which the device computes op for op (torch in sampler.py, the native kernels in cpu_sampling.cpp on
every instruction-set class), so the values are equal bit for bit wherever float32 is IEEE (tests/
test_host_sampler.py checks it). Top-p compares exact integer masses, so no sum depends on an order either.

The product never imports it: a RepickOnly repair is the device's own sampler on the logits it kept
(Device.resample). This is numpy, row by row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from metrale.ipc.messages import TokenLogprob
from metrale.ipc.plan import MASK_BAN, MASK_FORCE, MASK_GRAMMAR, MASK_GREEDY, StepPlan, unpack_bitmask
from metrale.ipc.sampling_rules import GOLDEN, GREEDY_EPS, NOISE_BITS, exp_weights, log32, mix64, row_keys

def gumbel_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """float32 [vocab]: the device's Gumbel noise of the row keyed by (seed, position), -log32(-log32(u))."""
    key = row_keys(np.array([seed]), np.array([position])).view(np.uint64)
    with np.errstate(over="ignore"):
        z = mix64(key + np.arange(1, vocab + 1, dtype=np.uint64) * np.uint64(GOLDEN))
    k = (z >> np.uint64(64 - NOISE_BITS)).astype(np.float32)
    u = (k + np.float32(0.5)) * np.float32(2.0**-NOISE_BITS)  # exact in float32, strictly inside (0, 1)
    return -log32(-log32(u))


@dataclass(slots=True)
class SamplingRow:
    """One row's sampling parameters, as a plan carries them (float32 values, the mask, the history)."""

    temperature: np.float32
    top_k: int
    top_p: np.float32
    min_p: np.float32
    repetition_penalty: np.float32
    presence_penalty: np.float32
    frequency_penalty: np.float32
    seed: int
    position: int  # the row's KV length once the step's tokens are written (the plan's seq_len)
    mask_kind: int
    force_token: int
    ban: tuple[int, ...]
    history: np.ndarray  # int32: prompt + output tokens (empty when the row has no penalties)
    prompt_len: int  # the first prompt_len history tokens are the prompt

    allowed: np.ndarray | None = None  # bool [>= V]: a MASK_GRAMMAR row's grammar bitmask, unpacked
    bias_ids: np.ndarray | None = None  # int32: the row's logit_bias ids (None: none) ...
    bias_values: np.ndarray | None = None  # float32: ... and the values added to their logits

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def of_plan(cls, plan: StepPlan, r: int) -> SamplingRow:
        """Row r of a plan."""
        h0, h1 = int(plan.hist_start[r]), int(plan.hist_start[r + 1])
        kind = int(plan.mask_kind[r])
        allowed = None
        if kind & MASK_GRAMMAR:
            g = int(np.count_nonzero(plan.mask_kind[:r] & MASK_GRAMMAR))  # its row of grammar_bitmask
            allowed = unpack_bitmask(plan.grammar_bitmask[g], 32 * plan.grammar_bitmask.shape[1])
        return cls(
            plan.temperature[r], int(plan.top_k[r]), plan.top_p[r], plan.min_p[r], plan.repetition_penalty[r],
            plan.presence_penalty[r], plan.frequency_penalty[r], int(plan.seeds[r]), int(plan.seq_lens[r]),
            kind, int(plan.force_token[r]), tuple(int(b) for b in plan.ban_ids[r] if b >= 0),
            plan.hist_tokens[h0:h1], int(plan.hist_prompt_len[r]), allowed,
            plan.bias_ids[plan.bias_start[r] : plan.bias_start[r + 1]],
            plan.bias_values[plan.bias_start[r] : plan.bias_start[r + 1]],
        )


def sample_row(logits: np.ndarray, row: SamplingRow) -> int:
    """The token the device sampler picks from float32 [V] logits for this row."""
    x = logits.astype(np.float32)  # a copy: the device's work buffer
    vocab = len(x)
    if row.bias_ids is not None and len(row.bias_ids):
        inside = (row.bias_ids >= 0) & (row.bias_ids < vocab)
        np.add.at(x, row.bias_ids[inside], row.bias_values[inside])  # float32 additions, as the device's
    if row.penalised and len(row.history):
        _penalise(x, row)
    if row.mask_kind & MASK_GRAMMAR:
        x[~row.allowed[:vocab]] = -np.inf
    if row.mask_kind & MASK_BAN:
        ban = [b for b in row.ban if 0 <= b < vocab]
        x[ban] = -np.inf
    greedy = row.temperature < np.float32(GREEDY_EPS) or bool(row.mask_kind & MASK_GREEDY)
    if greedy:
        pick = int(np.argmax(x))
    else:
        x /= row.temperature
        top_k_on = 0 < row.top_k < vocab
        top_p_on = row.top_p < np.float32(1.0)
        if top_k_on or top_p_on:
            _top_k_top_p(x, row.top_k if top_k_on else vocab, top_k_on, row.top_p if top_p_on else None)
        if row.min_p > np.float32(0.0):
            x[(x - x.max()) < log32(np.array([row.min_p]))[0]] = -np.inf
        pick = int(np.argmax(x + gumbel_noise(row.seed, row.position, vocab)))
    return int(row.force_token) if row.mask_kind & MASK_FORCE else pick


def _penalise(x: np.ndarray, row: SamplingRow) -> None:
    """vLLM's penalties in place: repetition over every token seen, then frequency x count and presence over
    the output's tokens (float32, in the device's order)."""
    vocab = len(x)
    hist = row.history.astype(np.int64)
    is_output = np.arange(len(hist)) >= row.prompt_len
    valid = (hist >= 0) & (hist < vocab)
    seen = np.unique(hist[valid])
    rep = row.repetition_penalty
    v = x[seen]
    x[seen] = np.where(v > 0, v / rep, v * rep)
    out_ids, counts = np.unique(hist[valid & is_output], return_counts=True)
    if len(out_ids):
        v = x[out_ids]
        v -= (row.frequency_penalty * counts.astype(np.float32)).astype(np.float32)
        v -= row.presence_penalty
        x[out_ids] = v


def _top_k_top_p(x: np.ndarray, top_k: int, top_k_on: bool, top_p: np.float32 | None) -> None:
    """Mask every token below the row's cutoff: the k-th largest value, raised to the nucleus's smallest (the
    tokens whose strictly larger neighbours weigh less than top_p of what top-k left, in exact integer weights)."""
    largest = -np.sort(-x)  # descending, float32
    cutoff = largest[min(top_k, len(x)) - 1] if top_k_on else np.float32(-np.inf)
    if top_p is not None:
        with np.errstate(invalid="ignore"):
            weight = exp_weights(largest - largest[0]).astype(np.int64)
        weight[largest < cutoff] = 0
        cumulative = np.cumsum(weight)
        before = np.concatenate([[0], cumulative[:-1]]).astype(np.float64)  # exact: every sum is below 2^53
        inside = int(np.count_nonzero(before < np.float64(top_p) * np.float64(cumulative[-1])))
        cutoff = largest[inside - 1]
    x[x < cutoff] = -np.inf


def logprob_of(logits: np.ndarray, token: int, n: int, vocab: int, pinned: np.ndarray | None = None) -> TokenLogprob:
    """The pick's log-probability under the raw distribution, and the top-n (float64, rounded to float32); pinned
    (logprob_token_ids): those ids' instead of the top-n, in their order."""
    z = logits.astype(np.float64)
    z = z - z.max()
    logp = (z - np.log(np.exp(z).sum())).astype(np.float32)
    if pinned is not None and len(pinned):
        top = np.asarray(pinned, dtype=np.int64)
    elif not n:
        return TokenLogprob(token, float(logp[token]))
    else:
        top = np.argsort(-logp, kind="stable")[: min(n, vocab)]
    return TokenLogprob(token, float(logp[token]), top.tolist(), logp[top].astype(float).tolist())

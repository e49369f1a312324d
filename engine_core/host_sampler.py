"""Sampling on the host, for the rare step whose logits come back (a RepickOnly row whose mask went stale).

It follows the device sampler's rules for greedy, temperature, top-k and the row masks, with noise that is
a function of (seed, position, token id) only. FakeDevice samples with it too, so host and "device" agree.
"""

from __future__ import annotations

import numpy as np

from metrale.ipc.plan import MASK_BAN, MASK_FORCE, MASK_GRAMMAR, MASK_GREEDY

from .grammar import allowed_tokens
from .pipeline import RowMask
from .sequence import Sequence

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def uniform_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """float64[vocab] in (0, 1): splitmix64 of (seed, position, token id); batch-invariant by construction."""
    with np.errstate(over="ignore"):
        x = np.uint64(seed) * _GOLDEN + np.uint64(position) * _M2 + np.arange(vocab, dtype=np.uint64) * _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        x = x ^ (x >> np.uint64(31))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def sample_row(
    logits: np.ndarray, *, temperature: float, top_k: int, seed: int, position: int,
    mask_kind: int, force_token: int, ban: "np.ndarray | list[int]", allowed: np.ndarray | None = None,
) -> int:
    """One row's pick: force, grammar (allowed: bool [V] of a MASK_GRAMMAR row), ban, then greedy or
    temperature/top-k with (seed, position) noise."""
    if mask_kind & MASK_FORCE:
        return int(force_token)
    x = logits.astype(np.float64, copy=True)
    if mask_kind & MASK_GRAMMAR:
        x[~allowed] = -np.inf
    if mask_kind & MASK_BAN:
        x[[b for b in ban if b >= 0]] = -np.inf
    if temperature == 0.0 or mask_kind & MASK_GREEDY:
        return int(np.argmax(x))
    x /= temperature
    if 0 < top_k < len(x):
        kth = np.partition(x, -top_k)[-top_k]
        x[x < kth] = -np.inf
    gumbel = -np.log(-np.log(uniform_noise(seed, position, len(x))))
    return int(np.argmax(x + gumbel))


def host_sample(logits: np.ndarray, seqs: list[Sequence], masks: list[RowMask]) -> np.ndarray:
    """Pick a token per row from host logits [R, V]; each row's new token sits at position num_computed."""
    picks = [
        sample_row(
            logits[r], temperature=s.params.temperature, top_k=s.params.top_k, seed=s.seed,
            position=s.num_computed, mask_kind=m.kind, force_token=m.force_token, ban=list(m.ban),
            allowed=allowed_tokens(s, logits.shape[1]) if m.kind & MASK_GRAMMAR else None,
        )
        for r, (s, m) in enumerate(zip(seqs, masks))
    ]
    return np.array(picks, dtype=np.int64)

"""Embeddings: the pooled hidden states of a step's pooled rows (StepPlan.pool).

A row pools the final-normed hidden states of its own tokens in this step: its last token's (POOL_LAST), their sum
(POOL_SUM: a mean over a prompt split into chunks is the host's sum of the chunks' sums over the prompt's length),
or its first token's (POOL_FIRST). Normalisation and a `dimensions` cut are the
host's, once the whole prompt is pooled.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from metrale.gpu_worker.errors import PlanError
from metrale.ipc.plan import POOL_FIRST, POOL_LAST, POOL_SUM, StepPlan


def pool_hidden(plan: StepPlan, hidden: torch.Tensor, norm: Callable[[torch.Tensor], torch.Tensor],
                put: Callable[[str, np.ndarray], torch.Tensor]) -> torch.Tensor:
    """float32 [Q, hidden] for the plan's Q pooled rows in row order; hidden is the step's [T, hidden] before
    the final norm, put the step's staging (a host array to the device)."""
    rows = np.flatnonzero(plan.pool)
    kinds = plan.pool[rows]
    starts, ends = plan.query_start[rows].astype(np.int64), plan.query_start[rows + 1].astype(np.int64)
    counts = np.where(kinds == POOL_SUM, ends - starts, 1)
    firsts = np.where(kinds == POOL_LAST, ends - 1, starts)
    before = np.cumsum(counts) - counts
    tokens = np.repeat(firsts - before, counts) + np.arange(int(counts.sum()))  # each pooled token's index
    vectors = norm(hidden[put("pool_tokens", tokens)]).float()
    if (counts == 1).all():
        return vectors
    out = torch.zeros(len(rows), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, put("pool_rows", np.repeat(np.arange(len(rows)), counts)), vectors)


def check_pool(plan: StepPlan) -> None:
    """PlanError for a pool value outside POOL_*, or a pooled row that also samples."""
    pooled = plan.pool != 0
    if pooled.any() and (((plan.pool < 0) | (plan.pool > POOL_FIRST)).any() or (plan.sample & pooled).any()):
        raise PlanError("invalid plan: a pool value outside POOL_*, or a pooled row that samples")

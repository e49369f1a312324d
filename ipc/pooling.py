"""PoolingParams: what an embeddings request asks for (vLLM's PoolingParams), and how its vector is finished.

An embeddings request runs its prompt and no output: the device gives back its rows' pooled hidden states
(StepPlan.pool), the engine core adds a prompt's chunks up and finishes the vector here, once.
"""

from __future__ import annotations

import msgspec
import numpy as np

from .plan import POOL_SUM
from .sampling import SamplingParams


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """normalize: L2-normalise the vector (None: as the model's sentence-transformers config says); dimensions:
    keep the first n values (then normalised again), for a model trained for it (Matryoshka; OpenAI's
    `dimensions`)."""

    normalize: bool | None = None
    dimensions: int | None = None

    def validate(self, hidden_size: int, matryoshka: bool, sampling: SamplingParams | None = None) -> None:
        """ValueError naming what this model cannot give: no embeddings at all (hidden_size 0), or dimensions; or
        what the request's sampling asks of an output it does not have (structured outputs, prompt logprobs)."""
        if sampling is not None and (sampling.structured_outputs is not None or sampling.prompt_logprobs is not None):
            raise ValueError("an embeddings request has no output: no structured outputs or prompt logprobs")
        if hidden_size <= 0:
            raise ValueError("this server's engine carries no embeddings")
        if self.dimensions is not None:
            if not matryoshka:
                raise ValueError("dimensions: the model does not support Matryoshka (truncated) embeddings")
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) \
                    or not 1 <= self.dimensions <= hidden_size:
                raise ValueError(f"dimensions must be an integer in [1, {hidden_size}] (got {self.dimensions!r})")


def with_model_default(params: PoolingParams, model_normalizes: bool) -> PoolingParams:
    """params with normalize resolved: the model's own choice where the request left it open."""
    if params.normalize is not None:
        return params
    return msgspec.structs.replace(params, normalize=model_normalizes)


def finish_embedding(total: np.ndarray, kind: int, num_tokens: int, params: PoolingParams) -> list[float]:
    """The request's embedding from its pooled vector (a sum over num_tokens for mean pooling): averaged, cut to
    `dimensions`, normalised as asked (params.normalize resolved: see with_model_default)."""
    vector = total / num_tokens if kind == POOL_SUM else total
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype(np.float32).tolist()

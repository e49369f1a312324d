"""When a benchmark sends each request: all at once, or at the times of a Poisson (or gamma) process."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each request is sent.

    With an infinite rate, all at 0. Else the gaps are gamma-distributed with mean 1/rate and shape `burstiness`
    (1: a Poisson process; below 1 burstier, above 1 more even; infinite: evenly spaced), and the offsets are
    scaled so that the last falls at num_requests/rate exactly, as vLLM's bench does, so that runs with
    different seeds offer the same load.
    """
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive (got {burstiness})")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive or inf (got {request_rate})")
    if num_requests == 0 or math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets *= (num_requests / request_rate) / offsets[-1]
    return offsets.tolist()

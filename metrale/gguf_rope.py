"""A GGUF's per-dimension rotary factors (llama.cpp's `rope_freqs` tensor) as config.json's rope_scaling.

llama.cpp's converter writes a Llama 3.1-style rope (rope_type "llama3") as no rope keys at all but a tensor of one
factor per rotated dimension pair, by which llama.cpp divides each inverse frequency: 1 for the high frequencies,
`factor` for the low ones, a smooth blend between. transformers computes the same blend from four numbers (factor,
low_freq_factor, high_freq_factor, original_max_position_embeddings), in its own float32 order. To serve the file
exactly as its Hugging Face folder, those four numbers are recovered from the tensor (the blend is linear in
1 / wavelength, so two blended dimensions fix it; Llama 3's low_freq_factor 1 and, with a single blended dimension,
high_freq_factor 4 are taken as given) and checked by recomputing the tensor; a tensor that no llama3 settings
reproduce is kept as explicit per-dimension factors (`freq_factors`, which layers/rope_scaling.py divides by).
No torch here: model_facts imports this.
"""

from __future__ import annotations

import math

import numpy as np

_LOW, _HIGH = 1.0, 4.0  # Llama 3.x's low_freq_factor and high_freq_factor
_DEFAULT_ORIGINAL = 8192  # Llama 3's original context, llama.cpp's converter's default
_RTOL = 1e-5  # the tensor is float32; the converter computes it in float32


def rope_scaling_from_factors(factors: np.ndarray, theta: float, dim: int, original: int | None = None) -> dict:
    """config.json's rope_scaling for a `rope_freqs` tensor of a rotary over dim dimensions with base theta:
    {} when every factor is 1, the llama3 settings that reproduce the tensor, else
    {"rope_type": "default", "freq_factors": [...]}. original: the file's stated original context, if any."""
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if np.allclose(f, 1.0, rtol=0, atol=1e-7):
        return {}
    if f.shape[0] == dim // 2:
        for candidate in _llama3_candidates(f, theta, dim, original):
            if np.allclose(llama3_factors(candidate, theta, dim), f, rtol=_RTOL, atol=0):
                return candidate
    return {"rope_type": "default", "freq_factors": [float(str(v)) for v in np.asarray(factors, dtype=np.float32).reshape(-1)]}


def llama3_factors(params: dict, theta: float, dim: int) -> np.ndarray:
    """The per-dimension factors llama.cpp's converter writes for llama3 rope settings (float64)."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / _inv_freq(theta, dim)
    smooth = (original / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended))


def _llama3_candidates(f: np.ndarray, theta: float, dim: int, original: int | None) -> list[dict]:
    """llama3 settings that may have produced f (checked by the caller)."""
    factor = float(np.float32(f.max()))
    if factor <= 1.0:
        return []
    x = _inv_freq(theta, dim) / (2 * math.pi)  # 1 / wavelength
    blended = (f > 1.0 + 1e-6) & (f < factor * (1 - 1e-6))
    # smooth = original / wavelen * 1/(high-low) - low/(high-low) = a * x - b, from each blended factor
    smooth = (1 / f[blended] - 1 / factor) / (1 - 1 / factor)
    found: list[tuple[float, float, float]] = []  # (low, high, original)
    if blended.sum() >= 2:
        a, b = np.polyfit(x[blended], smooth, 1)
        a, b = float(a), -float(b)
        if b > 0:
            found.append((_LOW, _LOW + 1 / b, a / b))
    elif blended.sum() == 1:
        b = _LOW / (_HIGH - _LOW)
        found.append((_LOW, _HIGH, float((smooth[0] + b) / x[blended][0]) * (_HIGH - _LOW)))
    found.append((_LOW, _HIGH, float(original or _DEFAULT_ORIGINAL)))
    return [
        {
            "rope_type": "llama3",
            "factor": _tidy(factor),
            "low_freq_factor": _tidy(low),
            "high_freq_factor": _tidy(high),
            "original_max_position_embeddings": int(round(orig)),
        }
        for low, high, orig in found
        if orig > 0 and high > low
    ]


def _inv_freq(theta: float, dim: int) -> np.ndarray:
    """The rotary's inverse frequencies, as the converter computes them (float32, widened)."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float64)


def _tidy(value: float) -> float:
    """A setting recovered from float32 arithmetic, rounded to the short decimal it was written as."""
    return float(round(value, 4))

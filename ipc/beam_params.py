"""A beam search's parameters (vLLM's BeamSearchParams): what LLM.beam_search takes and a Generate / AddRequest with
`beam` carries (docs/protocol.md); the search itself is metrale/beam_search.py's, run by the engine core
(engine_core/beam_groups.py)."""

from __future__ import annotations

import math

import msgspec

from .sampling import MAX_LOGPROBS

# Each beam's step reports 2W alternatives (vLLM's request), and the engine reports at most MAX_LOGPROBS.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


class BeamSearchParams(msgspec.Struct, omit_defaults=True):
    """How to search (vLLM's BeamSearchParams, plus transformers' early_stopping: False, True or "never")."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # 0 only: vLLM's sampled beams are not implemented
    length_penalty: float = 1.0  # a hypothesis' score is its log-probability / generated length ** this
    include_stop_str_in_output: bool = False  # keep the eos that ended a hypothesis in its ids (text skips it)
    early_stopping: bool | str = False

    def validate(self) -> None:
        """Raise ValueError naming the first field the search cannot run with."""
        _check(_is_int(self.beam_width) and 1 <= self.beam_width <= MAX_BEAM_WIDTH, "beam_width",
               f"must be an integer in [1, {MAX_BEAM_WIDTH}]", self.beam_width)
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1",
               self.max_tokens)
        _check(isinstance(self.temperature, (int, float)) and self.temperature == 0.0, "temperature",
               "must be 0 (sampled beam search is not supported)", self.temperature)
        _check(isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty),
               "length_penalty", "must be a finite number", self.length_penalty)
        # `is`, not `in`: 0 and 1 are == False and True, and a typo'd 1 should not pass for True.
        _check(any(self.early_stopping is v for v in (False, True)) or self.early_stopping == "never",
               "early_stopping", "must be False, True or 'never'", self.early_stopping)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} {rule} (got {value!r})")

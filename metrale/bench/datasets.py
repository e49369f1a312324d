"""The requests a benchmark sends: synthetic ones of given token lengths, or prompts from a ShareGPT file.

Both follow vLLM's bench (same flags, same sampling rules), so the same command line gives comparable loads:
random prompts are runs of non-special token ids, decoded to text and re-encoded until their length is the one
drawn; ShareGPT prompts are each conversation's first turn, with the second turn's length as the output length.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace

import numpy as np

from metrale.frontend.tokenizer import Tokenizer

# ShareGPT filtering, as vLLM's bench prunes (too short to mean anything, or too long for small models).
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
_RETRIES = 10  # decode → re-encode rounds to hit a random prompt's drawn length


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One request to send: its prompt, its prompt length in tokens and the output tokens to ask for."""

    prompt: str
    prompt_len: int
    expected_output_len: int
    request_id: str = ""


def random_requests(tokenizer: Tokenizer, num_requests: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0,
                    id_prefix: str = "") -> list[SampleRequest]:
    """num_requests synthetic requests: a shared random prefix of prefix_len tokens, then input and output
    lengths drawn uniformly from [L·(1−ratio), L·(1+ratio)] (input less the special tokens the tokenizer adds)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1) (got {range_ratio})")
    rng = np.random.default_rng(seed)
    real_input = max(0, input_len - num_special_tokens(tokenizer))
    in_low, in_high = math.floor(real_input * (1 - range_ratio)), math.ceil(real_input * (1 + range_ratio))
    out_low = max(1, math.floor(output_len * (1 - range_ratio)))
    out_high = max(1, math.ceil(output_len * (1 + range_ratio)))
    if prefix_len + in_low < 1:
        raise ValueError("--random-input-len is too small: a prompt could have no tokens "
                         "(raise it or --random-prefix-len, or lower --random-range-ratio)")
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_requests)
    allowed = np.array(sorted(set(range(tokenizer.vocab_size)) - set(tokenizer.special_token_ids)))
    prefix = _fit_length(tokenizer, allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist(),
                         prefix_len, rng)[1] if prefix_len > 0 else []
    out = []
    for i in range(num_requests):
        inner = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        prompt, ids = _fit_length(tokenizer, prefix + inner, prefix_len + int(input_lens[i]), rng)
        out.append(SampleRequest(prompt, len(ids), int(output_lens[i]), f"{id_prefix}{i}"))
    return out


def sharegpt_requests(path: str, tokenizer: Tokenizer, num_requests: int, output_len: int | None = None,
                      seed: int = 0, shuffle: bool = True, oversample: bool = True,
                      id_prefix: str = "") -> list[SampleRequest]:
    """Requests from a ShareGPT JSON file (a list of {"conversations": [{"value": ...}, ...]}): each entry's
    first turn as the prompt; its second turn's token count as the output length unless output_len is given.
    Entries too short or too long are skipped; with oversample, picks repeat until there are num_requests."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    entries = [e for e in data if len(e.get("conversations", [])) >= 2]
    if shuffle:
        random.Random(seed).shuffle(entries)
    out: list[SampleRequest] = []
    for entry in entries:
        if len(out) >= num_requests:
            break
        prompt, completion = entry["conversations"][0]["value"], entry["conversations"][1]["value"]
        prompt_len = len(tokenizer.encode(prompt))
        wanted = len(tokenizer.encode(completion)) if output_len is None else output_len
        if not _valid_lengths(prompt_len, wanted, check_output=output_len is None):
            continue
        out.append(SampleRequest(prompt, prompt_len, wanted, f"{id_prefix}{len(out)}"))
    if not out:
        raise ValueError(f"{path}: no conversation of two turns within the length limits")
    if oversample and len(out) < num_requests:
        pick, kept = random.Random(seed), list(out)
        out += [replace(pick.choice(kept), request_id=f"{id_prefix}{i}") for i in range(len(kept), num_requests)]
    return out


def num_special_tokens(tokenizer: Tokenizer) -> int:
    """How many tokens (BOS, EOS) the tokenizer adds to a text of its own."""
    return len(tokenizer.encode("", add_special_tokens=True)) - len(tokenizer.encode("", add_special_tokens=False))


def _fit_length(tokenizer: Tokenizer, ids: list[int], target: int, rng: np.random.Generator) -> tuple[str, list[int]]:
    """(text, ids) whose re-encoding has `target` tokens, or as near as _RETRIES rounds get: a run of ids need not
    survive decode → encode (two tokens may merge into one, or split into three)."""
    text = tokenizer.decode(ids)
    ids = tokenizer.encode(text, add_special_tokens=False)
    for _ in range(_RETRIES):
        if len(ids) == target:
            break
        if len(ids) < target:
            ids = ids + rng.integers(0, tokenizer.vocab_size, size=target - len(ids)).tolist()
        else:
            ids = ids[:target]
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
    return text, ids


def _valid_lengths(prompt_len: int, output_len: int, check_output: bool) -> bool:
    """Whether a ShareGPT pair is kept (vLLM's pruning rules)."""
    return (prompt_len >= MIN_LEN and (not check_output or output_len >= MIN_LEN)
            and prompt_len <= MAX_PROMPT_LEN and prompt_len + output_len <= MAX_TOTAL_LEN)

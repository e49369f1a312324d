"""vLLM's bad_words as the token sequences the engine bans (SamplingParams.bad_words_token_ids): the frontend owns the
tokenizer, so it turns each word into ids once, by vLLM's rule (SamplingParams.update_from_tokenizer)."""

from __future__ import annotations

from typing import Callable


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each word's token ids at the start of a text, and again after a space when that spelling is a word token of
    its own (its first id differs and its length is the same), as vLLM bans them both; encode(text): the ids of text
    without special tokens. ValueError for a word that is empty or all spaces."""
    out: list[list[int]] = []
    for word in words:
        if not word.strip():
            raise ValueError(f"bad_words must be non-empty words (got {word!r})")
        alone = encode(word.lstrip())
        out.append(alone)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return out

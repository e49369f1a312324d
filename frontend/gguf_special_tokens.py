"""Which tokens of a GGUF vocabulary llama.cpp matches whole, before any splitting, and how they decode.

llama.cpp takes a token's type from `tokenizer.ggml.token_type`, then overrides some by their text: end-of-turn,
end-of-generation and fill-in-the-middle markers become control tokens, gpt-oss's channel markers user-defined
ones (with two exceptions of its own, below). Control, unknown and user-defined tokens are then cut out of the
text wherever they appear (its `parse_special`); as `tokenizers` added tokens, control and unknown ones are
special (skipped by skip_special_tokens), user-defined ones decode as their text. By model name, llama.cpp also
strips the spaces beside some of them (Phi-3's right of its special tokens, a mask token's left).
"""

from __future__ import annotations

import itertools

from tokenizers import AddedToken
from tokenizers import Tokenizer as HfTokenizer

from metrale.gguf_metadata import field, indices_of

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types
_MATCHED_WHOLE = frozenset((CONTROL, UNKNOWN, USER_DEFINED))

# Texts llama.cpp treats as control tokens whatever their type says (end of turn / generation, fill-in-the-middle).
_CONTROL_LOOKING = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
    "[EOT]", "[EOS]", "<｜end▁of▁sentence｜>", "<end_of_utterance>", "<|eom_id|>", "<|return|>", "<|call|>",
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
    "<REPO>", "<reponame>", "<|file_sep|>", "<|flush|>", "<|calls|>", "</s>", "<eos>", "<turn|>", "<|tool_response>",
    "[e~[",
))
# gpt-oss's channel markers: llama.cpp renders them as text (user-defined) whatever the file says.
_ALWAYS_RENDERED = frozenset(("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"))
# Every text token_types asks the vocabulary about (the promotions above, and their exceptions' conditions).
_LOOKED_FOR = _ALWAYS_RENDERED | _CONTROL_LOOKING | {"<|tool_response>", "<|plamo:eos|>", "<|return|>", "<|call|>",
                                                     "<|calls|>", "<|flush|>"}


def token_types(reader, tokens: list[str]) -> list[int]:
    """Each token's llama.cpp type: the file's, with llama.cpp's promotions by text (control-looking, gpt-oss)."""
    types = list(field(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    types += [NORMAL] * (len(tokens) - len(types))
    present = _LOOKED_FOR.intersection(tokens)  # (the texts below that the vocabulary has)
    promoted = present & (_ALWAYS_RENDERED | _CONTROL_LOOKING)
    if not promoted:  # (most vocabularies have a few; the loops below only visit those)
        return types
    for i in _where(tokens, promoted):
        text = tokens[i]
        if text in _ALWAYS_RENDERED:
            types[i] = USER_DEFINED
        elif types[i] != CONTROL:
            types[i] = CONTROL
    for i in _where(tokens, promoted & {"</s>", "<|end|>"}):  # llama.cpp's exceptions to its own promotions
        text = tokens[i]
        if text == "</s>" and present & {"<|tool_response>", "<|plamo:eos|>"}:
            types[i] = NORMAL  # gemma4 and plamo: a plain </s>
        elif text == "<|end|>" and ({"<|return|>", "<|call|>"} <= present or {"<|calls|>", "<|flush|>"} <= present):
            types[i] = USER_DEFINED  # gpt-oss, solar-open: rendered as text
    return types


def _where(tokens: list[str], texts: set[str]) -> list[int]:
    """The ids of the tokens whose text is one of texts, in order."""
    return indices_of(tokens, texts) if texts else []


def add_special_tokens(backend: HfTokenizer, reader, tokens: list[str], types: list[int]) -> None:
    """Control, unknown and user-defined tokens, matched whole before anything else (llama.cpp's special cache).

    Control and unknown ones are special (skipped by skip_special_tokens); user-defined ones decode as text.
    llama.cpp strips spaces beside some by model name: Phi-3's right of its special tokens, <mask>'s left.
    """
    rstrip = _rstripped(reader, tokens, types)
    lstrip = _lstripped(reader)
    special, plain = [], []
    for i in itertools.compress(range(len(tokens)), map(_MATCHED_WHOLE.__contains__, types)):  # (few: no Python loop)
        text, kind = tokens[i], types[i]
        token = AddedToken(
            text, normalized=False, special=kind != USER_DEFINED, rstrip=text in rstrip, lstrip=text in lstrip
        )
        (plain if kind == USER_DEFINED else special).append(token)
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def _rstripped(reader, tokens: list[str], types: list[int]) -> set[str]:
    """Tokens llama.cpp strips the spaces after: Phi-3's special tokens but <unk>, <s>, <|endoftext|>."""
    name = str(field(reader, "general.name", "") or "").lower()
    if "phi-3" not in name and "phi3" not in name:
        return set()
    found = {t for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN, USER_DEFINED)} | {"</s>"}
    return found - {"<unk>", "<s>", "<|endoftext|>"}


def _lstripped(reader) -> set[str]:
    """Tokens llama.cpp strips the spaces before: the mask of jina v2, nomic-bert-moe, jina-bert-v3, ModernBERT."""
    pre = str(field(reader, "tokenizer.ggml.pre", "") or "")
    arch = str(field(reader, "general.architecture", "") or "")
    name = str(field(reader, "general.name", "") or "").lower()
    jina = any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code"))
    if jina or arch in ("nomic-bert-moe", "jina-bert-v3"):
        return {"<mask>"}
    return {"[MASK]"} if "modern-bert" in name else set()

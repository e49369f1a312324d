"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers` pipeline (no tokenizer.json in a GGUF).

A byte-level BPE vocabulary (`tokenizer.ggml.model` = "gpt2", what llama.cpp writes for GPT-2, Llama 3, Qwen2,
SmolLM and most recent models) is its tokens, its merges and a token type per id; the pre-tokenizer is named by
`tokenizer.ggml.pre`, whose split rules live in llama.cpp's code rather than the file. The vocabulary is
re-spelled, and control / user-defined tokens added, as transformers' GGUF tokenizer does; the split rules are
llama.cpp's for each pre-tokenizer name (for SmolLM's "smollm", digits one by one before GPT-2's split, which is
what its original tokenizer.json says too).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as HfTokenizer
from tokenizers.models import BPE

from metrale.gguf_metadata import GgufError, eos_token_ids, field

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types

# llama.cpp's split rules by `tokenizer.ggml.pre` (llama-vocab.cpp), beyond GPT-2's own (ByteLevel's regex).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
}
# Pre-tokenizers that split every digit off before GPT-2's regex.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")


@dataclass(frozen=True, slots=True)
class GgufTokenizer:
    """The rebuilt pipeline and the special tokens the file names."""

    backend: HfTokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    unk_token_id: int | None
    chat_template: str | None


def tokenizer_from_gguf(reader, path: str) -> GgufTokenizer:
    """The tokenizer of an open GGUF file (metrale.gguf_metadata.open_gguf); GgufError when it has none we build."""
    kind = field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise GgufError(f"{path}: no tokenizer in the file (tokenizer.ggml.model is missing)")
    if kind != "gpt2":
        raise GgufError(f"{path}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens") or []
    types: list[int] = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges") or []]
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    backend = HfTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(str(field(reader, "tokenizer.ggml.pre", "default")))
    backend.decoder = decoders.ByteLevel()
    # Control tokens match whole as special tokens; one spelled outside the byte alphabet is llama.cpp's
    # mislabel of a plain token (transformers skips it too, or the vocabulary would grow past the model's).
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet]
    )
    backend.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab]
    )

    def token_id(key: str) -> int | None:
        value = field(reader, f"tokenizer.ggml.{key}")
        return int(value) if isinstance(value, int) and 0 <= value < len(tokens) else None

    bos = token_id("bos_token_id")
    eos = [i for i in eos_token_ids(reader) if 0 <= i < len(tokens)]
    post = _post_processor(
        backend,
        bos if field(reader, "tokenizer.ggml.add_bos_token", False) else None,
        eos[0] if eos and field(reader, "tokenizer.ggml.add_eos_token", False) else None,
    )
    if post is not None:
        backend.post_processor = post
    template = field(reader, "tokenizer.chat_template")
    return GgufTokenizer(
        backend=backend,
        bos_token_id=bos,
        eos_token_ids=tuple(eos),
        pad_token_id=token_id("padding_token_id"),
        unk_token_id=token_id("unknown_token_id"),
        chat_template=template if isinstance(template, str) else None,
    )


def _pre_tokenizer(pre: str):
    """The split rules llama.cpp applies for this `tokenizer.ggml.pre` name, then the byte-level mapping."""
    split = _SPLITS.get(pre)
    if split is not None:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return gpt2


def _post_processor(backend: HfTokenizer, bos: int | None, eos: int | None):
    """BOS / EOS around every encoding, as the file's add_bos_token / add_eos_token flags say (None: neither)."""
    if bos is None and eos is None:
        return None
    ends = [(backend.id_to_token(i), i) for i in (bos, eos) if i is not None]

    def around(seq: str, type_id: int) -> str:
        head = f"{ends[0][0]}:{type_id} " if bos is not None else ""
        tail = f" {ends[-1][0]}:{type_id}" if eos is not None else ""
        return f"{head}{seq}:{type_id}{tail}"

    return processors.TemplateProcessing(
        single=around("$A", 0), pair=f"{around('$A', 0)} {around('$B', 1)}", special_tokens=ends
    )


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE vocabularies are spelled in)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table

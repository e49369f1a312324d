"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers` pipeline (no tokenizer.json in a GGUF).

The ids are llama.cpp's for the same file (tests/test_gguf_tokenizer.py holds llama.cpp's own ids as golden data).
`tokenizer.ggml.model` names the kind, each built on a `tokenizers` model, never a merge loop of ours:

- "llama": SentencePiece BPE. The merges are every split of a piece into two pieces, ranked by the piece's score
  (llama.cpp merges the best-scoring pair first); unknown characters fall back to `<0xXX>` byte pieces; spaces are
  "▁", with one "▁" before each run of text when `tokenizer.ggml.add_space_prefix` (default true) — before the
  text and after every special token, as llama.cpp does; decoding turns "▁" back into spaces, bytes into text and
  strips that one leading space (llama.cpp keeps it when the ids start with a BOS it drops; we strip it there
  too, as transformers does, so a prompt decodes to its text).
- "gpt2": byte-level BPE, split first by llama.cpp's rules for `tokenizer.ggml.pre` (frontend/gguf_pretokenizers.py;
  an unknown or refused name is a GgufError naming it, a missing one llama.cpp's "default" rules with a warning).
- "bert": WordPiece over llama.cpp's phantom-space vocabulary ("▁word" starts a word, a bare piece continues one),
  with BERT's normalizer (lowercase and accent stripping per `tokenizer.ggml.normalizer.*`, default on); a
  sequence is `[CLS] ... [SEP]`.
- "t5": SentencePiece Unigram with the file's precompiled NFKC charsmap.
- "gemma4" (and the gpt2 pre-tokenizers gemma4, granite-embed-multi-311m, sarvam-moe): SPM-style BPE, spaces as
  "▁", the file's merges over UTF-8 characters line by line, <0xXX> byte fallback.

Control, unknown and user-defined tokens match whole, before anything else, wherever they appear (llama.cpp's
`parse_special`; frontend/gguf_special_tokens.py); control and unknown ones are special (skipped when decoding
with skip_special_tokens), as are tokens llama.cpp promotes to control by their text (<|eot_id|>, <|im_end|>,
<end_of_turn>, ...). BOS and EOS are added as llama.cpp adds them: `tokenizer.ggml.add_bos_token` /
`add_eos_token` when the file has them, else llama.cpp's default for the kind (SentencePiece: BOS; Unigram: EOS;
byte-level BPE: BOS for llama3 and tekken; gemma4: BOS always, whatever the file says).
Ids come from the file's `tokenizer.ggml.*_token_id` keys, else llama.cpp's defaults for SentencePiece, WordPiece
and Unigram. Other kinds (rwkv, plamo2, whitespace, ...) are a GgufError naming the kind.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import re
from dataclasses import dataclass

from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HfTokenizer
from tokenizers.models import BPE, Unigram, WordPiece

from metrale.frontend.gguf_pretokenizers import Pre, UnknownPre, rules, split_pre_tokenizer
from metrale.frontend.gguf_special_tokens import (
    CONTROL, NORMAL, UNKNOWN, USER_DEFINED, add_special_tokens, token_types,
)
from metrale.gguf_metadata import GgufError, eos_token_ids, field, split_pairs

log = logging.getLogger(__name__)

_SPACE = "\u2581"  # SentencePiece's "▁"
SUPPORTED_MODELS = ("llama", "gpt2", "bert", "t5", "gemma4")



@dataclass(frozen=True, slots=True)
class GgufTokenizer:
    """The rebuilt pipeline and the special tokens the file names."""

    backend: HfTokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    unk_token_id: int | None
    chat_template: str | None


@dataclass(frozen=True, slots=True)
class _Kind:
    """What llama.cpp assumes for one tokenizer kind when the file does not say."""

    ids: dict[str, int]  # default special ids by key suffix ("bos", "eos", "unk", "sep", "pad")
    add_bos: bool
    add_eos: bool


_KINDS = {
    "llama": _Kind({"bos": 1, "eos": 2, "unk": 0}, add_bos=True, add_eos=False),
    "gpt2": _Kind({}, add_bos=False, add_eos=False),
    "bert": _Kind({"bos": 101, "unk": 100, "sep": 102, "pad": 0}, add_bos=True, add_eos=False),
    "t5": _Kind({"eos": 1, "unk": 2, "pad": 0}, add_bos=False, add_eos=True),
    "gemma4": _Kind({}, add_bos=True, add_eos=False),  # SPM-style BPE, pre-tokenizer "gemma4" whatever the file says
}
_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
            "sep": "seperator_token_id", "pad": "padding_token_id"}  # (sic: gguf's spelling)


def tokenizer_from_gguf(reader, path: str) -> GgufTokenizer:
    """The tokenizer of an open GGUF file (metrale.gguf_metadata.open_gguf); GgufError when it has none we build."""
    kind = field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise GgufError(f"{path}: no tokenizer in the file (tokenizer.ggml.model is missing)")
    if kind not in _KINDS:
        raise GgufError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported (supported: {', '.join(SUPPORTED_MODELS)})"
        )
    tokens: list[str] = list(field(reader, "tokenizer.ggml.tokens") or [])
    if not tokens:
        raise GgufError(f"{path}: the tokenizer has no tokens (tokenizer.ggml.tokens is missing or empty)")
    types = token_types(reader, tokens)
    ids = _special_ids(reader, _KINDS[kind], len(tokens))
    pre = rules("gemma4") if kind == "gemma4" else _pre_rules(reader, path) if kind == "gpt2" else None
    if pre is not None and pre.no_bos:
        ids.pop("bos", None)
    add_bos = _flag(reader, "tokenizer.ggml.add_bos_token", pre.add_bos if pre else _KINDS[kind].add_bos)
    add_bos = add_bos or (pre is not None and pre.force_bos)
    add_eos = _flag(reader, "tokenizer.ggml.add_eos_token", _KINDS[kind].add_eos)
    if kind == "llama":
        backend = _sentencepiece_bpe(reader, tokens, types, ids.get("unk"))
    elif kind in ("gpt2", "gemma4"):
        backend = _byte_level_bpe(reader, tokens, types, pre)
    elif kind == "bert":
        backend = _wordpiece(reader, tokens, types, ids.get("unk"))
    else:
        backend = _unigram(reader, tokens, types, ids.get("unk"))
    add_special_tokens(backend, reader, tokens, types)
    if kind == "bert":  # llama.cpp: [CLS] text [SEP], whatever the add_* flags say
        post = _post_processor(backend, ids.get("bos"), ids.get("sep"))
    else:
        post = _post_processor(backend, ids.get("bos") if add_bos else None, ids.get("eos") if add_eos else None)
    if post is not None:
        backend.post_processor = post
    eos = [i for i in eos_token_ids(reader) if 0 <= i < len(tokens)]
    if not eos and "eos" in ids:
        eos = [ids["eos"]]
    template = field(reader, "tokenizer.chat_template")
    return GgufTokenizer(
        backend=backend,
        bos_token_id=ids.get("bos"),
        eos_token_ids=tuple(eos),
        pad_token_id=ids.get("pad"),
        unk_token_id=ids.get("unk"),
        chat_template=template if isinstance(template, str) else None,
    )


def _flag(reader, key: str, default: bool) -> bool:
    """A boolean key of the file, or llama.cpp's default when the file does not have it."""
    value = field(reader, key)
    return default if value is None else bool(value)


def _special_ids(reader, kind: _Kind, n_tokens: int) -> dict[str, int]:
    """bos / eos / unk / sep / pad: the file's id when in range, else llama.cpp's default for the kind."""
    out: dict[str, int] = {}
    for name, key in _ID_KEYS.items():
        value = field(reader, f"tokenizer.ggml.{key}")
        if isinstance(value, int) and 0 <= value < n_tokens:
            out[name] = value
        elif name in kind.ids and kind.ids[name] < n_tokens:
            out[name] = kind.ids[name]
    return out


def _sentencepiece_bpe(reader, tokens: list[str], types: list[int], unk: int | None) -> HfTokenizer:
    """SentencePiece BPE (`llama`): merges ranked by score, byte fallback, "▁" spaces (see the module doc)."""
    scores = _scores(reader, len(tokens))
    vocab = _first_ids(tokens)
    backend = HfTokenizer(BPE(
        vocab=vocab, merges=_merges_by_score(tokens, types, scores, vocab), unk_token=_text(tokens, unk),
        fuse_unk=True, byte_fallback=True,
    ))
    prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True))
    # Added tokens are cut out before normalizing, so each run of text between them gets its own "▁" prefix.
    backend.normalizer = normalizers.Sequence(
        [*([normalizers.Prepend(_SPACE)] if prefix else []), normalizers.Replace(" ", _SPACE)]
    )
    backend.decoder = _spm_decoder(prefix)
    return backend


def _merges_by_score(tokens: list[str], types: list[int], scores: list[float], vocab: dict[str, int]):
    """Every (left, right) pair of pieces that spells a normal piece, best-scoring piece first.

    llama.cpp merges the adjacent pair whose concatenation is the best-scoring piece (leftmost on a tie); a BPE
    rank per pair is the same order. Only normal pieces: the others are matched whole before merging, or are bytes.
    """
    pairs: list[tuple[float, int, str, str]] = []
    for i, piece in enumerate(tokens):
        if types[i] != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                pairs.append((-scores[i], i, left, right))
    pairs.sort(key=lambda p: (p[0], p[1]))
    return [(left, right) for _, _, left, right in pairs]


def _spm_decoder(prefix: bool):
    """"▁" -> space, <0xXX> pieces -> bytes -> text, and the prefix space stripped when the encoder adds one."""
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)


def _pre_rules(reader, path: str):
    """llama.cpp's split rules for the file's `tokenizer.ggml.pre` (its "default" ones, with a warning, when absent)."""
    pre = field(reader, "tokenizer.ggml.pre")
    if not pre:
        log.warning("%s: GGUF has no tokenizer.ggml.pre; splitting with llama.cpp's 'default' rules", path)
        pre = "default"
    try:
        return rules(str(pre))
    except UnknownPre as e:
        raise GgufError(f"{path}: {e}") from None


def _byte_level_bpe(reader, tokens: list[str], types: list[int], found: Pre) -> HfTokenizer:
    """Byte-level BPE (`gpt2`): the vocabulary spelled in GPT-2's byte alphabet, llama.cpp's splits before it."""
    merges = split_pairs(reader, "tokenizer.ggml.merges")
    if found.raw_utf8:
        return _spm_style_bpe(tokens, merges, found)
    spelling = _byte_spelling()
    # A normal token outside the byte alphabet is re-spelled byte by byte; a matched-whole one (control,
    # user-defined) keeps its text, which is how it appears in the input and how it decodes.
    spelled = list(tokens)
    for i in _outside_alphabet(tokens, spelling):
        if types[i] not in (CONTROL, USER_DEFINED, UNKNOWN):
            spelled[i] = "".join(spelling[b] for b in tokens[i].encode("utf-8"))
    backend = HfTokenizer(BPE(
        vocab=_first_ids(spelled), merges=merges, fuse_unk=False, byte_fallback=False,
        ignore_merges=found.ignore_merges,
    ))
    backend.pre_tokenizer = split_pre_tokenizer(found)
    backend.decoder = decoders.ByteLevel()
    return backend


def _spm_style_bpe(tokens: list[str], merges: list, found: Pre) -> HfTokenizer:
    """SPM-style BPE (`gemma4`): spaces as "▁", merges over UTF-8 characters per line, <0xXX> byte fallback.

    llama.cpp takes a run of newlines that is in the vocabulary whole; ignore_merges does that for every piece,
    which changes nothing for the lines whose merges reach their own token (BPE vocabularies are made by merging).
    """
    backend = HfTokenizer(BPE(
        vocab=_first_ids(tokens), merges=merges, fuse_unk=False, byte_fallback=True,
        ignore_merges=found.whole_newlines,
    ))
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.pre_tokenizer = split_pre_tokenizer(found)
    backend.decoder = _spm_decoder(prefix=False)
    return backend


def _wordpiece(reader, tokens: list[str], types: list[int], unk: int | None) -> HfTokenizer:
    """WordPiece (`bert`): llama.cpp's "▁word" / "piece" vocabulary re-spelled as BERT's "word" / "##piece"."""
    def bert_spelling(text: str, kind: int) -> str:
        if kind != NORMAL or text == _SPACE:
            return text
        return text[1:] if text.startswith(_SPACE) else "##" + text

    vocab = _first_ids([bert_spelling(t, k) for t, k in zip(tokens, types)])
    backend = HfTokenizer(WordPiece(vocab=vocab, unk_token=_text(tokens, unk) or "[UNK]"))
    lowercase = bool(field(reader, "tokenizer.ggml.normalizer.lowercase", True))
    strip_accents = bool(field(reader, "tokenizer.ggml.normalizer.strip_accents", lowercase))
    bert = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=strip_accents, lowercase=lowercase
    )
    # llama.cpp strips accents by keeping the first code point of each character's decomposition and dropping
    # every mark: BERT's NFD drops only non-spacing marks, and keeps a Hangul syllable's vowel and final jamo.
    drop = normalizers.Replace(Regex("[\\p{Mc}\\p{Me}\u1160-\u11ff]"), "")
    backend.normalizer = normalizers.Sequence([bert, drop]) if strip_accents else bert
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    return backend


def _unigram(reader, tokens: list[str], types: list[int], unk: int | None) -> HfTokenizer:
    """SentencePiece Unigram (`t5`): the charsmap, then llama.cpp's whitespace rules, then Viterbi over pieces."""
    scores = _scores(reader, len(tokens))
    backend = HfTokenizer(Unigram([(t, s) for t, s in zip(tokens, scores)], unk_id=unk, byte_fallback=False))
    steps = []
    charsmap = field(reader, "tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        precompiled = normalizers.Precompiled(bytes(b & 0xFF for b in charsmap))
        # `tokenizers` maps the grapheme "\r\n" as one; SentencePiece and llama.cpp map "\r" and "\n" each.
        crlf = precompiled.normalize_str("\r") + precompiled.normalize_str("\n")
        steps += [normalizers.Replace("\r\n", crlf), precompiled]
    prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", False))
    if field(reader, "tokenizer.ggml.remove_extra_whitespaces", False):
        # llama.cpp drops leading and trailing spaces and puts one "▁" before every run of text.
        steps += [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" +"), " ")]
        prefix_always = True
    else:
        prefix_always = prefix
    if prefix_always:
        steps.append(normalizers.Prepend(_SPACE))
    steps.append(normalizers.Replace(" ", _SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = _spm_decoder(prefix)
    return backend


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


def _scores(reader, n_tokens: int) -> list[float]:
    """Each token's score (SentencePiece's log probability), 0 when the file has none."""
    scores = [float(s) for s in field(reader, "tokenizer.ggml.scores") or []]
    return scores + [0.0] * (n_tokens - len(scores))


def _outside_alphabet(tokens: list[str], spelling: dict[int, str]) -> list[int]:
    """The ids of the tokens with a character outside GPT-2's byte alphabet, in order (one regex pass over them
    all, joined by a character inside it, so only the tokens' own characters match)."""
    outside = re.compile("[^" + re.escape("".join(spelling.values())) + "]")
    hits = [m.start() for m in outside.finditer("!".join(tokens))]
    if not hits:
        return []
    ends = list(itertools.accumulate(len(t) + 1 for t in tokens))  # token i lies in [ends[i - 1], ends[i] - 1)
    return sorted({bisect.bisect_right(ends, at) for at in hits})


def _first_ids(texts: list[str]) -> dict[str, int]:
    """text -> id, the first id when a text repeats (llama.cpp refuses such files; we keep the first)."""
    vocab = dict(zip(texts, range(len(texts))))
    if len(vocab) == len(texts):  # no text repeats (every file llama.cpp loads)
        return vocab
    vocab = {}
    for i, text in enumerate(texts):
        vocab.setdefault(text, i)
    return vocab


def _text(tokens: list[str], i: int | None) -> str | None:
    """The text of token i, or None."""
    return tokens[i] if i is not None else None


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

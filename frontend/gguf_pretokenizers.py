r"""The split rules llama.cpp applies before byte-level BPE, by `tokenizer.ggml.pre`, as `tokenizers` pre-tokenizers.

A GGUF names its pre-tokenizer but does not store it: the rules live in llama.cpp's code (src/llama-vocab.cpp,
`llm_tokenizer_bpe`), a list of regexes applied one after the other, each splitting every piece into its matches
and the text between them (what `Split(behavior="isolated")` does). The regexes below are llama.cpp's, as it runs
them (its adaptations of the tokenizer.json originals included, e.g. `((?=[\p{L}])([^a-z]))` for `\p{Lu}`), so
the ids equal llama.cpp's; with each name go llama.cpp's per-name flags that change ids: `ignore_merges` (a
piece already in the vocabulary is one token), whether a BOS is added when the file does not say, and for
gemma4-style names an SPM-style vocabulary ("▁" for spaces, <0xXX> bytes) split into lines.

Names llama.cpp implements with code of its own rather than a regex (kimi-k2's Han split, afmoe's digit groups,
superbpe's zero-width split) or with a whitespace-split vocabulary (whitespace) are refused, as is a name
llama.cpp does not know: `rules` raises UnknownPre naming it (llama.cpp refuses an unknown name too; a guessed
split would give ids the model was not trained on without anyone noticing). A file without the key gets
llama.cpp's "default" rules, with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers


@dataclass(frozen=True, slots=True)
class Pre:
    """One pre-tokenizer name's rules: llama.cpp's regexes and its flags for that name."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's add_bos when the file has no tokenizer.ggml.add_bos_token
    no_bos: bool = False  # llama.cpp drops the file's bos id (chatglm)
    raw_utf8: bool = False  # SPM-style BPE (gemma4): "▁" spaces and <0xXX> bytes, not GPT-2's byte alphabet
    whole_newlines: bool = False  # a run of newlines in the vocabulary is one token (llama.cpp's gemma4 fix)
    force_bos: bool = False  # BOS even when the file says add_bos_token = false (llama.cpp's gemma4 override)


_Pre = Pre

# llama.cpp's regex lists (one constant per distinct list; `\x22` is a double quote).
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_JAIS2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
)
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_SPARK2_5 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
    r"\p{N}",
)
_YOUTU = (
    r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_DEEPSEEK_CODER = (
    r"[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}",
)
_FALCON = (
    r"[\p{P}\$\+<=>\^~\|`]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"[0-9][0-9][0-9]",
)
_DIGITS_THEN_GPT2 = (
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
)
_GPT2 = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_BLOOM = (
    r" ?[^(\s|.,!?…。，、।۔،)]+",
)
_VIKING = (
    r" ?[^(\s|.,!?…。，、।۔،)]+",
    r"\p{N}",
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_CHAMELEON = (
    r"<sentinel:[0-9]+>",
    r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
    r"([\t\n]|    |  )",
    r"\p{N}",
    r"[\p{P}!-/:-@\[-`{-~]",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_GRANITE_EMBED = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_TINY_AYA = (
    r"\d{1,3}(?=(?:\d{3})*\b)",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
)
_SEED_CODER = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_UFAKZEKA = (
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_LAGUNA = (
    r"[^\n]+|[\n]+",
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_EXAONE_MOE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
)
_MINICPM5 = (
    r"\p{N}{1,3}",
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_LINES = (
    r"[^\n]+|[\n]+",
)
_DEFAULT = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)

_PRE = {
    "default": _Pre(_DEFAULT),
    "minicpm5": _Pre(_MINICPM5, ignore_merges=True),
    "llama3": _Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "llama-v3": _Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "llama-bpe": _Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "falcon3": _Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "falcon-h1": _Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "pixtral": _Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "midm-2.0": _Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "lfm2": _Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "jina-v5-nano": _Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "deepseek-llm": _Pre(_DEEPSEEK_LLM),
    "deepseek-coder": _Pre(_DEEPSEEK_CODER),
    "deepseek-v3": _Pre(_DEEPSEEK_V3),
    "spark2_5": _Pre(_SPARK2_5),
    "youtu": _Pre(_YOUTU, ignore_merges=True),
    "falcon": _Pre(_FALCON),
    "mpt": _Pre(_GPT2),
    "starcoder": _Pre(_DIGITS_THEN_GPT2),
    "gpt-2": _Pre(_GPT2),
    "phi-2": _Pre(_GPT2),
    "jina-es": _Pre(_GPT2),
    "jina-de": _Pre(_GPT2),
    "gigachat": _Pre(_GPT2),
    "jina-v2-es": _Pre(_GPT2),
    "jina-v2-de": _Pre(_GPT2),
    "a.x-4.0": _Pre(_GPT2),
    "mellum": _Pre(_GPT2),
    "modern-bert": _Pre(_GPT2),
    "jais-2": _Pre(_JAIS2),
    "jina-v1-en": _Pre(_GPT2),
    "jina-v2-code": _Pre(_GPT2),
    "roberta-bpe": _Pre(_GPT2),
    "refact": _Pre(_DIGITS_THEN_GPT2),
    "command-r": _Pre(_DIGITS_THEN_GPT2),
    "qwen2": _Pre(_QWEN2),
    "deepseek-r1-qwen": _Pre(_QWEN2),
    "kormo": _Pre(_QWEN2),
    "f2llmv2": _Pre(_QWEN2),
    "qwen35": _Pre(_QWEN35),
    "stablelm2": _Pre(_QWEN2),
    "olmo": _Pre(_GPT2),
    "dbrx": _Pre(_LLAMA3),
    "smaug-bpe": _Pre(_LLAMA3),
    "poro-chat": _Pre(_BLOOM),
    "chatglm-bpe": _Pre(_LLAMA3, no_bos=True),
    "glm4": _Pre(_LLAMA3, ignore_merges=True, no_bos=True),
    "glm5": _Pre(_LLAMA3, ignore_merges=True, no_bos=True),
    "viking": _Pre(_VIKING),
    "jais": _Pre(_GPT2),
    "tekken": _Pre(_TEKKEN, ignore_merges=True, add_bos=True),
    "smollm": _Pre(_DIGITS_THEN_GPT2),
    "codeshell": _Pre(_DIGITS_THEN_GPT2),
    "bloom": _Pre(_BLOOM),
    "gpt3-finnish": _Pre(_BLOOM),
    "exaone": _Pre(_DIGITS_THEN_GPT2),
    "exaone4": _Pre(_GPT2),
    "exaone-moe": _Pre(_EXAONE_MOE),
    "chameleon": _Pre(_CHAMELEON, add_bos=True),
    "minerva-7b": _Pre(_DIGITS_THEN_GPT2),
    "megrez": _Pre(_QWEN2),
    "gpt-4o": _Pre(_GPT4O),
    "llama4": _Pre(_GPT4O),
    "kanana2": _Pre(_GPT4O),
    "talkie": _Pre(_GPT4O),
    "granite-embed-multi-97m": _Pre(_GRANITE_EMBED, ignore_merges=True),
    "tiny_aya": _Pre(_TINY_AYA),
    "cohere2moe": _Pre(_TINY_AYA),
    "trillion": _Pre(_GPT2),
    "granite-docling": _Pre(_GPT2),
    "bailingmoe": _Pre(_BAILINGMOE),
    "bailingmoe2": _Pre(_BAILINGMOE),
    "llada-moe": _Pre(_BAILINGMOE),
    "seed-coder": _Pre(_SEED_CODER),
    "hunyuan": _Pre(_QWEN2),
    "hunyuan-dense": _Pre(_DEEPSEEK_V3),
    "hy_v4": _Pre(_DEEPSEEK_V3),
    "joyai-llm": _Pre(_DEEPSEEK_V3),
    "ufakzeka": _Pre(_UFAKZEKA),
    "grok-2": _Pre(_QWEN2),
    "laguna": _Pre(_LAGUNA),
    "minimax-m2": _Pre(_GPT4O),
    "solar-open": _Pre(_QWEN2),
    "mellum2": _Pre(_DIGITS_THEN_GPT2),
    "gemma4": _Pre(_LINES, add_bos=True, raw_utf8=True, whole_newlines=True, force_bos=True),
    "granite-embed-multi-311m": _Pre(_LINES, add_bos=True, raw_utf8=True, whole_newlines=True, force_bos=True),
    "sarvam-moe": _Pre(_LINES, raw_utf8=True),
}

SUPPORTED_PRE: tuple[str, ...] = tuple(_PRE)
REFUSED_PRE = {
    "kimi-k2": "llama.cpp splits Han runs with code of its own",
    "afmoe": "llama.cpp groups digits with code of its own",
    "superbpe": "llama.cpp splits it with a zero-width regex",
    "whitespace": "a whitespace-split vocabulary, not byte-level",
}


class UnknownPre(ValueError):
    """A `tokenizer.ggml.pre` this table has no rules for (the message says why)."""


def rules(pre: str) -> Pre:
    """The rules for a pre-tokenizer name; UnknownPre when it is refused or unknown."""
    found = _PRE.get(pre)
    if found is not None:
        return found
    if pre in REFUSED_PRE:
        raise UnknownPre(f"GGUF pre-tokenizer {pre!r} is not supported ({REFUSED_PRE[pre]})")
    raise UnknownPre(
        f"GGUF pre-tokenizer {pre!r} is unknown (llama.cpp refuses it too; {len(_PRE)} names are known, "
        "e.g. llama-bpe, qwen2, smollm, gpt-4o, deepseek-llm, tekken)"
    )


def split_pre_tokenizer(found: Pre):
    """llama.cpp's splits, one after the other, then (byte-level vocabularies) GPT-2's byte -> character mapping."""
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in found.regexes]
    if found.raw_utf8:
        return pre_tokenizers.Sequence(splits)
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

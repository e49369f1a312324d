"""The tokenizer rebuilt from a GGUF gives llama.cpp's ids, for every tokenizer kind and pre-tokenizer we read.

tests/data/ holds small vocab-only GGUFs (SentencePiece BPE, Unigram, byte-level BPE, WordPiece) and the ids
llama.cpp's own tokenizer gave for a corpus of awkward text, made once by scripts/make_gguf_tokenizer_data.py. A
case is a file plus metadata overrides (another pre-tokenizer, add_space_prefix off, ...), applied here to the
reader as the script applied them to a copy of the file for llama.cpp.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import pytest
from gguf_models import smollm2_path

from metrale import gguf_metadata
from metrale.frontend.detokenizer import IncrementalDetokenizer
from metrale.frontend.gguf_pretokenizers import REFUSED_PRE, SUPPORTED_PRE
from metrale.frontend.gguf_tokenizer import tokenizer_from_gguf
from metrale.frontend.tokenizer import Tokenizer
from metrale.gguf_metadata import GgufError
from metrale.ipc.sampling import SamplingParams

DATA = Path(__file__).parent / "data"
GOLDEN = json.loads((DATA / "gguf_tokenizer_golden.json").read_text(encoding="utf-8"))
CORPUS: list[str] = GOLDEN["corpus"]


class _Value:
    """A metadata value standing in for a GGUF reader's field (field() calls contents())."""

    def __init__(self, value) -> None:
        self.value = value

    def contents(self):
        return self.value


class _Overridden:
    """A GGUF reader with some metadata keys replaced (or removed, with None)."""

    def __init__(self, reader, overrides: dict) -> None:
        self.tensors = reader.tensors
        self.fields = dict(reader.fields)
        for key, value in overrides.items():
            if value is None:
                self.fields.pop(key, None)
            else:
                self.fields[key] = _Value(value)


@functools.cache
def _open(path: Path):
    """The GGUF reader of a file, opened once per test session (the SmolLM2 file's cases share one)."""
    return gguf_metadata.open_gguf(path)


def load(path: Path, overrides: dict | None = None) -> Tokenizer:
    """metrale's Tokenizer for a GGUF file with the overrides applied, built as Tokenizer.from_gguf builds it."""
    reader = _Overridden(_open(path), overrides or {})
    return Tokenizer.from_gguf_tokenizer(tokenizer_from_gguf(reader, str(path)))


def mismatches(tok: Tokenizer, case: dict) -> list[str]:
    """Each corpus text whose ids differ from llama.cpp's, with both lists (with and without BOS/EOS)."""
    out = []
    for text, want, want_plain in zip(CORPUS, case["special"], case.get("plain", case["special"])):
        got, got_plain = tok.encode(text), tok.encode(text, add_special_tokens=False)
        if got != want or got_plain != want_plain:
            out.append(f"{text!r}: ours {got} / {got_plain}, llama.cpp {want} / {want_plain}")
    return out


def case_id(case: dict) -> str:
    return case["file"].removeprefix("gguf_tok_").removesuffix(".gguf") + "".join(
        f"-{k.rsplit('.', 1)[-1]}={v}" for k, v in case["overrides"].items()
    )


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=case_id)
def test_ids_equal_llama_cpps(case):
    assert "error" not in case, f"llama.cpp refused this case when the golden ids were made: {case['error']}"
    bad = mismatches(load(DATA / case["file"], case["overrides"]), case)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("case", [c for c in GOLDEN["cases"] if "text" in c], ids=case_id)
def test_sentencepiece_text_equals_llama_cpps(case):
    # llama.cpp keeps the prefix space after a BOS or other special token it drops, where transformers and we
    # strip it (so a prompt decodes to its text): compared from the first text token on.
    tok = load(DATA / case["file"], case["overrides"])
    compared = 0
    for text, ids, want in zip(CORPUS, case.get("plain", case["special"]), case["text"]):
        if ids and ids[0] in tok.special_token_ids:
            continue
        assert tok.decode(ids) == want, text
        compared += 1
    assert compared >= len(CORPUS) - 3


@pytest.mark.parametrize(
    "case", GOLDEN.get("smollm2", []), ids=lambda c: c["overrides"].get("tokenizer.ggml.pre", "as-is")
)
def test_smollm2_ids_equal_llama_cpps(case):
    bad = mismatches(load(smollm2_path(), case["overrides"]), case)
    assert not bad, "\n".join(bad)


def test_every_pre_tokenizer_has_golden_ids():
    bpe = [c for c in GOLDEN["cases"] if c["file"] in ("gguf_tok_bpe.gguf", "gguf_tok_gemma4.gguf")]
    tested = {c["overrides"].get("tokenizer.ggml.pre", "gpt-2") for c in bpe if c["overrides"]}
    tested.add("gpt-2")  # the byte-level file's own
    assert tested == set(SUPPORTED_PRE)


@pytest.mark.parametrize("name", ["spm", "ugm", "bpe", "wpm", "gemma4"])
def test_file_loads_through_tokenizer_from_dir(name):
    tok = Tokenizer.from_dir(DATA / f"gguf_tok_{name}.gguf")
    case = next(c for c in GOLDEN["cases"] if c["file"] == f"gguf_tok_{name}.gguf" and not c["overrides"])
    assert tok.encode(CORPUS[0]) == case["special"][0]


@pytest.mark.parametrize("overrides", [{}, {"tokenizer.ggml.add_space_prefix": False}], ids=["prefix", "no-prefix"])
def test_sentencepiece_decode_gives_the_text_back(overrides):
    tok = load(DATA / "gguf_tok_spm.gguf", overrides)
    added = [t for t in tok.backend.get_added_tokens_decoder().values()]
    for text in CORPUS:
        if not any(t.content in text for t in added):  # text after an added token gets its own "▁"
            assert tok.decode(tok.encode(text)) == text
    assert tok.encode("😀", add_special_tokens=False)[-4:] == [tok.token_id(f"<0x{b:02X}>") for b in "😀".encode()]


def test_sentencepiece_stream_equals_the_full_decode():
    tok = load(DATA / "gguf_tok_spm.gguf")
    prompt = tok.encode("Say something:")
    for text in CORPUS:
        out = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt, SamplingParams(max_tokens=len(out) + 1))
        streamed = "".join(detok.push([i])[0] for i in out) + detok.flush()
        assert tok.decode(prompt) + streamed == tok.decode(prompt + out), text


def test_special_tokens_and_template_come_from_the_file():
    tok = Tokenizer.from_dir(DATA / "gguf_tok_spm.gguf")
    # eos </s>, then what llama.cpp ends a generation at by its text (<|endoftext|>, <|im_end|>)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.unk_token_id) == (1, (2, 4, 6), 0)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    ids = {tok.token_id(t) for t in ("<s>", "</s>", "<unk>", "<ctrl>")}
    assert ids <= tok.special_token_ids  # control and unknown tokens: skipped when decoding
    assert tok.token_id("<|im_start|>") not in tok.special_token_ids  # user-defined: decodes as text
    assert tok.token_id("<|im_end|>") in tok.special_token_ids  # user-defined, but llama.cpp's end of turn
    assert tok.decode(tok.encode("<|im_start|>hi<ctrl><|im_end|>")) == "<|im_start|> hi"


def test_an_unknown_pre_tokenizer_is_one_error_naming_it():
    with pytest.raises(GgufError, match=r"pre-tokenizer 'brand-new' is unknown \(llama.cpp refuses it too"):
        load(DATA / "gguf_tok_bpe.gguf", {"tokenizer.ggml.pre": "brand-new"})


@pytest.mark.parametrize("pre", sorted(REFUSED_PRE))
def test_a_refused_pre_tokenizer_says_why(pre):
    with pytest.raises(GgufError, match=rf"pre-tokenizer '{pre}' is not supported \("):
        load(DATA / "gguf_tok_bpe.gguf", {"tokenizer.ggml.pre": pre})


def test_a_missing_pre_tokenizer_splits_as_llama_cpps_default_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="metrale.frontend.gguf_tokenizer"):
        missing = load(DATA / "gguf_tok_bpe.gguf", {"tokenizer.ggml.pre": None})
    assert "no tokenizer.ggml.pre" in caplog.text
    default = load(DATA / "gguf_tok_bpe.gguf", {"tokenizer.ggml.pre": "default"})
    assert [missing.encode(t) for t in CORPUS] == [default.encode(t) for t in CORPUS]


@pytest.mark.parametrize("kind", ["rwkv", "plamo2", "whitespace"])
def test_an_unsupported_tokenizer_model_is_one_error_naming_it(kind):
    supported = r"\(supported: llama, gpt2, bert, t5, gemma4\)"
    with pytest.raises(GgufError, match=rf"tokenizer model '{kind}' is not supported {supported}"):
        load(DATA / "gguf_tok_bpe.gguf", {"tokenizer.ggml.model": kind})


def test_tokens_outside_the_byte_alphabet_are_found_in_one_pass():
    # Found by one regex pass over the joined vocabulary, the ids must be those whose characters are not all in
    # GPT-2's alphabet (a space, a newline, a CJK character, at either end or alone), and no others.
    from metrale.frontend.gguf_tokenizer import _byte_spelling, _outside_alphabet

    spelling = _byte_spelling()
    tokens = ["Ġthe", "a b", "é", "\n", "x中", "ĊĊ", "", "<|im_start|>", "中", " ", "ok!", "end "]
    alphabet = set(spelling.values())
    assert _outside_alphabet(tokens, spelling) == [i for i, t in enumerate(tokens) if not set(t) <= alphabet]
    assert _outside_alphabet(["Ġa", "b"], spelling) == []

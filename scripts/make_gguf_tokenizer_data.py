"""Write the tokenizer test GGUFs under tests/data/ and the token ids llama.cpp gives for them (the golden file).

Run once, with a Python that has llama-cpp-python (0.3.36 made the committed ids), sentencepiece, protobuf,
tokenizers and gguf; metrale itself is not imported (the tests read only what this writes):

    python scripts/make_gguf_tokenizer_data.py [--smollm2 FILE] [--files-only]

The files come out the same every run; the ids are whatever that llama.cpp says. Each vocabulary is trained or
counted here on a fixed corpus (sentencepiece BPE with byte fallback, sentencepiece Unigram with NFKC, a
byte-level BPE, a WordPiece and a Gemma-4-style BPE) and written as a vocab-only GGUF with the `gguf` writer.
llama.cpp (`Llama(vocab_only=True)`) then tokenizes CORPUS for every case: a case is a file plus metadata
overrides (another `tokenizer.ggml.pre`, add_space_prefix, add_bos_token, ...), written to a scratch copy for
llama.cpp; tests/test_gguf_tokenizer.py applies the same overrides to the committed file. With --smollm2, the
SmolLM2 file's vocabulary is tokenized too, with its own pre-tokenizer and with each other set of rules in the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
GOLDEN = DATA / "gguf_tokenizer_golden.json"

# The text tokenized for every case: whitespace runs, leading spaces, newlines and tabs, accents, CJK, emoji and
# bytes no vocabulary here has, code, digits, contractions, and text that looks like special tokens.
CORPUS = [
    "Hello world",
    " Hello world",
    "  two leading spaces and   runs   of    spaces",
    "trailing spaces   ",
    " ",
    "   ",
    "",
    "line one\nline two\n\nline four\r\nwindows line",
    "\n\n\nthree newlines first",
    "\ttabs\tand\t\tdouble tabs \t mixed",
    "café naïve résumé Ångström Straße façade",
    "你好世界，今天天气很好。日本語のテキストです",
    "한국어 텍스트 입니다",
    "emoji 😀🎉👍🏽 and ✨ sparkles",
    "rare: \u0001\u007f𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ﬁ Ⅻ ½ ２０２４",
    "def square(x):\n    return x ** 2  # the square\n",
    "if (a && b) { c[i] = d->e; } else { print(\"no\"); }",
    "digits 1 12 123 1234 12345 3.14159 1,000,000 and 2024-01-31",
    "I'm you're they've it's we'll he'd DON'T I'M",
    "<s>looks special</s> <unk> <|im_start|>user\nhi<|im_end|>",
    "<0x41> [CLS] [SEP] <mask> <|endoftext|>",
    "Mixed CASE camelCase snake_case kebab-case HTTPServer ÉCOLE école",
    "The quick brown fox jumps over the lazy dog.",
    "Hello<|im_start|>  spaced <|im_end|>\n",
    "an unreachable qqzx word",
]

# Training text: English, code and CJK, so each vocabulary has merges for words, indentation and characters.
TRAINING = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away quickly.",
    "Hello world! Hello there, how are you doing today? I'm fine, thanks, and you're welcome.",
    "def square(x):\n    return x * x\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "for i in range(10):\n\tprint(i, end=' ')\n# comment line with spaces   and tabs\n",
    "Numbers like 1, 12, 123, 2024 and 3.14 appear in text: 100 percent, 42 answers, 7 days.",
    "你好世界，今天天气很好。我们一起去公园散步吧。"
    "日本語のテキストです。한국어 텍스트 입니다.",
    "Café, naïve, résumé and façade are French words; Straße is German; Ångström is Swedish.",
    "CamelCase and snake_case and kebab-case identifiers: HTTPServer, getValue, MAX_SIZE.",
    "if (a && b) { c[i] = d->e; } else { return -1; } // braces, brackets and arrows",
    "They've said it's what we'll do. He'd known. DON'T SHOUT. We are here, they are there.",
]
SPM_USER_DEFINED = ["<|im_start|>", "<|im_end|>"]
SPM_CONTROL = ["<ctrl>", "<|endoftext|>"]  # <|endoftext|>: llama.cpp's Phi-3 rule names it
BPE_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<|im_start|>", "<|im_end|>"]
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def llama_hparams(writer, name: str) -> None:
    """The few llama hyper-parameters llama.cpp reads before a vocab-only load."""
    writer.add_name(name)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)


def write_gguf(path: Path, name: str, kv: dict) -> None:
    """A vocab-only llama GGUF holding the tokenizer keys in kv (key -> value, typed by the Python value)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    llama_hparams(writer, name)
    for key, value in kv.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bytes):
            writer.add_array(key, value)  # a uint8 array
        else:
            writer.add_array(key, list(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def train_sentencepiece(model_type: str, vocab_size: int, **options):
    """A sentencepiece ModelProto trained on TRAINING (one thread: the same pieces every run)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAINING * 20), model_writer=model, model_type=model_type, vocab_size=vocab_size,
        num_threads=1, character_coverage=0.9995, minloglevel=2, **options,
    )
    proto = pb.ModelProto()
    proto.ParseFromString(model.getvalue())
    return proto


def spm_bpe_kv() -> dict:
    """SentencePiece BPE with byte fallback, control and user-defined pieces (`tokenizer.ggml.model` = llama)."""
    proto = train_sentencepiece(
        "bpe", 420, byte_fallback=True, user_defined_symbols=SPM_USER_DEFINED, control_symbols=SPM_CONTROL,
    )
    pieces = list(proto.pieces)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [p.piece for p in pieces],
        "tokenizer.ggml.scores": [float(p.score) for p in pieces],
        "tokenizer.ggml.token_type": [int(p.type) for p in pieces],
        "tokenizer.ggml.bos_token_id": proto.trainer_spec.bos_id,
        "tokenizer.ggml.eos_token_id": proto.trainer_spec.eos_id,
        "tokenizer.ggml.unknown_token_id": proto.trainer_spec.unk_id,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": True,
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}",
    }


def ugm_kv() -> dict:
    """SentencePiece Unigram with its NFKC charsmap (`tokenizer.ggml.model` = t5)."""
    proto = train_sentencepiece("unigram", 300, user_defined_symbols=["<|im_start|>"], hard_vocab_limit=False)
    pieces = list(proto.pieces)
    return {
        "tokenizer.ggml.model": "t5",
        "tokenizer.ggml.tokens": [p.piece for p in pieces],
        "tokenizer.ggml.scores": [float(p.score) for p in pieces],
        "tokenizer.ggml.token_type": [int(p.type) for p in pieces],
        "tokenizer.ggml.bos_token_id": proto.trainer_spec.bos_id,
        "tokenizer.ggml.eos_token_id": proto.trainer_spec.eos_id,
        "tokenizer.ggml.unknown_token_id": proto.trainer_spec.unk_id,
        "tokenizer.ggml.add_space_prefix": proto.normalizer_spec.add_dummy_prefix,
        "tokenizer.ggml.remove_extra_whitespaces": proto.normalizer_spec.remove_extra_whitespaces,
        "tokenizer.ggml.precompiled_charsmap": bytes(proto.normalizer_spec.precompiled_charsmap),
    }


def byte_bpe_kv() -> dict:
    """A byte-level BPE trained with no split at all, so every pre-tokenizer's split changes the ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=BPE_SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING * 20, trainer)
    model = json.loads(tok.to_str())["model"]
    # Words no merge reaches: one token only where llama.cpp ignores merges for a piece in the vocabulary.
    tokens = sorted(model["vocab"], key=model["vocab"].get) + ["qqzx", "\u0120qqzx"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [CONTROL if t in BPE_SPECIAL else NORMAL for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.add_bos_token": False,
    }


def spm_style_bpe_kv() -> dict:
    """An SPM-style BPE as Gemma 4 has it: "▁" spaces, merges within lines, <0xXX> byte pieces (`gemma4`)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[^\n]+|[\n]+"), behavior="isolated")
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=GEMMA_SPECIAL, show_progress=False)
    tok.train_from_iterator(TRAINING * 20, trainer)
    model = json.loads(tok.to_str())["model"]
    trained = sorted(model["vocab"], key=model["vocab"].get)
    tokens = [*GEMMA_SPECIAL, *(f"<0x{b:02X}>" for b in range(256)), *trained[len(GEMMA_SPECIAL):]]
    tokens += [t for t in ("\n\n\n",) if t not in tokens]  # no merge makes it: llama.cpp takes the run whole
    kinds = {**{t: CONTROL for t in GEMMA_SPECIAL}, **{f"<0x{b:02X}>": BYTE for b in range(256)}}
    return {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [kinds.get(t, NORMAL) for t in tokens],
        "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m for m in model["merges"]],
        "tokenizer.ggml.bos_token_id": tokens.index("<bos>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<eos>"),
        "tokenizer.ggml.unknown_token_id": tokens.index("<unk>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<pad>"),
    }


def wordpiece_kv() -> dict:
    """A BERT WordPiece (uncased), its vocabulary spelled as llama.cpp's converter writes it (phantom spaces).

    Built by counting rather than trained (tokenizers' WordPiece trainer breaks ties differently run to run):
    the specials, every character of the training text as a word start and as a continuation, the most frequent
    words and a few common suffixes.
    """
    import collections
    import re
    import unicodedata

    text = unicodedata.normalize("NFD", " ".join(TRAINING).lower())
    text = "".join(c for c in text if unicodedata.category(c) != "Mn")
    words = re.findall(r"\w+|[^\w\s]", text)
    chars = sorted({c for w in words for c in w})
    counts = collections.Counter(w for w in words if len(w) > 1)
    frequent = sorted(counts, key=lambda w: (-counts[w], w))[:120]
    suffixes = ["##s", "##ing", "##ed", "##ly", "##er", "##es", "##tion"]
    hf_tokens = list(dict.fromkeys([*BERT_SPECIAL, *chars, *(f"##{c}" for c in chars), *frequent, *suffixes]))

    def phantom(t: str) -> str:
        if t.startswith("[") and t.endswith("]"):
            return t
        return t[2:] if t.startswith("##") else "\u2581" + t

    tokens = [phantom(t) for t in hf_tokens]
    return {
        "tokenizer.ggml.model": "bert",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [CONTROL if t in BERT_SPECIAL else NORMAL for t in hf_tokens],
        "tokenizer.ggml.bos_token_id": tokens.index("[CLS]"),
        "tokenizer.ggml.seperator_token_id": tokens.index("[SEP]"),
        "tokenizer.ggml.unknown_token_id": tokens.index("[UNK]"),
        "tokenizer.ggml.padding_token_id": tokens.index("[PAD]"),
        "tokenizer.ggml.mask_token_id": tokens.index("[MASK]"),
    }


FILES = {
    "gguf_tok_spm.gguf": spm_bpe_kv,
    "gguf_tok_ugm.gguf": ugm_kv,
    "gguf_tok_bpe.gguf": byte_bpe_kv,
    "gguf_tok_wpm.gguf": wordpiece_kv,
    "gguf_tok_gemma4.gguf": spm_style_bpe_kv,
}


def cases() -> list[tuple[str, dict]]:
    """(file, metadata overrides) pairs: each file as written, then the variants its flags allow."""
    out: list[tuple[str, dict]] = [(name, {}) for name in FILES]
    out += [
        ("gguf_tok_spm.gguf", {"tokenizer.ggml.add_space_prefix": False}),
        ("gguf_tok_spm.gguf", {"tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.add_bos_token": False}),
        ("gguf_tok_spm.gguf", {"general.name": "Phi-3 tiny"}),  # llama.cpp's rstrip of special tokens
        ("gguf_tok_ugm.gguf", {
            "tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.remove_extra_whitespaces": False,
        }),
        ("gguf_tok_bpe.gguf", {"tokenizer.ggml.add_bos_token": True}),
    ]
    pres = supported_pre()
    module = sys.modules["gguf_pretokenizers"]
    out += [
        ("gguf_tok_bpe.gguf", {"tokenizer.ggml.pre": pre}) for pre in pres
        if pre != "gpt-2" and not module.rules(pre).raw_utf8
    ]
    out += [  # the SPM-style names on a gpt2-model file, as llama.cpp's converter writes them
        ("gguf_tok_gemma4.gguf", {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre}) for pre in pres
        if module.rules(pre).raw_utf8
    ]
    out.append(("gguf_tok_gemma4.gguf", {"tokenizer.ggml.add_bos_token": False}))  # llama.cpp adds one anyway
    return out


def supported_pre() -> tuple[str, ...]:
    """metrale's pre-tokenizer names, from frontend/gguf_pretokenizers.py alone (this venv has no metrale)."""
    spec = importlib.util.spec_from_file_location("gguf_pretokenizers", ROOT / "frontend" / "gguf_pretokenizers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.SUPPORTED_PRE


def distinct_pre() -> list[str]:
    """One pre-tokenizer name per distinct set of rules (regexes and flags), in table order."""
    module = sys.modules["gguf_pretokenizers"]
    seen: dict = {}
    for name in supported_pre():
        if not module.rules(name).raw_utf8:  # an SPM-style split means nothing to a byte-level vocabulary
            seen.setdefault(module.rules(name), name)
    return list(seen.values())


def read_kv(path: Path) -> dict:
    """The tokenizer.* and general.name keys of a GGUF file, as write_gguf takes them."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.") or key == "general.name":
            value = f.contents()
            if key == "tokenizer.ggml.precompiled_charsmap":
                value = bytes(v & 0xFF for v in value)
            elif key in ("tokenizer.ggml.scores",):
                value = [float(v) for v in value]
            elif key in ("tokenizer.ggml.token_type",):
                value = [int(v) for v in value]
            out[key] = value
    return out


def llama_ids(path: Path) -> dict:
    """llama.cpp's ids for CORPUS: with the file's BOS/EOS rule (add_special) and, when they differ, without."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    special = [llm.tokenize(t.encode(), add_bos=True, special=True) for t in CORPUS]
    plain = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in CORPUS]
    out = {"special": special} if plain == special else {"special": special, "plain": plain}
    if llm.metadata.get("tokenizer.ggml.model") in ("llama", "t5"):  # llama.cpp cleans other kinds' spaces
        out["text"] = [detokenize(llm, ids) for ids in plain]
    del llm
    return out


def detokenize(llm, ids: list[int]) -> str:
    """llama.cpp's own text of ids (llama_detokenize: special tokens removed, not rendered)."""
    import ctypes

    import llama_cpp

    tokens = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    size = 16 * len(ids) + 16
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(llm._model.vocab, tokens, len(ids), buf, size, True, False)
    return buf.raw[:n].decode("utf-8", errors="replace")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", help="the SmolLM2 GGUF, to record its ids too")
    parser.add_argument("--files-only", action="store_true", help="write the GGUFs, not the golden ids")
    args = parser.parse_args()
    DATA.mkdir(parents=True, exist_ok=True)
    for name, make in FILES.items():
        write_gguf(DATA / name, name.removesuffix(".gguf"), make())
    if args.files_only:
        return
    golden: dict = {"corpus": CORPUS, "cases": []}
    with tempfile.TemporaryDirectory() as scratch:
        for name, overrides in cases():
            kv = {**read_kv(DATA / name), **overrides}
            path = Path(scratch) / "case.gguf"
            write_gguf(path, str(kv.pop("general.name", name)), kv)
            try:
                ids = llama_ids(path)
            except Exception as e:  # noqa: BLE001 - a case llama.cpp refuses is recorded as such
                ids = {"error": str(e)}
            golden["cases"].append({"file": name, "overrides": overrides, **ids})
            print(name, overrides, "error" if "error" in ids else "ok", flush=True)
        if args.smollm2:
            golden["smollm2"] = smollm2_cases(Path(args.smollm2), Path(scratch))
    GOLDEN.write_text(json.dumps(golden, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")


def smollm2_cases(path: Path, scratch: Path) -> list[dict]:
    """llama.cpp's ids for the real SmolLM2 file, then for its vocabulary under each other set of split rules."""
    out = [{"overrides": {}, **llama_ids(path)}]
    kv = read_kv(path)
    kv.pop("general.name", None)
    for pre in distinct_pre():
        if pre == kv.get("tokenizer.ggml.pre"):
            continue
        copy = scratch / "smollm2_vocab.gguf"
        write_gguf(copy, "smollm2 vocab", {**kv, "tokenizer.ggml.pre": pre})
        out.append({"overrides": {"tokenizer.ggml.pre": pre}, **llama_ids(copy)})
        print("smollm2", pre, flush=True)
    return out


if __name__ == "__main__":
    main()

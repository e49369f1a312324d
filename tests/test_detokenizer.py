"""IncrementalDetokenizer and Tokenizer on a small byte-level BPE trained here (and the tiny model's, when present)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from metrale.frontend.detokenizer import IncrementalDetokenizer
from metrale.frontend.tokenizer import UNDECODED, Tokenizer
from metrale.ipc.sampling import SamplingParams

CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "def hello(world):\n    return world + 1\n",
    "你好世界，今天天气很好。",
    "emoji 😀🎉 café naïve ``` code fence ```",
]
SPECIALS = ["<s>", "</s>", "<unk>"]
ADDED_SPECIALS = ["<think>", "</think>", "<tool_call>"]


def write_byte_bpe(folder: Path) -> Path:
    """Train a 400-token byte-level BPE (multi-byte characters split across tokens) and write an HF folder."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 50, trainer)
    tok.add_special_tokens(ADDED_SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "model_max_length": 2048,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 1, "max_position_embeddings": 2048}))
    return folder


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return write_byte_bpe(tmp_path_factory.mktemp("byte_bpe"))


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def stream(tok: Tokenizer, prompt: list[int], out: list[int], params: SamplingParams, chunk: int = 1):
    """Push `out` in chunks; return (deltas, stopped, detokenizer) with flush's text as the last delta."""
    detok = IncrementalDetokenizer(tok, prompt, params)
    deltas = []
    stopped = False
    for i in range(0, len(out), chunk):
        text, stopped = detok.push(out[i : i + chunk])
        deltas.append(text)
        if stopped:
            break
    deltas.append(detok.flush())
    return deltas, stopped, detok


def test_tokenizer_matches_transformers(tok_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    for text in ["Hello world", "你好 😀 fox", "<think>x</think>", "", "  spaces  \n\n tabs\t"]:
        assert tok.encode(text) == hf(text)["input_ids"], text
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_tokenizer_facts(tok):
    assert tok.encode("fox")[0] == tok.bos_token_id == 0
    assert tok.eos_token_ids == (1,)
    assert tok.vocab_size == tok.backend.get_vocab_size() > 300
    assert tok.token_id("<think>") is not None and tok.token_id("</think>") in tok.special_token_ids
    assert tok.token_id("no such token at all") is None
    assert "<tool_call>" in tok.named_token_ids()
    assert tok.chat_template.startswith("{% for")
    assert tok.model_max_length == 2048


def test_emoji_split_across_tokens_is_never_broken(tok):
    text = "emoji 😀🎉 猫 done"
    out = tok.encode(text, add_special_tokens=False)
    assert len(out) > len(text.split())  # the emoji and the unseen CJK character take several byte tokens
    deltas, _, _ = stream(tok, tok.encode("Say:"), out, SamplingParams())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_cjk_and_emoji_round_trip_in_any_chunking(tok, chunk):
    text = "你好世界 😀 猫狗 🎉🎉 naïve café"
    out = tok.encode(text, add_special_tokens=False)
    deltas, stopped, detok = stream(tok, tok.encode("x"), out, SamplingParams(), chunk)
    assert not stopped
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)


def test_text_matches_whole_decode_for_random_ids(tok):
    rng = random.Random(7)
    for _ in range(30):
        out = [rng.randrange(3, 400) for _ in range(rng.randrange(1, 40))]
        deltas, _, detok = stream(tok, tok.encode("prompt"), out, SamplingParams(), rng.randrange(1, 4))
        assert "".join(deltas) == tok.decode(out)
        assert detok.output_ids == out


def test_prompt_ending_mid_character_does_not_shift_output(tok):
    emoji = tok.encode("😀", add_special_tokens=False)
    assert len(emoji) >= 2
    prompt = tok.encode("hi ") + emoji[:1]  # the prompt ends inside a character
    out = tok.encode(" fox", add_special_tokens=False)
    deltas, _, _ = stream(tok, prompt, out, SamplingParams())
    assert "".join(deltas) == tok.decode(out)


def test_skip_special_tokens_is_honoured(tok):
    think, end = tok.token_id("<think>"), tok.token_id("</think>")
    words = [tok.encode(w, add_special_tokens=False) for w in ("plan", " answer")]
    out = [think, *words[0], end, *words[1], 1]
    skipped, _, _ = stream(tok, [0], out, SamplingParams(skip_special_tokens=True))
    kept, _, _ = stream(tok, [0], out, SamplingParams(skip_special_tokens=False))
    assert "".join(skipped) == "plan answer" == tok.decode(out, skip_special_tokens=True)
    assert "".join(kept) == "<think>plan</think> answer</s>" == tok.decode(out, skip_special_tokens=False)


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_is_never_streamed(tok, chunk):
    text = "The quick brown fox jumps over the lazy dog."
    out = tok.encode(text, add_special_tokens=False)
    deltas, stopped, detok = stream(tok, [0], out, SamplingParams(stop=["fox jumps"]), chunk)
    assert stopped and detok.stop_string == "fox jumps"
    assert "".join(deltas) == "The quick brown "
    assert all("fox" not in d for d in deltas)
    # no ids past the token that completed the stop string are accepted
    assert tok.decode(detok.output_ids).startswith("The quick brown fox jumps")
    assert len(detok.output_ids) < len(out)


def test_stop_string_split_inside_a_multibyte_character(tok):
    text = "ok 😀🎉 after"
    out = tok.encode(text, add_special_tokens=False)
    deltas, stopped, _ = stream(tok, [0], out, SamplingParams(stop=["🎉"]))
    assert stopped and "".join(deltas) == "ok 😀"
    assert all("\ufffd" not in d for d in deltas)


def test_partial_stop_prefix_is_held_then_released(tok):
    out = tok.encode("the lazy dog", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [0], SamplingParams(stop=["lazy cat"]))
    streamed = []
    for t in out:
        text, stopped = detok.push([t])
        assert not stopped
        streamed.append(text)
        # whatever could still become "lazy cat" is not out yet
        assert not "".join(streamed).endswith("lazy")
    streamed.append(detok.flush())
    assert "".join(streamed) == "the lazy dog"


def test_earliest_of_several_stop_strings_wins(tok):
    out = tok.encode("def hello(world):\n    return world + 1\n", add_special_tokens=False)
    deltas, stopped, detok = stream(tok, [0], out, SamplingParams(stop=["return", "(", "zzz"]))
    assert stopped and detok.stop_string == "("
    assert "".join(deltas) == "def hello"


def test_stop_string_at_very_start(tok):
    out = tok.encode("The fox", add_special_tokens=False)
    deltas, stopped, _ = stream(tok, [0], out, SamplingParams(stop=["The"]))
    assert stopped and "".join(deltas) == ""


def test_push_after_stop_emits_nothing(tok):
    detok = IncrementalDetokenizer(tok, [0], SamplingParams(stop=["fox"]))
    text, stopped = detok.push(tok.encode("a fox and more", add_special_tokens=False))
    assert stopped and text == "a "
    assert detok.push(tok.encode("fox", add_special_tokens=False)) == ("", True)
    assert detok.flush() == ""


def test_tiny_model_tokenizer_round_trip(tmp_path):
    tiny = pytest.importorskip("metrale.gpu_worker.tiny_model")
    folder = tiny.make_tiny_model(tmp_path / "tiny", arch="llama")
    tok = Tokenizer.from_dir(folder)
    text = "Hello, 世界! 😀 def f(x): return x"
    out = tok.encode(text, add_special_tokens=False)
    deltas, _, _ = stream(tok, tok.encode("Q:"), out, SamplingParams())
    assert "".join(deltas) == tok.decode(out)
    assert all("\ufffd" not in d for d in deltas[:-1])


# ---- finish(): a request's ids at once, exactly the text of pushing them one by one -------------------------


class CountingTokenizer(Tokenizer):
    """metrale's Tokenizer, counting decode calls."""

    calls = 0

    def decode(self, ids, skip_special_tokens=True):
        CountingTokenizer.calls += 1
        return Tokenizer.decode(self, ids, skip_special_tokens)


def fragment_ids(tok: Tokenizer) -> list[int]:
    """Ids that are pieces of multi-byte characters (never seen whole in training), and special ids."""
    pieces = tok.encode("猫 😀 🎉 ẞ ǅ \ufffd", add_special_tokens=False)
    specials = sorted(tok.special_token_ids)
    return pieces + specials + [tok.vocab_size + 5]  # one id past the vocabulary: decodes to nothing


def random_ids(rng: random.Random, tok: Tokenizer, pool: list[int], n: int) -> list[int]:
    """n ids, half from the whole vocabulary, half character fragments and special tokens."""
    return [rng.choice(pool) if rng.random() < 0.5 else rng.randrange(tok.vocab_size) for _ in range(n)]


def per_token_text(tok, prompt: list[int], out: list[int], params: SamplingParams) -> str:
    """The text today's streaming path makes: push one id at a time, then flush."""
    detok = IncrementalDetokenizer(tok, prompt, params)
    return "".join(detok.push([t])[0] for t in out) + detok.flush()


def check_finish_equals_pushing(tok, seed: int, trials: int = 150) -> None:
    """finish(all ids), and pushes then finish(the rest), equal push-per-id + flush on random ids."""
    rng = random.Random(seed)
    pool = fragment_ids(tok)
    for _ in range(trials):
        prompt = random_ids(rng, tok, pool, rng.randrange(0, 9))
        out = random_ids(rng, tok, pool, rng.randrange(0, 60))
        params = SamplingParams(skip_special_tokens=rng.random() < 0.5)
        want = per_token_text(tok, prompt, out, params)
        detok = IncrementalDetokenizer(tok, prompt, params)
        assert detok.finish(out) == want == detok.text
        assert detok.output_ids == out
        cut = rng.randrange(len(out) + 1)  # part streamed first: finish continues from any window
        detok = IncrementalDetokenizer(tok, prompt, params)
        streamed = "".join(detok.push([t])[0] for t in out[:cut])
        assert streamed + detok.finish(out[cut:]) == want


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_finish_equals_pushing_one_by_one_on_random_ids(tok, seed):
    check_finish_equals_pushing(tok, seed)


def test_finish_equals_pushing_with_an_added_token_outside_the_byte_alphabet(tok_dir, tmp_path):
    """An added token whose text is not byte-level symbols (its raw UTF-8 is used) keeps the equality."""
    hf = HfTokenizer.from_file(str(tok_dir / "tokenizer.json"))
    hf.add_tokens(["  été ☕ ", "é"])
    folder = tmp_path / "added"
    folder.mkdir()
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text((tok_dir / "tokenizer_config.json").read_text())
    check_finish_equals_pushing(Tokenizer.from_dir(folder), seed=9)


def test_finish_decodes_once_on_a_byte_level_tokenizer(tok_dir):
    """Without stop strings: a couple of decodes for the whole request, however many ids."""
    counting = CountingTokenizer.from_dir(tok_dir)
    out = counting.encode("你好世界 😀 the quick brown fox " * 4, add_special_tokens=False)
    detok = IncrementalDetokenizer(counting, [0, 5], SamplingParams())
    CountingTokenizer.calls = 0
    assert detok.finish(out) == counting.decode(out)
    assert CountingTokenizer.calls <= 3  # the window (and its new prefix), and the check's own decode


def test_finish_with_stop_strings_pushes_and_stops(tok):
    """With stop strings finish is push + flush: it stops at the stop string and accepts no later id."""
    out = tok.encode("The quick brown fox jumps over", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [0], SamplingParams(stop=["fox"]))
    assert detok.has_stop_strings
    assert detok.finish(out) == "The quick brown "
    assert detok.stopped and len(detok.output_ids) < len(out)
    assert not IncrementalDetokenizer(tok, [0], SamplingParams(stop=[""])).has_stop_strings


def sentencepiece_like() -> Tokenizer:
    """A Llama-2 style decoder (▁ spaces, byte fallback, leading space stripped) over a hand-made vocabulary."""
    from tokenizers import Tokenizer as Hf, decoders as dec, models as mod

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for word in ["▁a", "b", "▁the", "c", "▁", "▁fox", "é"]:
        vocab[word] = len(vocab)
    hf = Hf(mod.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    hf.add_special_tokens(["<s>", "</s>"])
    hf.decoder = dec.Sequence([dec.Replace("▁", " "), dec.ByteFallback(), dec.Fuse(), dec.Strip(" ", 1, 0)])
    return Tokenizer(backend=hf, special_token_ids=frozenset({1, 2}))


def test_finish_equals_pushing_on_a_byte_fallback_tokenizer():
    """Where decode is not bytewise (a broken sequence is one U+FFFD per byte token), finish pushes per id."""
    sp = sentencepiece_like()
    e4, b8, ad, b = 3 + 0xE4, 3 + 0xB8, 3 + 0xAD, sp.backend.token_to_id("b")
    # one decode of the whole window would say "\ufffd" * 4 + "b": the first three bytes were a whole "中"
    assert per_token_text(sp, [1], [e4, b8, ad, e4, b], SamplingParams()) == "中\ufffd\ufffd\ufffdb"
    assert IncrementalDetokenizer(sp, [1], SamplingParams()).finish([e4, b8, ad, e4, b]) == "中\ufffd\ufffd\ufffdb"
    check_finish_equals_pushing(sp, seed=4)


# ---- token_texts: an id whose bytes are whole characters needs no decode ---------------------------------------


def stepped_texts(tok, prompt: list[int], chunks: list[list[int]], params: SamplingParams, table: bool):
    """Each push's (text, stopped), then flush's text, the ids accepted and the whole text: with the tokenizer's
    token_texts, or (table False) every id stepped through the DecodeStream as before token_texts."""
    detok = IncrementalDetokenizer(tok, prompt, params)
    if not table:
        detok._texts = None
    got = [detok.push(chunk) for chunk in chunks]
    return got, detok.flush(), detok.output_ids, detok.text


def random_chunks(rng: random.Random, out: list[int]) -> list[list[int]]:
    """out cut into pushes of 1 to 3 ids, mostly 1."""
    chunks, i = [], 0
    while i < len(out):
        n = rng.choice([1, 1, 1, 2, 3])
        chunks.append(out[i : i + n])
        i += n
    return chunks


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_token_texts_stream_exactly_the_decode_streams_deltas_on_valid_text(tok, seed):
    """Output ids of real text (whole characters split across ids included), both skip flags, chunks of 1-3, with
    and without stop strings: every push's text, the flush and the ids equal the DecodeStream-only path's."""
    rng = random.Random(seed)
    words = ["The", " quick", " 你好", "世界", " 😀", "🎉", " naïve", " café", " fox", "\n", " 猫", "<think>", "</s>"]
    for _ in range(120):
        text = "".join(rng.choice(words) for _ in range(rng.randrange(0, 20)))
        out = tok.encode(text, add_special_tokens=False)
        prompt = tok.encode("".join(rng.choice(words) for _ in range(3)))
        at = rng.randrange(len(text)) if text else 0
        stops = [text[at : at + 3]] if text and rng.random() < 0.3 else []
        params = SamplingParams(skip_special_tokens=rng.random() < 0.5, stop=[s for s in stops if s.strip()])
        chunks = random_chunks(rng, out)
        assert stepped_texts(tok, prompt, chunks, params, table=True) == \
            stepped_texts(tok, prompt, chunks, params, table=False)


@pytest.mark.parametrize("seed", [21, 22, 23])
def test_token_texts_stream_exactly_the_decode_streams_deltas_on_broken_bytes(tok, seed):
    """Random ids (character fragments that make broken UTF-8, special ids, one past the vocabulary), both skip
    flags, with and without stop strings: every push's text, the flush and the ids equal the DecodeStream-only
    path's; without stop strings the text is the whole decode and no delta ends in half a character."""
    rng = random.Random(seed)
    pool = fragment_ids(tok)
    for _ in range(150):
        prompt = random_ids(rng, tok, pool, rng.randrange(0, 9))
        out = random_ids(rng, tok, pool, rng.randrange(0, 60))
        skip = rng.random() < 0.5
        whole = tok.decode(out, skip_special_tokens=skip)
        at = rng.randrange(len(whole)) if whole else 0
        stops = [whole[at : at + 2]] if whole and rng.random() < 0.3 else []
        params = SamplingParams(skip_special_tokens=skip, stop=stops)
        chunks = random_chunks(rng, out)
        fast = stepped_texts(tok, prompt, chunks, params, table=True)
        assert fast == stepped_texts(tok, prompt, chunks, params, table=False)
        if not stops:
            assert fast[3] == whole
            assert not any(t.endswith("\ufffd") for t, _ in fast[0])  # a split character waits for its last byte


def test_whole_character_ids_are_not_stepped(tok, monkeypatch):
    """ASCII ids take their text from token_texts (no DecodeStream step); a split character is stepped, and the
    ids after it are table ids again."""
    steps = []
    original = IncrementalDetokenizer._step
    monkeypatch.setattr(IncrementalDetokenizer, "_step", lambda self, t: steps.append(t) or original(self, t))
    words = tok.encode(" the quick brown fox", add_special_tokens=False)
    emoji = tok.encode("😀", add_special_tokens=False)
    assert len(emoji) >= 2 and all(tok.token_text(t) is None for t in emoji)
    detok = IncrementalDetokenizer(tok, tok.encode("Q:"), SamplingParams())
    text = "".join(detok.push([t])[0] for t in words + emoji + words)
    assert text == tok.decode(words + emoji + words)
    assert steps == emoji  # only the emoji's pieces went through the stream


def test_token_texts_are_each_ids_whole_text_or_none(tok):
    assert len(tok.token_texts()) == tok.vocab_size
    for i in range(tok.vocab_size):
        alone = tok.decode([i])
        assert tok.token_text(i) == (None if "\ufffd" in alone else alone)
    assert tok.token_texts() == [tok.token_text(i) for i in range(tok.vocab_size)]  # each id decoded once, kept
    assert tok.token_text(tok.bos_token_id) == "" and tok.token_text(tok.bos_token_id, skip_special_tokens=False) == "<s>"


def test_token_texts_are_decoded_as_ids_are_met(tok_dir):
    """No id is decoded before a detokenizer meets it (a long vocabulary decoded whole would take a while at a
    server's start, and memory for ids it may never emit); the ids met are decoded and kept."""
    fresh = Tokenizer.from_dir(tok_dir)
    ids = fresh.encode(" the the fox", add_special_tokens=False)
    detok = IncrementalDetokenizer(fresh, [], SamplingParams())
    assert all(text is UNDECODED for text in fresh.token_texts())
    assert "".join(detok.push([t])[0] for t in ids) == " the the fox"
    met = {i for i, text in enumerate(fresh.token_texts()) if text is not UNDECODED}
    assert met == set(ids)

"""Grammars over FakeDevice's 48-token vocabulary: the tokens' spellings, and constraints compiled in-process."""

from __future__ import annotations

from metrale import xgrammar_core as xg
from metrale.ipc.messages import GrammarBlob, GrammarVocab
from metrale.ipc.sampling import StructuredOutputs

# id 1 is FakeDevice's EOS, 2 and 3 the harness's think tags; the rest spell JSON, numbers and letters.
FAKE_VOCAB = [
    "<unk>", "</s>", "<think>", "</think>",
    "{", "}", '"', ":", ",", " ", "[", "]", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9",
    "a", "b", "c", "d", "e", "ab", "cd", '"a"', '": ', "true", "false", "null", "-", ".", "x", "y",
    "z", '{"', '"}', "12", "34", "e1", ' "', '",', "abc", "xyz",
]  # fmt: skip
assert len(FAKE_VOCAB) == 48

FAKE_GRAMMAR_VOCAB = GrammarVocab(
    digest="fake-48", encoded_vocab=FAKE_VOCAB, vocab_type=xg.VOCAB_RAW, add_prefix_space=False, vocab_size=48,
    stop_token_ids=[1],
)

_compiler = None


def compiled(so: StructuredOutputs) -> GrammarBlob:
    """The constraint compiled against FAKE_GRAMMAR_VOCAB, as the frontend's helper would compile it."""
    global _compiler
    if _compiler is None:
        v = FAKE_GRAMMAR_VOCAB
        _compiler = xg.compiler(xg.tokenizer_info(v.encoded_vocab, v.vocab_type, v.vocab_size, v.stop_token_ids,
                                                  v.add_prefix_space))
    kind, spec = so.kind_and_spec()
    return GrammarBlob(key=f"{kind}:{spec}", data=xg.serialize(xg.compile_spec(_compiler, kind, spec)))


def text_of(token_ids: list[int]) -> str:
    """The output's text (EOS dropped)."""
    return "".join(FAKE_VOCAB[t] for t in token_ids if t != 1)

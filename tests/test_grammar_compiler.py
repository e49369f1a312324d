"""The frontend's grammar compiler: once per constraint, refusals cached, a compile past its time limit killed."""

from __future__ import annotations

import asyncio

import psutil
import pytest

from metrale import xgrammar_core as xg
from metrale.frontend.grammar_compiler import GrammarCompiler, GrammarRefused, grammar_vocab
from metrale.frontend.tokenizer import Tokenizer
from metrale.ipc.sampling import StructuredOutputs

# Many patterned properties: many seconds of xgrammar's time even on the tiny model's vocabulary.
SLOW = StructuredOutputs(json={
    "type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{3,30}[0-9]{2,9}"} for i in range(800)},
    "required": [f"p{i}" for i in range(800)],
})


@pytest.fixture(scope="module")
def vocab(tiny_model_dir):
    tok = Tokenizer.from_dir(tiny_model_dir("llama"))
    return grammar_vocab(tok, tok.vocab_size, tok.eos_token_ids)


@pytest.fixture
def compiler(vocab):
    c = GrammarCompiler(vocab, timeout_s=0.5)
    try:
        yield c
    finally:
        helper = c._helper.process.pid if c._helper is not None else None
        c.close()
        assert helper is None or not psutil.pid_exists(helper) or psutil.Process(helper).status() == psutil.STATUS_ZOMBIE


def test_the_vocabulary_is_the_tokenizers_byte_level_bpe(vocab, tiny_model_dir):
    """Every id's spelling, padded to the model's vocab size, as xgrammar's byte-level vocabulary."""
    tok = Tokenizer.from_dir(tiny_model_dir("llama"))
    assert vocab.vocab_type == xg.VOCAB_BYTE_LEVEL and len(vocab.encoded_vocab) == vocab.vocab_size
    assert all(vocab.encoded_vocab[tok.backend.token_to_id(t)] == t for t in ("def", "Ġself", "<|im_end|>"))


def test_a_constraint_compiles_once(compiler):
    """The same schema (as an object or its text) compiles once; the blob deserializes against the vocabulary."""
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}  # cheap to compile: the test is the cache

    async def twice():
        return await compiler.compile(StructuredOutputs(json=schema)), await compiler.compile(StructuredOutputs(json=schema))

    first, again = asyncio.run(twice())
    assert first is again and compiler.compiles == 1
    assert compiler.compile_blocking(StructuredOutputs(json='{"type":"object","properties":{"a":{"type":"boolean"}}}')) is first
    v = compiler.vocab
    info = xg.tokenizer_info(v.encoded_vocab, v.vocab_type, v.vocab_size, v.stop_token_ids, v.add_prefix_space)
    xg.matcher(xg.deserialize(first.data, info))


@pytest.mark.parametrize("so, why", [
    (StructuredOutputs(regex="(("), "parenthesis"),
    (StructuredOutputs(json='{"type": "nothing"}'), "nothing"),
    (StructuredOutputs(json="{not json"), "JSON"),
    (StructuredOutputs(grammar="root ::= undefined_rule"), "undefined_rule"),
])  # fmt: skip
def test_an_invalid_constraint_is_refused_and_remembered(compiler, so, why):
    """xgrammar's reason is kept; the repeat is answered from the cache."""
    with pytest.raises(GrammarRefused, match=why):
        compiler.compile_blocking(so)
    with pytest.raises(GrammarRefused, match=why):
        compiler.cached(so)
    assert compiler.compiles == 1


def test_a_compile_past_the_limit_is_refused_and_its_helper_killed(compiler):
    """The slow regex is refused at the limit, its helper process killed; the next compile gets a new helper."""
    compiler.compile_blocking(StructuredOutputs(choice=["a", "b"]))
    first = compiler._helper.process
    with pytest.raises(GrammarRefused, match="did not compile within 0.5 s"):
        asyncio.run(compiler.compile(SLOW))
    assert first.poll() is not None, "the helper was left compiling"
    blob = compiler.compile_blocking(StructuredOutputs(regex="[0-9]+"))
    assert blob.data and compiler._helper.process is not first and compiler._helper.process.poll() is None
    with pytest.raises(GrammarRefused, match="did not compile"):
        compiler.cached(SLOW)  # the refusal is remembered: no second helper is spent on it
